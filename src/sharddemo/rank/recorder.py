"""The recorder: what a loader hands the training loop on this rank, kept as the loop runs.

Recorded as the loop iterates the loader, and exchanged once at the end of each epoch.

    recorder = Recorder(accelerator, read_ids, n=len(dataset), how="count", loader=loader)
    for batch in loader:
        recorder.add(batch)        # local: no collective, no host sync beyond reading the ids
        ...                        # the training step
    record = recorder.finish(epoch)   # a collective: every rank calls it once per epoch

`record` is the epoch as every rank saw it, on the main process (None elsewhere), in the shape
sharddemo.record describes and sharddemo.analysis reads:

- `how="epoch"` keeps every id this rank received (an IdLog) and one ragged gather brings them
  to the main process: each rank's batches, whole;
- `how="count"` keeps one byte per sample (rank.counting.Counts; two bits from 2^26 samples,
  rank.counting.BitCounts) and one reduce sums the
  counts on the main process: coverage, repeats, each rank's order hash, steps, batch sizes,
  workers and its first and last batches, at any N.

Two ranks, N = 8, a DistributedSampler (shuffle=False) and batches of 2: rank 0 adds [0, 2] and
[4, 6], rank 1 adds [1, 3] and [5, 7]; `finish(0)` on the main process returns, with
`how="epoch"`, `ranks` = [[[0, 2], [4, 6]], [[1, 3], [5, 7]]] (rank.walk.walk_epoch walks a
loader this way for `compare`, `audit` and the resume audit).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from sharddemo.rank.collect import exchange_ints, gather_ragged, narrowest_dtype
from sharddemo.options import BITS_FROM, COUNT_FROM
from sharddemo.rank.counting import KEEP_BATCHES, BitCounts, Counts, slot_ints
from sharddemo.rank.describe import base_loader, remainder
from sharddemo.rank.ids import ReadIds, read_values, unshift
from sharddemo.rank.tagging import UNKNOWN_WORKER, known_worker


def epoch_record(epoch: int, gather: str, ranks: list[list[list[int]]],
                 workers: list[list[int]], remainders: list[Optional[int]],
                 for_metrics: Optional[list[int]] = None) -> dict:
    """Return an id record (sharddemo.record) of one epoch.

    `ranks[r]` rank r's batches, `workers[r][k]` the DataLoader worker that made rank r's batch
    k (-1: the main process, -2: not known), `remainders[r]` accelerate's
    `gradient_state.remainder` for rank r's prepared loader (None when not prepared),
    `for_metrics` what gather_for_metrics returned step after step (None: not called, or no loop
    could reach the last step)."""
    return {"epoch": epoch, "gather": gather,
            "ranks": [{"rank": r, "batches": b, "workers": w}
                      for r, (b, w) in enumerate(zip(ranks, workers))],
            "gathered_for_metrics": for_metrics, "remainder": remainders}


@functools.lru_cache(maxsize=1)
def id_objects(n: int) -> tuple[np.ndarray, list[int]]:
    """Return the ints 0..n-1 as Python int objects, made once per process and dataset length.

    In one numpy array (to pick any ids) and in one list of the same objects (to slice a run of
    consecutive ids). The id path's record lists every id as a Python int; taken from here an id
    costs a pointer copy, not a new int object on fresh memory (many times more where
    first-touched memory is slow: docs/benchmarks.md, "Figures behind design choices"), and
    every epoch's record shares the same objects."""
    pool = np.arange(n).astype(object)
    return pool, pool.tolist()


Runs = tuple  # a batch as runs of consecutive ascending ids: ((first id, length), ...)


class Listed(NamedTuple):
    """One rank's batches as listed on the main process (list_ids).

    With what the next rank's listing compares its batches with (`like`)."""
    flat: np.ndarray  # the ids of the batches that travelled listed, in order
    offsets: list  # batch k's first position in `flat` (a batch of runs: where it would be)
    runs: list  # batch k's Runs where it travelled as runs, else None
    batches: list  # batch k as a list of Python ints


