"""A run's lineage (docs/watch.md, "The batch behind a step"): which samples each rank's loop
received at every step. The file format, once, and its reader for `sharddemo lineage`. No torch:
the watch's writer (sharddemo.watching.lineage) encodes with the functions here.

A lineage folder holds:

- `lineage.json`, written by rank 0 when its loop receives its first batch: the schema, the
  run id, the world size, the dataset's length where known, the loader's name;
- `rank{r}.lineage` per rank, append-only: a 16-byte file header (MAGIC, the format version,
  the rank), then one record per batch the loop received, in order. A record is a 24-byte
  header (kind, id width, epoch, step, count, CRC-32 of the header's other fields and the
  ids) and the ids: uint32 where every id of the batch fits, else int64; padded to 8 bytes.
  A `RESTART` record (count 0) marks a resume from a checkpoint: its step is the first step
  of the resumed launch, and any record of an earlier launch from that step on (written after
  the checkpoint the run resumed from) is superseded. An `UNKNOWN` record (count 0) is a batch
  whose ids the watch could not attribute: it keeps the step count true.

A crash can leave the last record cut short: it fails its length or CRC check and is skipped
(`RankLineage.torn` says how many bytes). Steps count the batches a rank's loop received, from
0, across epochs and resumes.

    lineage = Lineage("runs/lineage")
    lineage.at_step(48112)        # [{"rank": 0, "epoch": 3, "step": 48112, "ids": [...]}, ...]
    lineage.where(1234)           # [{"epoch": 0, "step": 17, "rank": 1}, ...]
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from typing import Optional

import numpy as np

from sharddemo.errors import UsageError

SCHEMA = "sharddemo.lineage/1"
RUN_FILE = "lineage.json"
MAGIC = b"SDLINEAG"
VERSION = 1
FILE_HEADER = struct.Struct("<8sII")  # magic, version, rank: 16 bytes
# kind, width, flags, epoch, step, count, crc: 24 bytes
RECORD = struct.Struct("<BBHIQII")
BATCH, RESTART, UNKNOWN = 0, 1, 2
UINT32_MAX = 2**32 - 1


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.lineage")


def file_header(rank: int) -> bytes:
    return FILE_HEADER.pack(MAGIC, VERSION, rank)


def encode(kind: int, epoch: int, step: int, ids: Optional[np.ndarray] = None) -> bytes:
    """One record: uint32 ids where every id fits (4 bytes a sample), else int64 (8)."""
    if ids is None or len(ids) == 0:
        payload, width, count = b"", 4, 0
    else:
        ids = np.asarray(ids)
        count = len(ids)
        if int(ids.min()) >= 0 and int(ids.max()) <= UINT32_MAX:
            payload, width = ids.astype("<u4", copy=False).tobytes(), 4
        else:
            payload, width = ids.astype("<i8", copy=False).tobytes(), 8
        if len(payload) % 8:
            payload += b"\0" * (8 - len(payload) % 8)
    head = RECORD.pack(kind, width, 0, epoch, step, count, 0)[:-4]
    crc = zlib.crc32(payload, zlib.crc32(head))
    return head + struct.pack("<I", crc) + payload


def encode_many(kinds, epochs, steps, counts, ids) -> bytes:
    """Several records at once (the writer's chunk): `ids` all the batches' ids end to end,
    `counts` each batch's share; uint32 for the whole chunk where every id fits, else int64."""
    ids = np.asarray(ids)
    width = 4 if len(ids) == 0 or (int(ids.min()) >= 0 and int(ids.max()) <= UINT32_MAX) else 8
    flat = ids.astype("<u4" if width == 4 else "<i8", copy=False).tobytes()
    out, at = [], 0
    pack, crc32 = RECORD.pack, zlib.crc32
    for kind, epoch, step, count in zip(kinds, epochs, steps, counts):
        size = width * count
        payload = flat[at:at + size]
        at += size
        if size % 8:
            payload += b"\0" * (8 - size % 8)
        head = pack(kind, width, 0, epoch, step, count, 0)[:-4]
        out += (head, struct.pack("<I", crc32(payload, crc32(head))), payload)
    return b"".join(out)


def payload_size(width: int, count: int) -> int:
    return (width * count + 7) // 8 * 8


def write_run_file(folder: str, run: dict) -> None:
    """lineage.json, written whole then renamed (a reader never sees half of it)."""
    path = os.path.join(folder, RUN_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump({"schema": SCHEMA, "format": VERSION, **run}, handle)
    os.replace(path + ".tmp", path)


def read_run_file(folder: str) -> Optional[dict]:
    path = os.path.join(folder, RUN_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            run = json.load(handle)
    except (OSError, ValueError):
        return None
    return run if isinstance(run, dict) and run.get("schema") == SCHEMA else None


class RankLineage:
    """One rank's file, indexed on open (one pass over the record headers, not the ids).
    `records`: kind, epoch, step, offset (of the ids), count, width per valid record, in the
    file's order, superseded ones (before a restart) dropped. `torn`: bytes of a last record
    cut short, skipped. `restarts`: the steps at which a resumed launch went on."""

    def __init__(self, path: str, rank: int) -> None:
        self.path, self.rank = path, rank
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            self.data = (mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size
                         else b"")
        if len(self.data) < FILE_HEADER.size or self.data[:8] != MAGIC:
            raise UsageError(f"{path} is not a lineage file (no {MAGIC.decode()} header)")
        table, self.valid_end = walk(self.data)
        self.torn = len(self.data) - self.valid_end
        restart = table[:, 0] == RESTART
        self.restarts = table[restart, 2].tolist()
        # a restart at S supersedes the earlier launches' steps >= S: each batch is kept
        # where its step is below every later restart's
        cut = np.where(restart, table[:, 2], np.iinfo(np.int64).max)
        later = np.minimum.accumulate(cut[::-1])[::-1]
        later = np.append(later[1:], np.iinfo(np.int64).max)
        table = table[~restart & (table[:, 2] < later)]
        self.kind, self.epoch, self.step = table[:, 0], table[:, 1], table[:, 2]
        self.offset, self.count, self.width = table[:, 3], table[:, 4], table[:, 5]

    @property
    def steps(self) -> int:
        return int(self.step[-1]) + 1 if len(self.step) else 0

    def ids(self, row: int) -> list[int]:
        start, count, width = int(self.offset[row]), int(self.count[row]), int(self.width[row])
        head = self.data[start - RECORD.size:start - 4]
        payload = self.data[start:start + payload_size(width, count)]
        (crc,) = struct.unpack_from("<I", self.data, start - 4)
        if zlib.crc32(payload, zlib.crc32(head)) != crc:
            raise UsageError(f"{self.path}: the record of step {int(self.step[row])} fails its "
                             "CRC check (the file was damaged after it was written)")
        return np.frombuffer(payload, dtype="<u4" if width == 4 else "<i8",
                             count=count).tolist()

    def row_of(self, step: int, epoch: Optional[int] = None) -> Optional[int]:
        """The record of `step` (of the run; with `epoch`: the epoch's step-th batch)."""
        if epoch is not None:
            in_epoch = np.flatnonzero(self.epoch == epoch)
            return int(in_epoch[step]) if step < len(in_epoch) else None
        row = int(np.searchsorted(self.step, step))
        return row if row < len(self.step) and self.step[row] == step else None

    def rows_with(self, sample: int) -> list[int]:
        """The records that hold `sample`: a vectorised search of the whole file for its low
        32 bits, then each hit checked to lie in a record's ids (not a header) and, for int64
        ids, to be the whole id."""
        if len(self.offset) == 0:
            return []
        words = np.frombuffer(self.data, dtype="<u4", count=self.valid_end // 4)
        low = sample & 0xFFFFFFFF
        hits = np.flatnonzero(words == np.uint32(low)) * 4
        if len(hits) == 0:
            return []
        rows = np.searchsorted(self.offset, hits, side="right") - 1
        found = []
        for at, row in zip(hits.tolist(), rows.tolist()):
            if row < 0 or self.kind[row] != BATCH:
                continue
            start, width = int(self.offset[row]), int(self.width[row])
            if at >= start + width * int(self.count[row]):
                continue
            if width == 4 and 0 <= sample <= UINT32_MAX:
                found.append(row)
            elif width == 8 and (at - start) % 8 == 0 and \
                    struct.unpack_from("<q", self.data, at)[0] == sample:
                found.append(row)
        return sorted(set(found))


def walk(data) -> tuple[np.ndarray, int]:
    """The records of a rank file, by their headers: a row (kind, epoch, step, offset of the
    ids, count, width) each, and where the valid part ends. A record that does not fit in the file
    (a crash cut it) ends the walk; so does a last record whose CRC fails.

    Most records of a file have the same size (a loader's batches): from each record, the
    next ones are guessed at that stride and checked all at once (numpy), and the walk goes
    record by record only where the guess fails (an epoch's last batch, a restart)."""
    end = len(data)
    if end < FILE_HEADER.size + RECORD.size:
        return np.empty((0, 6), dtype=np.int64), FILE_HEADER.size
    usable = end // 8 * 8
    bytes_ = np.frombuffer(data, dtype=np.uint8, count=usable)
    words = bytes_.view("<u4")
    longs = bytes_.view("<u8")
    rows: list[np.ndarray] = []
    at = FILE_HEADER.size
    unpack = RECORD.unpack_from
    while at + RECORD.size <= end:
        kind, width, _, epoch, step, count, _ = unpack(data, at)
        size = RECORD.size + payload_size(width, count)
        if kind > UNKNOWN or width not in (4, 8) or at + size > end:
            break
        rows.append(np.array([(kind, epoch, step, at + RECORD.size, count, width)],
                             dtype=np.int64))
        at += size
        if kind != BATCH:
            continue
        # the same batch size again: records at at, at + size, ... with steps step + 1, ...
        room = (end - at) // size
        if room < 2:
            continue
        guess = at + size * np.arange(room, dtype=np.int64)
        same = ((bytes_[guess] == kind) & (bytes_[guess + 1] == width)
                & (words[guess // 4 + 1] == epoch)
                & (longs[guess // 8 + 1] == step + 1 + np.arange(room, dtype=np.uint64))
                & (words[guess // 4 + 4] == count))
        taken = int(np.argmin(same)) if not same.all() else room
        if taken:
            block = np.empty((taken, 6), dtype=np.int64)
            block[:] = (kind, epoch, 0, 0, count, width)
            block[:, 2] = step + 1 + np.arange(taken)
            block[:, 3] = guess[:taken] + RECORD.size
            rows.append(block)
            at += size * taken
    table = np.concatenate(rows) if rows else np.empty((0, 6), dtype=np.int64)
    if len(table):  # a crash tears the end only: the last record is checked whole
        kind, epoch, step, start, count, width = table[-1].tolist()
        head = data[start - RECORD.size:start - 4]
        (crc,) = struct.unpack_from("<I", data, start - 4)
        if zlib.crc32(data[start:start + payload_size(width, count)], zlib.crc32(head)) != crc:
            table = table[:-1]
            at = start - RECORD.size
    return table, at


def valid_length(path: str) -> int:
    """How much of a rank file is whole records (the writer cuts a torn tail before it
    appends again)."""
    with open(path, "rb") as handle:
        data = handle.read()
    if len(data) < FILE_HEADER.size:
        return 0
    return walk(data)[1]


class Lineage:
    """A lineage folder: its run file and every rank's file (UsageError for a folder that is
    not one). The ranks are those whose file is in the folder (a resume on more ranks adds
    files); what the reader says is what is written, which after a crash may end before what
    a rank received."""

    def __init__(self, folder: str) -> None:
        if not os.path.isdir(folder):
            raise UsageError(f"{folder} is not a lineage folder (not a folder): give the folder "
                             "passed to watch(..., lineage=DIR)")
        self.folder = folder
        self.run = read_run_file(folder)
        if self.run is None:
            raise UsageError(f"{folder} is not a lineage folder (no {RUN_FILE} of schema "
                             f"{SCHEMA}): give the folder passed to watch(..., lineage=DIR)")
        self.world_size = int(self.run.get("world_size") or 1)  # (the first launch's)
        # each launch's first step and world size, in order (a run file without them: one)
        self.launches = [(int(launch.get("first_step") or 0),
                          int(launch.get("world_size") or self.world_size))
                         for launch in self.run.get("launches") or [{}]]
        self.loaded: dict[int, RankLineage] = {}
        self.ends: dict[int, int] = {}  # rank: the first step of a later launch without it

    def ranks(self) -> list[int]:
        """The ranks with a file in the folder, in order."""
        found = []
        for name in os.listdir(self.folder):
            head, _, tail = name.partition("rank")
            if not head and tail.endswith(".lineage") and tail[:-8].isdigit():
                found.append(int(tail[:-8]))
        return sorted(found)

    def run_ranks(self) -> int:
        """How many ranks the run had at most, over its launches."""
        return max(world for _, world in self.launches)

    def rank(self, rank: int) -> RankLineage:
        if rank not in self.loaded:
            if not os.path.exists(rank_file(self.folder, rank)):
                files = ", ".join(map(str, self.ranks())) or "none"
                had = self.run_ranks()
                why = (f"rank {rank} wrote no lineage file (the run had ranks 0..{had - 1})"
                       if 0 <= rank < had else
                       f"--rank {rank} does not exist: this run had ranks 0..{had - 1}")
                raise UsageError(f"{why}; ranks with a lineage file: {files}")
            self.loaded[rank] = RankLineage(rank_file(self.folder, rank), rank)
            # a rank that a later launch (a resume on fewer ranks) did not have: its steps
            # from that launch's first step on were superseded by the resume, as the other
            # ranks' are by their restart records
            last = max((i for i, (_, world) in enumerate(self.launches) if rank < world),
                       default=None)
            if last is not None and last + 1 < len(self.launches):
                self.ends[rank] = min(first for first, _ in self.launches[last + 1:])
        return self.loaded[rank]

    def visible(self, rank: int, row: Optional[int]) -> bool:
        return row is not None and int(self.rank(rank).step[row]) < self.ends.get(
            rank, np.iinfo(np.int64).max)

    def written(self, rank: int) -> Optional[tuple[int, int]]:
        """The first and the last step of `rank`'s written lineage (None: nothing written)."""
        steps = self.rank(rank).step
        steps = steps[steps < self.ends.get(rank, np.iinfo(np.int64).max)]
        return (int(steps[0]), int(steps[-1])) if len(steps) else None

    def lookup(self, step: int, rank: Optional[int] = None,
               epoch: Optional[int] = None) -> tuple[list[dict], list[dict]]:
        """What each rank (or `rank`) received at `step` (with `epoch`: the epoch's step-th
        batch), and, for each rank whose written lineage has no such step, why not: a dict
        with the rank, its first and last written step (None where nothing is) and a `note`.
        UsageError where no rank's written lineage has it."""
        if step < 0:
            raise UsageError(f"--step must be 0 or more, got {step}")
        out, missing, short = [], [], []
        ranks = [rank] if rank is not None else sorted(
            set(self.ranks()) | set(range(self.run_ranks())))
        for r in ranks:
            if rank is None and not os.path.exists(rank_file(self.folder, r)):
                missing.append({"rank": r, "first_step": None, "last_step": None,
                                "note": f"rank {r}: no lineage file"})
                short.append(f"rank {r}: no lineage file")
                continue
            lineage = self.rank(r)
            row = lineage.row_of(step, epoch)
            if not self.visible(r, row):
                entry, brief = self.gap(r, step, epoch)
                missing.append(entry)
                short.append(brief)
                continue
            kind = int(lineage.kind[row])
            out.append({"rank": r, "epoch": int(lineage.epoch[row]),
                        "step": int(lineage.step[row]),
                        "ids": lineage.ids(row) if kind == BATCH else None})
        if not out:
            where = f" of epoch {epoch}" if epoch is not None else ""
            raise UsageError(f"no rank's written lineage has --step {step}{where} ("
                             + "; ".join(short) + ")")
        return out, missing

    def gap(self, rank: int, step: int, epoch: Optional[int]) -> tuple[dict, str]:
        """Why `rank`'s written lineage has no `step` (of `epoch`), in words, long (a line of
        its own) and short (for a list)."""
        written = self.written(rank)
        first, last = written or (None, None)
        if written is None:
            note = short = f"rank {rank}: nothing written"
        elif epoch is not None:
            lineage = self.rank(rank)
            held = int(((lineage.epoch == epoch) & (lineage.step <= last)).sum())
            short = f"rank {rank}: {held} batches of epoch {epoch}, written up to step {last}"
            note = (f"rank {rank}: its lineage holds {held} batches of epoch {epoch} "
                    f"(written up to step {last})")
        elif step > last:
            short = f"rank {rank}: written up to step {last}"
            note = f"rank {rank}: its lineage ends before step {step} (written up to step {last})"
        elif step < first:
            joined = " (it joined the run at a resume there)" if any(
                at == first and i and rank >= self.launches[i - 1][1]
                for i, (at, _) in enumerate(self.launches)) else ""
            short = f"rank {rank}: begins at step {first}"
            note = f"rank {rank}: its lineage begins at step {first}{joined}"
        else:
            short = f"rank {rank}: written for steps {first}..{last}, with gaps"
            note = f"rank {rank}: step {step} is not in its lineage (written: steps " \
                   f"{first}..{last}, with gaps)"
        return {"rank": rank, "first_step": first, "last_step": last, "note": note}, short

    def at_step(self, step: int, rank: Optional[int] = None,
                epoch: Optional[int] = None) -> list[dict]:
        """What each rank (or `rank`) received at `step` (lookup's batches); UsageError where
        no rank's written lineage has that step."""
        return self.lookup(step, rank, epoch)[0]

    def where(self, sample: int) -> list[dict]:
        """Every (epoch, step, rank) at which the written lineage has `sample`, by step then
        rank."""
        out = []
        for r in self.ranks():
            lineage = self.rank(r)
            out += [{"epoch": int(lineage.epoch[row]), "step": int(lineage.step[row]),
                     "rank": r} for row in lineage.rows_with(sample) if self.visible(r, row)]
        return sorted(out, key=lambda hit: (hit["step"], hit["rank"]))

    def outside(self, sample: int) -> Optional[str]:
        """Why `sample` is not an id of the dataset (None: it may be one)."""
        size = self.run.get("dataset_size")
        if sample < 0:
            return f"--id {sample} is outside the dataset: ids are 0 or more"
        if size is not None and sample >= int(size):
            return (f"--id {sample} is outside the dataset: its ids are 0..{int(size) - 1} "
                    f"(dataset_size {int(size)} in {RUN_FILE})")
        return None

    def torn(self) -> dict[int, int]:
        return {r: self.loaded[r].torn for r in sorted(self.loaded) if self.loaded[r].torn}
