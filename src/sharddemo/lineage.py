"""A run's lineage (docs/watch.md, "The batch behind a step"): which samples each rank's loop
received at every step. The file format, once, and its reader for `sharddemo lineage`. No torch:
the watch's writer (sharddemo.watching.lineage) encodes with the functions here.

A lineage folder holds:

- `lineage.json`, written by rank 0 when its loop receives its first batch: the schema, the
  run id, the world size, the dataset's length where known, the loader's name;
- `rank{r}.lineage` per rank, append-only: a 16-byte file header (MAGIC, the format version,
  the rank), then one chunk per write of the writer (every 256 batches, an epoch's change, a
  checkpoint, the exit), each holding the consecutive steps of one epoch.

A chunk is a 32-byte header (`CHUNK`: kind, id width in bits, size width in bits, flags, epoch,
first step, batch count, the batches' size where they all have one, payload length, CRC-32 of
the header's other fields and the payload), then its payload, each part byte-aligned:

1. with `BASE`: an int64 subtracted from every stored id (negative ids, or ids all far from 0);
2. with `UNKNOWNS`: one bit a batch, set for a batch whose ids the watch could not attribute
   (it keeps the step count true; no ids);
3. with `RUNS`: one bit a batch, set for a batch of 2 or more consecutive ascending ids, which
   is stored as its first id alone;
4. unless `UNIFORM` (every known batch has the header's size): the known batches' sizes,
   packed at the size width;
5. the stored ids (every id of a plain batch, the first of a run), minus the base, packed at
   the id width: the fewest bits the chunk's largest stored id needs (18 for ids below
   2 x 10^5, 27 below 10^8, up to 64), little-endian bit order.

A `RESTART` chunk (no batches, no payload) marks a resume from a checkpoint: its step is the
first step of the resumed launch, and any batch of an earlier launch from that step on (written
after the checkpoint the run resumed from) is superseded.

A crash can leave the last chunk cut short: it fails its length or CRC check and is skipped
(`RankLineage.torn` says how many bytes); the writer cuts it off before a resumed run appends.
The reader indexes a file by its chunk headers alone (the ids are decoded for the chunk a lookup
needs). Steps count the batches a rank's loop received, from 0, across epochs and resumes.
Format 2 (this one) replaced format 1 (a 24-byte header and uint32 or int64 ids per batch);
a format-1 file is refused with a message that says so.

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
VERSION = 2
FILE_HEADER = struct.Struct("<8sII")  # magic, version, rank: 16 bytes
# kind, id width, size width, flags, epoch, first step, batches, size, payload length, crc
CHUNK = struct.Struct("<BBBBIQIIII")  # 32 bytes
BATCH, RESTART, UNKNOWN = 0, 1, 2  # what a step (a row of the reader) is
CHUNK_BATCHES, CHUNK_RESTART = 0, 1  # what a chunk is
UNIFORM, RUNS, UNKNOWNS, BASE = 1, 2, 4, 8  # a chunk's flags
FLAGS = UNIFORM | RUNS | UNKNOWNS | BASE
# a chunk's limits (encode_many starts another past them): its payload stays well under the
# 4 GB its length field can say, and one chunk's decode well under a second
MAX_CHUNK_IDS = 1 << 24
MAX_CHUNK_BATCHES = 1 << 20
U64 = np.uint64


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.lineage")


def file_header(rank: int) -> bytes:
    return FILE_HEADER.pack(MAGIC, VERSION, rank)


def pack(values: np.ndarray, width: int) -> bytes:
    """`values` (uint64, each below 2**width) packed at `width` bits each, the first value in
    the lowest bits: ceil(len * width / 8) bytes. Vectorised, no loop over the values: every 8
    values fill `width` whole bytes, so the k-th value of each 8 starts at the same byte and
    bit of its group (k * width / 8), and each k is one strided OR into the groups' bytes."""
    n = len(values)
    if n == 0 or width == 0:
        return b""
    if width in (8, 16, 32, 64):
        return values.astype(f"<u{width // 8}").tobytes()
    nbytes = (n * width + 7) // 8
    if 8 <= width <= 57:  # (a value and its shift in 8 bytes; groups whose k-th do not overlap)
        groups = -(-n // 8)
        padded = np.zeros(groups * 8, dtype=U64)
        padded[:n] = values
        out = np.zeros(groups * width + 8, dtype=np.uint8)
        for k in range(8):
            into = np.ndarray((groups,), dtype="<u8", buffer=out, offset=k * width >> 3,
                              strides=(width,))
            into |= padded[k::8] << U64(k * width & 7)
        return out[:nbytes].tobytes()
    # the other widths: each 64-bit word is the OR of the values that start in it (one
    # reduceat), plus the high part of the one that started in the word before and spills
    bit = np.arange(n, dtype=U64) * U64(width)
    word = (bit >> U64(6)).astype(np.intp)
    shift = bit & U64(63)
    starts = np.flatnonzero(np.concatenate(([True], word[1:] != word[:-1])))
    words = np.zeros(nbytes // 8 + 2, dtype="<u8")
    words[word[starts]] = np.bitwise_or.reduceat(values << shift, starts)
    spill = np.flatnonzero(shift > U64(64 - width))
    if len(spill):  # (a word's start has one straddler at most: these indexes are distinct)
        words[word[spill] + 1] |= values[spill] >> (U64(64) - shift[spill])
    return words.view(np.uint8)[:nbytes].tobytes()


def unpack(data, n: int, width: int) -> np.ndarray:
    """The `n` values of `width` bits that pack() wrote at the start of `data`, as uint64."""
    if n == 0:
        return np.empty(0, dtype=U64)
    if width == 0:
        return np.zeros(n, dtype=U64)
    if width in (8, 16, 32, 64):
        return np.frombuffer(data, dtype=f"<u{width // 8}", count=n).astype(U64)
    nbytes = (n * width + 7) // 8
    mask = U64((1 << width) - 1)
    if width <= 57:  # the k-th value of every 8: one strided read of 8 bytes, one shift
        groups = -(-n // 8)
        padded = np.zeros(groups * width + 8, dtype=np.uint8)
        padded[:nbytes] = np.frombuffer(data, dtype=np.uint8, count=nbytes)
        out = np.empty(groups * 8, dtype=U64)
        for k in range(8):
            np.right_shift(np.ndarray((groups,), dtype="<u8", buffer=padded,
                                      offset=k * width >> 3, strides=(width,)),
                           U64(k * width & 7), out=out[k::8])
        out &= mask
        return out[:n]
    words = np.zeros(nbytes // 8 + 2, dtype="<u8")
    words.view(np.uint8)[:nbytes] = np.frombuffer(data, dtype=np.uint8, count=nbytes)
    bit = np.arange(n, dtype=U64) * U64(width)
    word = (bit >> U64(6)).astype(np.intp)
    shift = bit & U64(63)
    out = words[word] >> shift
    # the next word's bits, shifted up by 64 - shift: in two steps, so that a value that
    # starts on a word's first bit (shift 0) takes none (a shift by 64 is not defined)
    out |= (words[word + 1] << U64(1)) << (U64(63) - shift)
    return out & mask


def encode(kind: int, epoch: int, step: int, ids: Optional[np.ndarray] = None) -> bytes:
    """One step as a chunk of its own: a batch (its ids), a batch of unknown ids, or a restart."""
    ids = np.asarray(ids if ids is not None and kind == BATCH else [], dtype=np.int64)
    return encode_many([kind], [epoch], [step], [len(ids)], ids)


def encode_many(kinds, epochs, steps, counts, ids) -> bytes:
    """Several steps at once (the writer's buffer): `kinds` BATCH, UNKNOWN or RESTART each,
    `ids` all the batches' ids end to end, `counts` each batch's share (0 for the others).
    One chunk for each stretch of consecutive steps of one epoch (a restart a chunk of its
    own)."""
    kinds = np.asarray(kinds, dtype=np.int64)
    epochs = np.asarray(epochs, dtype=np.int64)
    steps = np.asarray(steps, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    ids = np.asarray(ids).astype(np.int64, copy=False).reshape(-1)
    n = len(kinds)
    if n == 0:
        return b""
    ends = np.cumsum(counts)
    starts = ends - counts
    cut = np.ones(n + 1, dtype=bool)
    cut[1:-1] = ((kinds[1:] == RESTART) | (kinds[:-1] == RESTART)
                 | (epochs[1:] != epochs[:-1]) | (steps[1:] != steps[:-1] + 1))
    bounds = np.flatnonzero(cut).tolist()
    out: list[bytes] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if kinds[a] == RESTART:
            head = CHUNK.pack(CHUNK_RESTART, 0, 0, 0, int(epochs[a]), int(steps[a]), 0, 0, 0,
                              0)[:-4]
            out += (head, struct.pack("<I", zlib.crc32(head)))
            continue
        while a < b:  # (a stretch past a chunk's limits: several chunks)
            end = min(b, a + MAX_CHUNK_BATCHES,
                      max(a + 1, int(np.searchsorted(ends, starts[a] + MAX_CHUNK_IDS,
                                                     side="right"))))
            out.append(encode_chunk(kinds[a:end], int(epochs[a]), int(steps[a]),
                                    counts[a:end], ids[starts[a]:ends[end - 1]]))
            a = end
    return b"".join(out)


def encode_chunk(kinds: np.ndarray, epoch: int, step: int, sizes: np.ndarray,
                 ids: np.ndarray) -> bytes:
    """One chunk of batches (steps step, step + 1, ...; UNKNOWN ones with size 0)."""
    count = len(kinds)
    unknown = kinds == UNKNOWN
    ends = np.cumsum(sizes)
    starts = ends - sizes
    # a run: 2 or more ids, each one more than the one before
    breaks = np.concatenate(([0], np.cumsum(np.diff(ids) != 1)))
    run = sizes >= 2
    run[run] = breaks[ends[run] - 1] == breaks[starts[run]]
    if run.any():  # a run keeps its first id
        inner = np.repeat(run, sizes)
        inner[starts[run]] = False
        stored = ids[~inner]
    else:
        stored = ids
    flags, parts, base, width = 0, [], 0, 0
    if len(stored):
        low, high = int(stored.min()), int(stored.max())
        width = (high - low).bit_length()
        # from 0 where that costs no more than the base's 8 bytes: the ids as they are
        if low >= 0 and (high.bit_length() - width) * len(stored) <= 64:
            width, low = high.bit_length(), 0
        else:
            flags |= BASE
            base = low
            parts.append(struct.pack("<q", low))
    if unknown.any():
        flags |= UNKNOWNS
        parts.append(np.packbits(unknown, bitorder="little").tobytes())
    if run.any():
        flags |= RUNS
        parts.append(np.packbits(run, bitorder="little").tobytes())
    known = sizes[~unknown]
    size, size_width = 0, 0
    if len(known) == 0 or (known == known[0]).all():
        flags |= UNIFORM
        size = int(known[0]) if len(known) else 0
    else:
        size_width = int(known.max()).bit_length()
        parts.append(pack(known.astype(U64), size_width))
    values = stored.view(U64) - U64(base % 2**64) if flags & BASE else stored.view(U64)
    parts.append(pack(values, width))
    payload = b"".join(parts)
    head = CHUNK.pack(CHUNK_BATCHES, width, size_width, flags, epoch, step, count, size,
                      len(payload), 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + payload


class Layout:
    """A chunk's payload read up to its ids (no CRC check: decode() checks it): `base`,
    `unknown`, `run`, `size` per batch (0 for an unknown batch), where each batch's stored
    ids start (`start`), how many ids are stored, and where they lie in the file (`at`)."""

    def __init__(self, data, chunk: np.ndarray) -> None:
        (_, self.width, size_width, flags, _, _, count, size, at, length) = chunk.tolist()
        end = at + length
        self.base = 0
        if flags & BASE:
            (self.base,) = struct.unpack_from("<q", data, at)
            at += 8
        bitmap = (count + 7) // 8
        self.unknown = np.zeros(count, dtype=bool)
        self.run = np.zeros(count, dtype=bool)
        for flag, bits in ((UNKNOWNS, self.unknown), (RUNS, self.run)):
            if flags & flag:
                bits[:] = np.unpackbits(np.frombuffer(data, np.uint8, bitmap, at), count=count,
                                        bitorder="little").astype(bool)
                at += bitmap
        known = int(count - self.unknown.sum())
        self.size = np.zeros(count, dtype=np.int64)
        if flags & UNIFORM:
            self.size[~self.unknown] = size
        else:
            self.size[~self.unknown] = unpack(data[at:end], known, size_width).astype(np.int64)
            at += (known * size_width + 7) // 8
        per = np.where(self.run, 1, self.size)
        self.start = np.cumsum(per) - per
        self.stored = int(per.sum())
        self.at = at
        if at + (self.stored * self.width + 7) // 8 != end:
            raise ValueError("the chunk's parts do not add up to its length")


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
    """One rank's file, indexed on open from its chunk headers (no id decoded). A row per step,
    in the file's order, superseded ones (before a restart) dropped: `kind` (BATCH, UNKNOWN),
    `epoch`, `step`, `count` (its ids), `chunk` and `within` (its chunk, and its place there).
    `chunks`: a row per valid chunk (kind, id width, size width, flags, epoch, first step,
    batches, size, payload offset, payload length). `torn`: bytes of a last chunk cut short,
    skipped. `restarts`: the steps at which a resumed launch went on."""

    def __init__(self, path: str, rank: int) -> None:
        self.path, self.rank = path, rank
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            self.data = (mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size
                         else b"")
        if len(self.data) < FILE_HEADER.size or self.data[:8] != MAGIC:
            raise UsageError(f"{path} is not a lineage file (no {MAGIC.decode()} header)")
        check_version(path, self.data)
        self.chunks, self.valid_end = walk(self.data)
        self.torn = len(self.data) - self.valid_end
        chunks = self.chunks
        restart = chunks[:, 0] == CHUNK_RESTART
        per = np.where(restart, 1, chunks[:, 6])
        chunk = np.repeat(np.arange(len(chunks)), per)
        first = np.cumsum(per) - per
        within = np.arange(int(per.sum())) - first[chunk]
        kind = np.where(restart, RESTART, BATCH)[chunk]
        epoch, step = chunks[chunk, 4], chunks[chunk, 5] + within
        count = chunks[chunk, 7]
        # the few chunks whose batches differ in size or hold unknown ones (an epoch's last
        # chunk, say): their layout read
        odd = (chunks[:, 3] & UNKNOWNS) | (~chunks[:, 3] & UNIFORM)
        for c in np.flatnonzero(~restart & (odd != 0)).tolist():
            layout = self.layout(c)
            rows = slice(int(first[c]), int(first[c] + per[c]))
            kind[rows] = np.where(layout.unknown, UNKNOWN, BATCH)
            count[rows] = layout.size
        self.restarts = step[kind == RESTART].tolist()
        # a restart at S supersedes the earlier launches' steps >= S: each batch is kept
        # where its step is below every later restart's
        cut = np.where(kind == RESTART, step, np.iinfo(np.int64).max)
        later = np.minimum.accumulate(cut[::-1])[::-1]
        later = np.append(later[1:], np.iinfo(np.int64).max)
        keep = (kind != RESTART) & (step < later)
        self.kind, self.epoch, self.step, self.count = kind[keep], epoch[keep], step[keep], \
            count[keep]
        self.chunk, self.within = chunk[keep], within[keep]
        self.decoded: dict[int, tuple[Layout, np.ndarray]] = {}

    @property
    def steps(self) -> int:
        return int(self.step[-1]) + 1 if len(self.step) else 0

    def layout(self, chunk: int) -> Layout:
        try:
            return Layout(self.data, self.chunks[chunk])
        except (ValueError, struct.error):
            raise self.damaged(chunk, "does not add up to its length") from None

    def damaged(self, chunk: int, how: str = "fails its CRC check") -> UsageError:
        first, count = int(self.chunks[chunk, 5]), int(self.chunks[chunk, 6])
        return UsageError(f"{self.path}: the chunk of steps {first}..{first + count - 1} {how} "
                          "(the file was damaged after it was written)")

    def decode(self, chunk: int) -> tuple[Layout, np.ndarray]:
        """A chunk's layout and its stored ids (uint64, less the base), CRC checked; the last
        one decoded is kept (a lookup's steps often share a chunk)."""
        if chunk not in self.decoded:
            at, length = int(self.chunks[chunk, 8]), int(self.chunks[chunk, 9])
            view = memoryview(self.data)  # (no copy of the chunk)
            (crc,) = struct.unpack_from("<I", view, at - 4)
            if zlib.crc32(view[at:at + length], zlib.crc32(view[at - CHUNK.size:at - 4])) != crc:
                raise self.damaged(chunk)
            layout = self.layout(chunk)
            self.decoded = {chunk: (layout, unpack(view[layout.at:at + length], layout.stored,
                                                   layout.width))}
        return self.decoded[chunk]

    def ids(self, row: int) -> list[int]:
        layout, stored = self.decode(int(self.chunk[row]))
        j = int(self.within[row])
        size, start = int(layout.size[j]), int(layout.start[j])
        if layout.run[j]:
            values = stored[start] + np.arange(size, dtype=U64)
        else:
            values = stored[start:start + size]
        return (values + U64(layout.base % 2**64)).view(np.int64).tolist()

    def row_of(self, step: int, epoch: Optional[int] = None) -> Optional[int]:
        """The row of `step` (of the run; with `epoch`: the epoch's step-th batch)."""
        if epoch is not None:
            in_epoch = np.flatnonzero(self.epoch == epoch)
            return int(in_epoch[step]) if step < len(in_epoch) else None
        row = int(np.searchsorted(self.step, step))
        return row if row < len(self.step) and self.step[row] == step else None

    def rows_with(self, sample: int) -> list[int]:
        """The rows that hold `sample`: each chunk that can hold it (the sample within its
        base and width) decoded and searched with numpy, a run by its first id and size."""
        if not -2**63 <= sample < 2**63 or len(self.step) == 0:
            return []
        found = []
        for c in np.unique(self.chunk).tolist():
            if self.chunks[c, 0] != CHUNK_BATCHES:
                continue
            layout = self.layout(c)
            target = sample - layout.base
            if not 0 <= target < 2**64 or (target >> layout.width and not layout.run.any()):
                continue
            layout, stored = self.decode(c)
            at = np.flatnonzero(stored == U64(target))
            batch = np.searchsorted(layout.start, at, side="right") - 1
            batch = batch[~layout.run[batch]]
            runs = np.flatnonzero(layout.run)
            first = stored[layout.start[runs]]
            inside = runs[(first <= U64(target)) & (U64(target) - first < layout.size[runs])]
            found += [(c, j) for j in np.union1d(batch, inside).tolist()]
        # the rows of those batches, where not superseded: rows are in (chunk, place) order
        key = self.chunk * (1 << 32) + self.within
        rows = []
        for c, j in found:
            row = int(np.searchsorted(key, c * (1 << 32) + j))
            if row < len(key) and key[row] == c * (1 << 32) + j:
                rows.append(row)
        return sorted(set(rows))


def check_version(path: str, data) -> None:
    """UsageError for a file of another format version than this sharddemo reads."""
    (version,) = struct.unpack_from("<I", data, 8)
    if version != VERSION:
        raise UsageError(f"{path} is a lineage file of format {version}, written by "
                         f"{'an earlier' if version < VERSION else 'a later'} sharddemo; this "
                         f"one reads and writes format {VERSION}: read it with the sharddemo "
                         "that wrote it, and give a new lineage folder to a new run")


def walk(data) -> tuple[np.ndarray, int]:
    """The chunks of a rank file, by their headers: a row each (kind, id width, size width,
    flags, epoch, first step, batches, size, payload offset, payload length), and where the
    valid part ends. A chunk whose header is not one (a crash tore it) or that does not fit in
    the file ends the walk; so does a last chunk whose CRC fails (a crash tears the end only:
    the chunks before it are checked when a lookup decodes them)."""
    end = len(data)
    at = FILE_HEADER.size
    rows = []
    unpack_from = CHUNK.unpack_from
    while at + CHUNK.size <= end:
        kind, width, size_width, flags, epoch, step, count, size, length, _ = \
            unpack_from(data, at)
        if kind == CHUNK_BATCHES:
            whole = (0 < count <= MAX_CHUNK_BATCHES and width <= 64 and size_width <= 32
                     and not flags & ~FLAGS)
        else:
            whole = kind == CHUNK_RESTART and count == length == width == flags == 0
        if not whole or at + CHUNK.size + length > end:
            break
        rows.append((kind, width, size_width, flags, epoch, step, count, size,
                     at + CHUNK.size, length))
        at += CHUNK.size + length
    if rows:
        start, length = rows[-1][8], rows[-1][9]
        (crc,) = struct.unpack_from("<I", data, start - 4)
        if zlib.crc32(data[start:start + length],
                      zlib.crc32(data[start - CHUNK.size:start - 4])) != crc:
            rows.pop()
            at = start - CHUNK.size
    return np.array(rows, dtype=np.int64).reshape(-1, 10), at


def valid_length(path: str) -> int:
    """How much of a rank file is whole chunks (the writer cuts a torn tail before it
    appends again); UsageError for a file of another format version (a resumed run does not
    append format 2 chunks to it)."""
    with open(path, "rb") as handle:
        data = handle.read()
    if len(data) < FILE_HEADER.size:
        return 0
    if data[:8] == MAGIC:
        check_version(path, data)
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