def list_ids(flat: np.ndarray, cuts: list[int], n: Optional[int],
             like: Optional[Listed] = None, runs: Optional[list[Optional[Runs]]] = None,
             known: Optional[tuple[dict, dict]] = None) -> Listed:
    """List one rank's batches as lists of Python ints.

    `cuts` its batch sizes, `runs[k]` batch k's runs where it travelled as runs of consecutive
    ascending ids ((first, length), ...; not in `flat`), else None, and `flat` the ids of the
    other batches, in order (no `runs`: every batch is in `flat`). Where every id is in 0..n-1
    (`n` given), the ints come from id_objects: a run is a slice of its list, and so is a listed
    batch of consecutive ascending ids (a stream, an unshuffled loader); any other batch is
    picked from its array. `like`: the previous rank's Listed; a batch equal to that rank's
    batch at the same step (replicated ranks) is that rank's list itself, so the record holds it
    once (the record is read, never changed in place). `known`: (the lists of the batches of
    runs listed before, by their Runs; those of this listing, filled here): a batch of runs
    listed before, in the last listing or in this one, is that list again (an unshuffled loader,
    a stream read in order: every epoch's record holds the same lists). The same ints in the
    same order either way."""
    runs = runs if runs is not None else [None] * len(cuts)
    lows, highs = [], []
    for batch in runs:
        for first, length in batch or ():
            lows.append(first)
            highs.append(first + length - 1)
    if flat.size:
        lows.append(int(flat.min()))
        highs.append(int(flat.max()))
    pools = (id_objects(n) if n is not None and lows and min(lows) >= 0 and max(highs) < n
             else None)
    batches, offsets, start = [], [], 0
    for step, size in enumerate(cuts):
        mine = runs[step]
        offsets.append(start)
        same = like is not None and step < len(like.batches) and len(like.batches[step]) == size
        if mine is not None:
            before = (known[1].get(mine) or known[0].get(mine)) if known is not None else None
            if same and like.runs[step] == mine:
                batches.append(like.batches[step])
            elif before is not None:
                batches.append(before)
            elif len(mine) == 1:
                first = mine[0][0]
                batches.append(pools[1][first:first + size] if pools is not None
                               else list(range(first, first + size)))
            else:
                batch: list = []
                for first, length in mine:
                    batch += (pools[1][first:first + length] if pools is not None
                              else range(first, first + length))
                batches.append(batch)
            if known is not None:
                known[1][mine] = batches[-1]
            continue
        chunk = flat[start:start + size]
        start += size
        if same and like.runs[step] is None and np.array_equal(
                chunk, like.flat[like.offsets[step]:like.offsets[step] + size]):
            batches.append(like.batches[step])
        elif pools is None:
            batches.append(chunk.tolist())
        elif size and int(chunk[-1]) - int(chunk[0]) == size - 1 and (
                size < 2 or bool((chunk[1:] > chunk[:-1]).all())):
            batches.append(pools[1][int(chunk[0]):int(chunk[0]) + size])
        else:
            batches.append(pools[0][chunk].tolist())
    return Listed(flat, offsets, runs, batches)


# The id path's epoch end: a rank's payload (IdLog.heads) of up to ID_SLOT ints rides in the
# exchange that settles the epoch (rank.walk.settle), and no gather follows; a larger one goes
# in one ragged gather after it. 512 int64s (4 KB a rank) hold 128 batches that each hold
# consecutive ids (a stream read in order, an unshuffled loader, a shard of one), or a few
# hundred listed ids: what a walk of a shuffled loader's epoch of any real length is not.
ID_SLOT = 512


