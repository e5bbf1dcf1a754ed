"""A run's lineage (docs/watch.md, "The batch behind a step"): which samples each rank's loop
received at every step, read back for `sharddemo lineage`. No torch. The files' format, and the
encoder the watch's writer (sharddemo.watching.lineage) uses, are in sharddemo.lineage_format;
its names are exported here too.

The reader indexes a file by its chunk headers alone (the ids are decoded for the chunk a lookup
needs). Steps count the batches a rank's loop received, from 0, across epochs and resumes.
What the reader says is what is written: after a crash it may end before what a rank received.

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
from sharddemo.mesh import MeshLayout

# The format's names, those the reader uses and the rest, exported here too, so that
# `from sharddemo.lineage import encode, ...` keeps working.
from sharddemo.lineage_format import (BASE, BATCH, CHUNK, CHUNK_BATCHES, CHUNK_RESTART, FILE_HEADER,
                                      FLAGS, MAGIC, MAX_CHUNK_BATCHES, MAX_CHUNK_IDS, RESTART,
                                      RUN_FILE, RUNS, SCHEMA, U64, UNIFORM, UNKNOWN, UNKNOWNS,
                                      VERSION, Layout, validate_version, encode, encode_chunk,
                                      encode_many, file_header, pack, rank_file, tokens_file, unpack,
                                      valid_length, walk)

__all__ = ["Lineage", "RankLineage", "read_run_file", "write_run_file", "BASE", "BATCH", "CHUNK",
           "CHUNK_BATCHES", "CHUNK_RESTART", "FILE_HEADER", "FLAGS", "MAGIC", "MAX_CHUNK_BATCHES",
           "MAX_CHUNK_IDS", "RESTART", "RUN_FILE", "RUNS", "SCHEMA", "U64", "UNIFORM", "UNKNOWN",
           "UNKNOWNS", "VERSION", "Layout", "validate_version", "encode", "encode_chunk",
           "encode_many", "file_header", "pack", "rank_file", "unpack", "valid_length", "walk"]


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
        validate_version(path, self.data)
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


def mesh_layout(mesh: Optional[dict]) -> Optional[MeshLayout]:
    """A launch's mesh as the run file holds it (dims with sizes, data dims, each rank's
    coordinates) -> a MeshLayout; None for none, or one that cannot be read."""
    if not isinstance(mesh, dict):
        return None
    try:
        dims = tuple(mesh["dims"])
        return MeshLayout(dims, tuple(int(mesh["dims"][d]) for d in dims),
                          tuple(mesh["data_dims"]), tuple(tuple(c) for c in mesh["coords"]))
    except (KeyError, TypeError, ValueError):
        return None


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
        # each launch's device mesh (watch(..., mesh=)), or None
        self.meshes = [mesh_layout(launch.get("mesh"))
                       for launch in self.run.get("launches") or [{}]]
        self.loaded: dict[int, RankLineage] = {}
        self.ends: dict[int, int] = {}  # rank: the first step of a later launch without it
        self.token_pairs: dict[int, Optional[np.ndarray]] = {}  # rank: its (step, tokens)

    def mesh_at(self, step: int) -> Optional[MeshLayout]:
        """The device mesh of the launch that ran `step` (None: no mesh)."""
        launch = max((i for i, (first, _) in enumerate(self.launches) if first <= step),
                     default=0)
        return self.meshes[launch]

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
        # the epoch's step-th batch is the run's step epoch_start + step on every rank (a rank
        # that joined the run mid-epoch at a resume has no batch before the step it joined at)
        start = self.epoch_start(epoch) if epoch is not None else 0
        for r in ranks:
            if rank is None and not os.path.exists(rank_file(self.folder, r)):
                missing.append({"rank": r, "first_step": None, "last_step": None,
                                "note": f"rank {r}: no lineage file"})
                short.append(f"rank {r}: no lineage file")
                continue
            lineage = self.rank(r)
            row = lineage.row_of(start + step) if start is not None else None
            if row is not None and epoch is not None and int(lineage.epoch[row]) != epoch:
                row = None  # (past the epoch's end on this rank)
            if not self.visible(r, row):
                # (a rank that joined the run after that step, at a resume: said in the run's
                # steps, where its lineage begins)
                written = self.written(r)
                later = start is not None and written is not None and start + step < written[0]
                entry, brief = (self.gap(r, start + step, None) if later
                                else self.gap(r, step, epoch))
                missing.append(entry)
                short.append(brief)
                continue
            kind = int(lineage.kind[row])
            found = {"rank": r, "epoch": int(lineage.epoch[row]),
                     "step": int(lineage.step[row]),
                     "ids": lineage.ids(row) if kind == BATCH else None}
            tokens = self.tokens_at(r, found["step"])
            if tokens is not None:
                found["tokens"] = tokens
            out.append(found)
        if not out:
            where = f" of epoch {epoch}" if epoch is not None else ""
            raise UsageError(f"no rank's written lineage has --step {step}{where} ("
                             + "; ".join(short) + ")")
        return out, missing

    def tokens_at(self, rank: int, step: int) -> Optional[int]:
        """The tokens of `rank`'s batch at `step` (watch(..., tokens=): rank<r>.tokens), the
        last written for that step (a resumed launch writes a replayed step again); None
        without them."""
        if rank not in self.token_pairs:
            path = tokens_file(self.folder, rank)
            pairs = None
            if os.path.exists(path):
                raw = np.fromfile(path, dtype=np.int64)
                pairs = raw[:raw.size - raw.size % 2].reshape(-1, 2)  # (a pair cut short: out)
            self.token_pairs[rank] = pairs
        pairs = self.token_pairs[rank]
        if pairs is None:
            return None
        rows = np.flatnonzero(pairs[:, 0] == step)
        return int(pairs[rows[-1], 1]) if rows.size else None

    def epoch_start(self, epoch: int) -> Optional[int]:
        """The run's step at which `epoch` began: its first written step on any rank (None
        where no rank's written lineage has the epoch)."""
        firsts = []
        for r in self.ranks():
            lineage = self.rank(r)
            rows = np.flatnonzero(lineage.epoch == epoch)
            rows = [row for row in rows.tolist() if self.visible(r, row)]
            if rows:
                firsts.append(int(lineage.step[rows[0]]))
        return min(firsts) if firsts else None

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
            batches = f"{held} batch{'' if held == 1 else 'es'}"
            short = f"rank {rank}: {batches} of epoch {epoch}, written up to step {last}"
            note = (f"rank {rank}: its lineage holds {batches} of epoch {epoch} "
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