class IdLog:
    """Every id of one epoch on this rank, batch by batch, and the worker of each batch.

    `n`: the dataset's length where known and below COUNT_FROM: the ids 0..n-1 are then listed
    from one shared set of int objects (id_objects). A batch that is a few runs of consecutive
    ascending ids (one run: a stream read in order, an unshuffled loader, a shard of one; two: a
    shard's last batch padded from the start) is kept as its runs, and not held; any other batch
    is kept as the reader gave it (values and shift: the shift is taken off once, at the epoch's
    end). Runs are looked for while this rank's payload may still fit its slot (ID_SLOT): a
    batch looked at costs a comparison of its ids, once, as it comes; past that, every batch is
    kept as it came."""

    def __init__(self, n: Optional[int] = None, runs: Optional[dict] = None) -> None:
        self.runs = runs  # the last epoch's lists of batches of runs (list_ids' `known`)
        self.cuts: list[int] = []  # each batch's size, negated for a batch of runs
        self.segments: list[int] = []  # each batch of runs: c, first, length, ..., first
        self.batches: list[torch.Tensor] = []  # the other batches, as given
        self.shifts: list[int] = []  # (their shifts)
        self.workers: list[int] = []
        self.samples = 0
        self.room = ID_SLOT - 1  # what the payload may still take and fit its slot
        self.top = 0  # the largest |value| the payload holds
        self.n = n if n is not None and 0 < n < COUNT_FROM else None
        self.payload: Optional[torch.Tensor] = None

    @property
    def steps(self) -> int:
        return len(self.cuts)

    def add(self, values: torch.Tensor, worker: int, shift: int) -> None:
        if values.dim() != 1:
            values = values.reshape(-1)
        if values.dtype is not torch.int64 or not values.is_cpu:
            values = values.to("cpu", torch.int64)
        size = values.numel()
        self.workers.append(worker)
        self.samples += size
        self.top = max(self.top, size)  # (the sizes travel too)
        if self.room >= 4 and size and self._as_runs(values.numpy(), size, shift):
            return
        if values.untyped_storage().nbytes() != 8 * size:
            # a view into a larger batch (accelerate's dispatcher hands each rank a slice of
            # the global batch): kept as it is, it would keep the whole batch alive
            values = values.clone()
        self.cuts.append(size)
        self.batches.append(values)
        self.shifts.append(shift)
        self.room -= 2 + size

    def _as_runs(self, array: np.ndarray, size: int, shift: int) -> bool:
        """Keep the batch as its runs where it is a few, and say whether it did.

        A few: fewer ints than its ids, and room for them: [c, first, length, ..., first], the
        last run's length implied."""
        first, last = int(array[0]) - shift, int(array[-1]) - shift
        if last - first == size - 1 and (size < 3 or bool((array[1:] > array[:-1]).all())):
            code = [1, first]
            top = max(abs(first), abs(last))
        elif size > 4:
            breaks = np.flatnonzero(array[1:] - array[:-1] != 1)
            count = breaks.size + 1
            if 2 * count >= size or 2 + 2 * count > self.room:
                return False
            starts = [0, *(breaks + 1).tolist()]
            lengths = [b - a for a, b in zip(starts, starts[1:] + [size])]
            firsts = (array[starts] - shift).tolist()
            code = [count]
            for f, length in zip(firsts, lengths):
                code += (f, length)
            code.pop()  # the last length: the size tells it
            top = max(max(abs(f), abs(f + k - 1)) for f, k in zip(firsts, lengths))
        else:
            return False
        self.cuts.append(-size)
        self.segments += code
        self.top = max(self.top, top)
        self.room -= 2 + len(code)
        return True

    def delivers_everywhere(self, world: int) -> bool:
        return True  # with everyone, the gather is an all-gather: every rank holds every rank's ids

    def holds(self, ids) -> None:
        """(Counts.holds: the id path keeps no counter to look ids up in.)"""
        return None

    def heads(self, loader) -> list[int]:
        """Return what this rank tells the others first at the epoch's end.

        finish exchanges it, or the caller does, with finish's `heads`: its batches, the length
        of its payload, the largest |value| in it, accelerate's remainder for `loader`, then
        ID_SLOT ints: the payload where it fits, else zeros. The payload (kept for finish): each
        batch's size, negated for a batch of runs, each batch's worker, the length of what
        follows and the runs of each batch of runs (c, first, length, ..., first: the last
        length is the size's rest), then the ids of the other batches."""
        listed, shifts = self.batches, self.shifts
        if not listed:
            ids = torch.empty(0, dtype=torch.int64)
        elif len(set(shifts)) == 1:
            ids = torch.cat(listed)  # a new tensor: the shift comes off in place
            if shifts[0]:
                ids.sub_(shifts[0])
        else:
            ids = torch.cat([unshift(b, s) for b, s in zip(listed, shifts)])
        top = self.top
        if ids.numel():
            low, high = torch.aminmax(ids)
            top = max(top, -int(low), int(high))
        head = torch.tensor(self.cuts + self.workers + [len(self.segments)] + self.segments,
                            dtype=torch.int64)
        self.payload = torch.cat([head, ids]) if ids.numel() else head
        length = self.payload.numel()
        slot = self.payload.tolist() + [0] * (ID_SLOT - length) if length <= ID_SLOT else \
            [0] * ID_SLOT
        return [len(self.cuts), length, top, remainder(loader), *slot]

    def finish(self, accelerator, loader, epoch: int, everyone: bool = False,
               heads: Optional[list[list[int]]] = None) -> Optional[dict]:
        """Exchange the heads and, where needed, the payloads, and return the record.

        A collective: the heads exchanged (every rank's `heads(loader)`; `heads`: already
        exchanged by the caller, [rank][k]). Where every rank's payload fitted its slot that was
        all; else one ragged gather of every rank's payload (int32 when every value fits) onto
        the main process (an all-gather with `everyone`). The record on the main process, and on
        every rank with `everyone`."""
        if heads is None:
            heads = exchange_ints(accelerator, self.heads(loader))
        elif self.payload is None:
            raise ValueError("finish(heads=...) needs this rank's heads() taken first")
        keeps = accelerator.is_main_process or everyone
        if all(h[1] <= ID_SLOT for h in heads):
            parts = ([np.array(h[4:4 + h[1]], dtype=np.int64) for h in heads] if keeps
                     else [])
        else:
            dtype = narrowest_dtype(max(h[2] for h in heads))
            got = gather_ragged(accelerator, self.payload.to(dtype), [h[1] for h in heads],
                                main_only=not everyone)
            parts = [part.numpy() for part in got]
        if not keeps:
            return None
        ranks, workers = [], []
        like = None
        known = (dict(self.runs), {}) if self.runs is not None else None
        for (count, *_), array in zip(heads, parts):
            cuts = array[:count].tolist()
            workers.append(array[count:2 * count].tolist())
            coded = int(array[2 * count])
            code = array[2 * count + 1:2 * count + 1 + coded].tolist()
            at, runs = 0, []
            for c in cuts:
                if c >= 0:
                    runs.append(None)
                    continue
                k, left, mine = code[at], -c, []
                for j in range(k):
                    first = code[at + 1 + 2 * j]
                    length = code[at + 2 + 2 * j] if j < k - 1 else left
                    mine.append((first, length))
                    left -= length
                runs.append(tuple(mine))
                at += 2 * k
            like = list_ids(array[2 * count + 1 + coded:], [abs(c) for c in cuts], self.n,
                            like, runs, known)
            ranks.append(like.batches)
        if known is not None and self.runs is not None:
            self.runs.clear()  # kept for the next epoch: this epoch's batches of runs only
            self.runs.update(known[1])
        remainders = [None if h[3] == -2 else h[3] for h in heads]
        return epoch_record(epoch, "epoch", ranks, workers, remainders)


class Recorder:
    """Records, on this rank, what a loader hands the training loop, one epoch at a time.

    `accelerator`: the rank's Accelerator (its collectives carry the exchange; any object with
    `num_processes`, `is_main_process`, `device` and accelerate's `gather` works).
    `read_ids(batch, tag)`: the batch's 0-based sample ids (rank.ids.ReadIds). `how`: "epoch"
    (every id) or "count" (one byte per sample, two bits from 2^26; needs `n`, the dataset's
    length).
    `loader`: the loader walked, read for its worker count and, at the end of an epoch, for
    what accelerate's gather_for_metrics keeps of the last step (`remainder`).

    `add(batch)` is local and costs a few microseconds a batch; `finish(epoch)` is a collective
    every rank calls once per epoch, and starts the next epoch empty. `background=False`
    keeps every collective synchronous (for a process that exits through the interpreter's
    teardown: a user's training script). `one_collective` makes the count path's epoch end
    one all-reduce (up to 15 ranks; its slots sized for batches of up to `batch` ids, 64
    when not given: a larger batch costs a second collective), after which every rank can
    hold the record (finish's `everyone`).

    Args:
        accelerator: the rank's Accelerator, or any object with `num_processes`,
            `process_index`, `is_main_process` and `device`.
        read_ids: `read_ids(batch, tag)` -> the batch's ids; None for `add_ids` only.
        how: "epoch" or "count".
        n: the dataset's length (required for "count").
        loader: the loader walked (its workers, accelerate's remainder).
        background, keep_present, one_collective, batch: as above.
        runs: a dict that keeps the id path's lists of the last epoch's batches of runs, for
            a caller that keeps every record (a run met again is then the same list: see
            list_ids); one dict for every epoch, where a Recorder is made each epoch. None:
            nothing kept.

    Example (on every rank; the record arrives on the main process)::

        recorder = Recorder(accelerator, lambda batch, tag: batch["id"], how="count", n=len(ds))
        for epoch in range(2):
            for batch in loader:
                recorder.add(batch)
            record = recorder.finish(epoch, loader)   # None on the other ranks
    """

    def __init__(self, accelerator, read_ids: Optional[ReadIds] = None, *, how: str = "epoch",
                 n: Optional[int] = None, loader: Any = None, background: bool = True,
                 keep_present: bool = False, one_collective: bool = False,
                 batch: Optional[int] = None, runs: Optional[dict] = None) -> None:
        if how not in ("epoch", "count"):
            raise ValueError(f"how must be 'epoch' or 'count', got {how!r}")
        if how == "count" and n is None:
            raise ValueError("the count path needs n, the dataset's length")
        self.accelerator = accelerator
        self.read_ids = read_ids
        self.how = how
        self.n = n
        self.loader = loader
        self.background = background  # rank.counting.Counts: the reduce in gloo's thread
        self.keep_present = keep_present  # Counts: each sample's rank count, on the main
        # the worker of every batch where the loader says it (no tag to read)
        self.known = known_worker(loader) if loader is not None else None
        workers = (int(getattr(base_loader(loader), "num_workers", 0) or 0)
                   if loader is not None else 0)
        self.keep = max(KEEP_BATCHES, workers)
        # the id path's lists of the last epoch's batches of runs (IdLog, list_ids), where the
        # caller keeps every epoch's record anyway (rank.walk.EpochWalker): kept by a caller
        # that drops each record (the watch), they would hold an epoch's ids the longer
        self.runs: Optional[dict] = runs
        self.slots = None
        if one_collective:
            self.slots = (accelerator.num_processes,
                          slot_ints(self.keep, batch or 64, workers))
        self.log = self._new_log()

    def _new_log(self):
        if self.how != "count":
            return IdLog(self.n, self.runs)
        if int(self.n) >= BITS_FROM and self.slots is None and not self.keep_present:
            return BitCounts(int(self.n), self.keep, self.background)  # 2 bits a sample
        log = Counts(int(self.n), self.keep, self.background, slots=self.slots)
        log.keep_present = self.keep_present
        return log

    @property
    def steps(self) -> int:
        """Batches added this epoch."""
        return self.log.steps

    @property
    def samples(self) -> int:
        """Samples added this epoch."""
        return self.log.samples

    def add(self, batch) -> None:
        """One batch, as the loader yielded it (tagged or not)."""
        values, worker, shift = read_values(self.read_ids, batch, self.known)
        self.log.add(values, worker, shift)

    def add_ids(self, ids: torch.Tensor, worker: int = UNKNOWN_WORKER) -> None:
        """Record one batch given by its 0-based ids (a 1-D integer tensor).

        For a caller that read them itself (sharddemo.watch)."""
        self.log.add(ids, worker, 0)

    def add_rows(self, block: torch.Tensor, worker: int = UNKNOWN_WORKER) -> None:
        """Record several batches of one size, the rows of `block`, given by their 0-based ids.

        `block` is 2-D. The same as add_ids() for each row, in one call (the count path books
        them at once)."""
        add_rows = getattr(self.log, "add_rows", None)
        if add_rows is not None:
            add_rows(block, worker, 0)
        else:
            for row in block:
                self.log.add(row, worker, 0)

    def holds(self, ids):
        """Say (mid-epoch, locally) whether this rank has received each of `ids` so far.

        A bool array over this epoch so far, or None where that cannot be looked up without a
        copy (the id path, ids counted on a device, BitCounts)."""
        holds = getattr(self.log, "holds", None)
        return holds(ids) if holds is not None else None

    def copies(self, ids):
        """Count, mid-epoch and locally, how many times this rank has received each of `ids`.

        So far this epoch, as a uint8 array, or None where holds gives None."""
        copies = getattr(self.log, "copies", None)
        return copies(ids) if copies is not None else None

    @property
    def delivers_everywhere(self) -> bool:
        """Say whether finish(everyone=True) gives the record to every rank.

        With no collective beyond the epoch's own."""
        return self.log.delivers_everywhere(self.accelerator.num_processes)

    def heads(self, loader: Any = None) -> Optional[list[int]]:
        """Return this rank's part of the id path's first exchange at the epoch's end.

        IdLog.heads, for a caller that sends it in an exchange of its own (rank.walk.settle) and
        passes every rank's to finish(heads=...): one collective fewer. None on the count path.
        """
        if not isinstance(self.log, IdLog):
            return None
        return self.log.heads(loader if loader is not None else self.loader)

    def finish(self, epoch: int, loader: Any = None, everyone: bool = False,
               heads: Optional[list[list[int]]] = None,
               n: Optional[int] = None) -> Optional[dict]:
        """End the epoch, a collective: the record on the main process, None elsewhere.

        On every rank with `everyone`, where delivers_everywhere. `loader`: the loader the epoch
        was walked from, where it is not the one given (a skip_first_batches loader). `heads`:
        every rank's heads(), already exchanged (the id path). `n`: the byte counter's epoch
        counted over 0..n-1 only (Counts.shrink; `n` at most this recorder's): the N every
        rank agreed on where each rank's counter was sized from a length of its own."""
        log, self.log = self.log, self._new_log()
        if n is not None and isinstance(log, Counts) and not isinstance(log, BitCounts):
            log.shrink(n)
        loader = loader if loader is not None else self.loader
        if heads is not None:
            return log.finish(self.accelerator, loader, epoch, everyone, heads=heads)
        return log.finish(self.accelerator, loader, epoch, everyone)
