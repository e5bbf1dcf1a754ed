"""The count path: walk an epoch of any size with about one byte per sample on each rank (two
bits from options.BITS_FROM = 2^26 samples: BitCounts, at the end of this module's classes).

From `options.COUNT_FROM` samples (auto), or with `--gather count`, no rank ships its ids
anywhere. Each rank walks its loader as a training loop does and keeps, for its own batches:

- a counter over the dataset, one uint8 per sample (numpy), raised for every id received;
- a running order hash (xxh3-128 over the ids as int64, batch after batch: 16 bytes; not a
  cryptographic hash, and nothing here needs one): equal hashes, same order; compared across
  ranks and across epochs;
- its batch sizes run-length encoded ([size, how many], usually one or two runs), which
  DataLoader worker made how many batches and samples, and the first and last `KEEP_BATCHES`
  batches themselves (or one per worker, where there are more workers), with the worker that
  made each (what the report prints, and where padding and loop-around leave their repeats);
- the ids it received more than once, with counts, and ids outside the dataset (both few,
  except where a loader really replicates; then capped).

Then each counter becomes a code per sample (0, 1, or 1 + shift when received more than
once; see encode) and ONE reduce (sum, onto the main process) gives, per sample, how many
ranks received it and how many received it more than once. Missing (0 ranks), coverage,
overlap between ranks and the exact copy count of every sample (ranks holding it + the extra
copies each rank listed) follow; the main process keeps a capped list of missing and
duplicated ids and their totals. Memory: the counter (N bytes) on every rank, and from 16
ranks on the wider code beside it (options.counter_bytes), plus what the loader itself holds
(a DistributedSampler keeps its whole index list).

Every rank calls `Counts.finish` together (it is a collective); rank.recorder.Recorder feeds it.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional

import numpy as np
import torch
import xxhash

from sharddemo.rank.collect import (all_reduce_bytes, exchange_ints,
                                    gather_ragged, reduce_to_main)
from sharddemo.options import code_width
from sharddemo.rank.describe import index_domain, is_prepared, remainder
from sharddemo.rank.ids import unshift
from sharddemo.record import LIST_CAP, loader_share

# First and last batches each rank keeps in full (at least; one per DataLoader worker where
# there are more workers, so that every worker's first and last batch is kept).
KEEP_BATCHES = 3


# Counters are recoded, reduced and read this many samples at a time (no temporary of N
# elements, and a bounded copy where the code goes wider than it is or to a device).
CHUNK = 1 << 22


# A rank may receive one sample at most this many times in an epoch (the uint8 counter).
MAX_COPIES = 255


class TooManyCopies(RuntimeError):
    pass


class Counts:
    """The count path's log of one epoch on this rank (see the module): fed batch after batch
    by a Recorder, then `finish` exchanges it (a collective) and returns the counted record on
    the main process. Per batch only bookkeeping; the ids are counted, hashed and checked
    FLUSH_IDS at a time (one index_add_, one hash update, one comparison), which is what keeps
    the walk close to the bare loop's speed."""

    def __init__(self, n: int, keep: int = KEEP_BATCHES, background: bool = True, *,
                 slots: Optional[tuple[int, int]] = None) -> None:
        self.n = int(n)
        # the reduce in gloo's background thread while the small exchanges go on (sharddemo's
        # own ranks); False in a user's process (sharddemo.watch): a gloo process group that
        # ran async work and is left to the interpreter's teardown can abort the process at
        # exit ("terminate called without an active exception", 2 exits in 6 here)
        self.background = background
        # keep, on the main process, how many ranks received each sample (the record's
        # "_present"; sharddemo.watch compares a resumed epoch with what came before the stop)
        self.keep_present = False
        # `slots` = (world, ints per rank): the epoch's end is ONE all-reduce of the code and,
        # after it, a slot per rank for its detail (finish); only where the code is a byte (up
        # to 15 ranks; wider codes are reduced a chunk at a time). The slots sit after the
        # counter in one buffer: no N-sized copy is made to send it.
        self.slots = slots if slots is not None and code_layout(slots[0])[1] is np.uint8 else None
        self.state = self._counter()
        self.on_device = False
        self.keep = keep
        self.sizes: list[list[int]] = []  # run-length: [size, times]
        self.made: dict[int, list[int]] = {}  # worker -> [batches, samples]
        self.head: list[tuple[torch.Tensor, int]] = []  # (ids, the worker that made the batch)
        self.tail: collections.deque = collections.deque(maxlen=keep)
        self.pending: list[torch.Tensor] = []  # values, all with the shift `shift_now`
        self.pending_ids = self.shift_now = 0
        self.samples = self.steps = 0
        # The current run of equal batch sizes and of batches from one worker (a batch's
        # bookkeeping is a few additions; the runs are stored when they end).
        self.size_now, self.size_run = -1, 0
        self.worker_now, self.worker_batches, self.worker_samples = None, 0, 0

    # ids that live on a device are counted there (_DeviceRunning)
    counts_on_device = True

    def _counter(self):
        """The counter: one uint8 per sample, in one buffer with the slots after it."""
        size = max(self.n, 1)
        room = 0
        if self.slots is not None:
            size = -(-size // 8) * 8  # the slots' int64 views start 8-aligned
            room = self.slots[0] * self.slots[1] * 8
        self.buffer = np.zeros(size + room, dtype=np.uint8)
        self.counts = self.buffer[:max(self.n, 1)]
        # the same memory: torch's index_add_ counts fast (ids on a device: _DeviceRunning,
        # chosen at the first batch)
        return _Running(torch.from_numpy(self.counts), torch.ones(1, dtype=torch.uint8), self.n)

    def add(self, ids: torch.Tensor, worker: int, shift: int) -> None:
        """One batch: its ids are `ids` - `shift`, made by `worker`."""
        # (each check is a tenth of a microsecond; the reshape and the copy they skip, 1-2)
        if ids.dim() != 1:
            ids = ids.reshape(-1)
        if ids.dtype is not torch.int64 or not ids.is_cpu or self.on_device:
            if (not ids.is_cpu and not self.steps and not self.on_device
                    and self.counts_on_device):
                # ids on a device (a prepared loader's batch on the GPU): count there, with no
                # copy to the host and no sync per step (the counter comes over at the end)
                self.state = _DeviceRunning(ids.device, self.n)
                self.on_device = True
            ids = ids.to(self.state.device, torch.int64, non_blocking=True)
        size = ids.shape[0]
        self._runs(size, 1, worker)
        if shift != self.shift_now:  # a reader that changes its shift: flush under the old one
            self.state.add(self.pending, self.shift_now)
            self.pending, self.pending_ids, self.shift_now = [], 0, shift
        if self.steps < self.keep:
            self.head.append((unshift(ids, shift), worker))
        else:
            self.tail.append((ids, shift, worker))
        self.pending.append(ids)
        self.pending_ids += size
        if self.pending_ids >= FLUSH_IDS:
            self.state.add(self.pending, self.shift_now)
            self.pending, self.pending_ids = [], 0
        self.samples += size
        self.steps += 1

    def _runs(self, size: int, count: int, worker: int) -> None:
        """`count` batches of `size` ids made by `worker`: the current runs of equal batch
        sizes and of batches from one worker go on, or are stored and new ones begin."""
        if size == self.size_now:
            self.size_run += count
        else:
            if self.size_run:
                self.sizes.append([self.size_now, self.size_run])
            self.size_now, self.size_run = size, count
        if worker == self.worker_now:
            self.worker_batches += count
            self.worker_samples += count * size
        else:
            if self.worker_batches:
                _add_made(self.made, self.worker_now, self.worker_batches, self.worker_samples)
            self.worker_now, self.worker_batches, self.worker_samples = worker, count, count * size

    def add_rows(self, block: torch.Tensor, worker: int, shift: int) -> None:
        """Several batches of one size at once: the rows of `block` (2-D, batch after batch),
        made by `worker`. The same log as add() for each row, with one pass of bookkeeping for
        them all (sharddemo.watch hands a loader's noted indices over this way, a few dozen
        batches at a time)."""
        count, size = block.shape
        if (not count or block.dtype is not torch.int64 or not block.is_cpu or self.on_device
                or shift != self.shift_now):
            for row in block:
                self.add(row, worker, shift)
            return
        self._runs(size, count, worker)
        head = max(0, min(self.keep - self.steps, count))
        for row in block[:head]:
            self.head.append((unshift(row, shift), worker))
        for row in block[max(head, count - self.keep):]:
            self.tail.append((row, shift, worker))
        self.pending.append(block.reshape(-1))
        self.pending_ids += count * size
        if self.pending_ids >= FLUSH_IDS:
            self.state.add(self.pending, self.shift_now)
            self.pending, self.pending_ids = [], 0
        self.samples += count * size
        self.steps += count

    def last_size(self) -> int:
        """The size of the epoch's last batch, once _close has stored the last run (0: none)."""
        return self.sizes[-1][0] if self.sizes else 0

    def _close(self) -> tuple[list, list]:
        """The epoch's walk is over: the last runs stored, the waiting ids counted; the kept
        first and last batches as (ids, worker) lists."""
        if self.size_run:
            self.sizes.append([self.size_now, self.size_run])
        if self.worker_batches:
            _add_made(self.made, self.worker_now, self.worker_batches, self.worker_samples)
        self.state.add(self.pending, self.shift_now)
        self.pending = []
        head = [(t.tolist(), worker) for t, worker in self.head]
        tail = [(unshift(t, shift).tolist(), worker) for t, shift, worker in self.tail]
        return head, tail

    def delivers_everywhere(self, world: int) -> bool:
        """Whether finish(everyone=True) can give the record to every rank: with the slots
        (one all-reduce), or in one process."""
        return self.slots is not None or world == 1

    def finish(self, accelerator, loader, epoch: int, everyone: bool = False) -> Optional[dict]:
        """The epoch's end, a collective: every rank's counter summed and its detail gathered.
        The counted record on the main process (on every rank too with `everyone`, where
        delivers_everywhere), None elsewhere.

        With `slots` this is ONE all-reduce (of the code and every rank's slot; a second, a
        ragged gather, only where some rank's detail outgrew its slot: batches larger than the
        slot was sized for). Without: a reduce onto the main process (a chunk at a time), an
        exchange of the small figures and a ragged gather of the detail."""
        n, counts, state = self.n, self.counts, self.state
        head, tail = self._close()
        state.to_host(counts)  # ids counted on a device: the counter comes over once, here
        samples, steps, sizes, made = self.samples, self.steps, self.sizes, self.made
        order, ascending = state.order, state.in_order(self.last_size())
        outside, outside_total = state.outside, state.outside_total
        if outside_total and not outside:
            # counted on a device: the ids outside [0, n) are counted there, not listed; those
            # in the kept first and last batches are listed
            outside = {i for batch, _ in head + tail for i in batch if not 0 <= i < n}
        inside_total = samples - outside_total
        distinct = int(np.count_nonzero(counts))
        # A sharded loader gives a rank each sample at most once: then the counter is 0/1, its
        # sum is `distinct` and nothing repeats (a max and a count, 0.1 ms at 10^6, instead of
        # a sum and a scan).
        once = int(counts.max()) <= 1
        # The counter wraps silently past MAX_COPIES: its sum tells (every rank, same branch).
        wrapped = (distinct if once else int(counts.sum(dtype=np.int64))) != inside_total
        # The ids this rank received more than once: how many, and the first LIST_CAP (a chunk
        # at a time: no N-sized temporary, and no N-sized index list where a loader
        # replicates).
        repeats_total, repeats = 0, []
        for lo in range(0, 0 if once else counts.size, CHUNK):
            hit = np.flatnonzero(counts[lo:lo + CHUNK] > 1)
            repeats_total += int(hit.size)
            if len(repeats) < LIST_CAP:
                repeats += (hit[:LIST_CAP - len(repeats)] + lo).tolist()
        # Per-rank detail, gathered ragged: sizes (RLE), workers, head, tail, repeats, outside,
        # the order hash. Its length travels with the other figures: one exchange, not two.
        mine = _pack(sizes, made, head, tail, repeats, counts[repeats],
                     sorted(outside)[:LIST_CAP], order.digest())
        # One reduce (sum) of a code per sample onto the main process: ranks that received it
        # (low part) and ranks that received it more than once (high part); see code_layout.
        # Started first, so that it runs while the two small exchanges below go on; from here
        # on `counts` is the reduce's until reduced() returns.
        world = accelerator.num_processes
        code, shift = encode(counts, world)
        row = [int(wrapped), steps, samples, repeats_total, distinct, outside_total, len(sizes),
               len(made), remainder(loader), int(ascending), int(mine.numel())]
        if self.slots is not None:
            heads, parts = self._exchange_at_once(accelerator, row, mine)
            _too_many_copies(heads, epoch)
        else:
            reduced = (reduce_to_main(accelerator, code, self.background, CHUNK) if world > 1
                       else (lambda: None))
            heads = exchange_ints(accelerator, row)
            if any(h[0] for h in heads):
                reduced()  # every rank started it: finished, not left in flight
                _too_many_copies(heads, epoch)
            parts = gather_ragged(accelerator, mine, [h[-1] for h in heads])
            reduced()
        if not accelerator.is_main_process and not (everyone
                                                    and self.delivers_everywhere(world)):
            return None
        ranks = [_unpack(part.tolist(), r, h) for r, (part, h) in enumerate(zip(parts, heads))]
        record = _summarise(epoch, code[:n], shift, ranks)
        # (gather_for_metrics is accelerate's: only a prepared loader has one to check)
        share = loader_share(index_domain(loader), n) if is_prepared(loader) else n
        record["coverage"]["for_metrics"] = _for_metrics(lambda i: int(code[i]), shift, ranks,
                                                         record["coverage"], n, share)
        if self.keep_present:
            record["_present"] = (code[:n] & (shift - 1)).astype(np.uint8)
        return record

    def _exchange_at_once(self, accelerator, row: list[int],
                          mine: torch.Tensor) -> tuple[list[list[int]], list[torch.Tensor]]:
        """ONE all-reduce of the buffer: the code (summed), then one slot per rank, in which
        only that rank writes (its `row` of figures and its packed detail; the others' zeros
        add nothing, so the sums are the rank's bytes exactly). Every rank then holds every
        rank's figures and detail. A rank whose detail outgrows its slot says so in it, and
        then every rank, knowing it alike, joins one ragged gather of the details."""
        world, width = self.slots
        slots = self.buffer[self.buffer.size - world * width * 8:].view(np.int64)
        slots = slots.reshape(world, width)
        rank, k = accelerator.process_index, len(row)
        fits = 1 + k + mine.numel() <= width
        slots[rank, 0] = 1 if fits else 2
        slots[rank, 1:1 + k] = row
        if fits:
            slots[rank, 1 + k:1 + k + mine.numel()] = mine.numpy()
        if world > 1:
            all_reduce_bytes(accelerator, self.buffer)
        heads = slots[:, 1:1 + k].tolist()
        if int(slots[:, 0].max()) == 2:
            return heads, gather_ragged(accelerator, mine, [h[-1] for h in heads])
        return heads, [torch.from_numpy(slots[r, 1 + k:1 + k + h[-1]].copy())
                       for r, h in enumerate(heads)]

    def present_so_far(self, accelerator) -> Optional[np.ndarray]:
        """Mid-epoch, a collective: how many ranks have received each sample so far (uint8,
        up to 255 ranks), on the main process; None elsewhere. The epoch goes on after it."""
        self.state.add(self.pending, self.shift_now)
        self.pending, self.pending_ids = [], 0
        self.state.to_host(self.counts)
        mine = np.minimum(self.counts, 1).astype(np.uint8)
        if accelerator.num_processes > 1:
            reduce_to_main(accelerator, mine, background=False, chunk=CHUNK)()
        return mine if accelerator.is_main_process else None


    def holds(self, ids: np.ndarray) -> Optional[np.ndarray]:
        """Mid-epoch, local (no collective): whether this rank has received each of `ids` (0-based,
        as add_ids gives them) so far this epoch; None where the ids are counted on a device (the
        counter stays there until the epoch's end). sharddemo.watch's window check."""
        copies = self.copies(ids)
        return None if copies is None else copies > 0

    def copies(self, ids: np.ndarray) -> Optional[np.ndarray]:
        """Mid-epoch, local: how many times this rank has received each of `ids` so far this
        epoch (0 for an id outside [0, n); the byte counter's, which wraps past 255), or None
        as for holds."""
        if self.on_device or self.shift_now:
            return None
        self.state.add(self.pending, self.shift_now)
        self.pending, self.pending_ids = [], 0
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros(ids.shape, dtype=np.uint8)
        inside = (ids >= 0) & (ids < self.n)
        out[inside] = self.counts[ids[inside]]
        return out


class BitCounts(Counts):
    """The count path at two bits per sample, for the largest datasets (from BITS_FROM): a
    bitmap of the samples this rank received and one of those it received more than once
    (N/4 bytes in all: 250 MB at 10^9), and the exact count of the first LIST_CAP samples to
    come again. The epoch's end sends the code a chunk at a time (each chunk unpacked from
    the bitmaps, reduced onto the main process, read there and dropped: _Tally), so that no
    N-sized array is ever made; the detail goes first, so that the main process knows which
    samples' codes to keep. The record is the byte counter's, but for which repeats are
    listed where a rank repeats more than LIST_CAP samples (the first to come again, not the
    lowest ids). Ids on a device are copied to the host (no device bitmap)."""

    counts_on_device = False

    def _counter(self):
        self.slots = None  # (the slots are the byte counter's one-collective end)
        return _BitRunning(self.n)

    def delivers_everywhere(self, world: int) -> bool:
        return world == 1

    def holds(self, ids):
        return None  # (two bits a sample: not looked up mid-epoch)

    def copies(self, ids):
        return None

    def present_so_far(self, accelerator):
        raise NotImplementedError("the 2-bit count path keeps no per-rank count to save")

    def finish(self, accelerator, loader, epoch: int, everyone: bool = False) -> Optional[dict]:
        n, state = self.n, self.state
        head, tail = self._close()
        repeat_ids = sorted(state.exact)[:LIST_CAP]
        repeats_total = _popcount(state.again)
        mine = _pack(self.sizes, self.made, head, tail, repeat_ids,
                     [state.exact[i] for i in repeat_ids], sorted(state.outside)[:LIST_CAP],
                     state.order.digest())
        row = [0, self.steps, self.samples, repeats_total, _popcount(state.seen),
               state.outside_total, len(self.sizes), len(self.made), remainder(loader),
               int(state.in_order(self.last_size())), int(mine.numel())]
        heads = exchange_ints(accelerator, row)
        parts = gather_ragged(accelerator, mine, [h[-1] for h in heads])
        main = accelerator.is_main_process
        world = accelerator.num_processes
        shift, dtype = code_layout(world)
        ranks, tally = None, None
        if main:
            ranks = [_unpack(part.tolist(), r, h)
                     for r, (part, h) in enumerate(zip(parts, heads))]
            tally = _Tally(shift, [*_extra_copies(ranks), *(_dropped(ranks) or [])])
        for lo in range(0, n, CHUNK):  # (CHUNK is a multiple of 8: whole bytes of the maps)
            hi = min(n, lo + CHUNK)
            code = state.code(lo, hi, shift, dtype)
            if world > 1:
                reduce_to_main(accelerator, code, background=False, chunk=CHUNK)()
            if main:
                tally.add(code, lo)
        if not main:
            return None
        record = tally.record(epoch, ranks)
        share = loader_share(index_domain(loader), n) if is_prepared(loader) else n
        record["coverage"]["for_metrics"] = _for_metrics(tally.value, shift, ranks,
                                                         record["coverage"], n, share)
        return record


def _popcount(bitmap: np.ndarray) -> int:
    """The bits set in a uint8 bitmap (a chunk at a time: no N-sized temporary)."""
    total = 0
    count = getattr(np, "bitwise_count", None)  # numpy 2
    for lo in range(0, bitmap.size, CHUNK):
        part = bitmap[lo:lo + CHUNK]
        total += int(count(part).sum(dtype=np.int64) if count is not None
                     else np.unpackbits(part).sum(dtype=np.int64))
    return total


def slot_ints(keep: int, batch: int, workers: int) -> int:
    """The int64s of one rank's slot (Counts `slots`): a flag, the figures (11), and room for
    a detail whose kept batches hold up to `batch` ids each (a larger one is gathered ragged):
    up to 16 runs of batch sizes, every worker's figures, the first and last `keep` batches,
    LIST_CAP repeats with their counts, LIST_CAP ids outside the dataset, and the order hash
    (see _pack). About 3,100 for batches of 4 and 3 kept (25 KB a rank)."""
    return (1 + 11 + 2 * 16 + 3 * (workers + 2) + 2 * (1 + keep * (2 + batch))
            + 1 + 2 * LIST_CAP + 1 + LIST_CAP + 16)


def _too_many_copies(heads: list[list[int]], epoch: int) -> None:
    bad = [r for r, h in enumerate(heads) if h[0]]
    if bad:
        raise TooManyCopies(f"rank(s) {bad} received some sample more than {MAX_COPIES} "
                            f"times in epoch {epoch}: too many for the count path; use "
                            "--gather epoch")



def code_layout(world: int) -> tuple[int, type]:
    """(shift, numpy dtype) of the per-sample code for `world` ranks (options.code_width)."""
    shift, width = code_width(world)
    return shift, {1: np.uint8, 2: np.uint16, 4: np.uint32}[width]



def _add_made(made: dict[int, list[int]], worker: int, batches: int, samples: int) -> None:
    entry = made.setdefault(worker, [0, 0])
    entry[0] += batches
    entry[1] += samples


def encode(counts: np.ndarray, world: int) -> tuple[np.ndarray, int]:
    """A rank's per-sample code for the sum over ranks, and its shift: 0 -> 0, 1 -> 1, more
    -> 1 + shift (see code_layout: 16 in uint8 up to 15 ranks, 256 in uint16 up to 255, else
    65536 in uint32), so the sum holds the ranks that received a sample and, times shift, the
    ranks that received it more than once. In place in `counts` for uint8, a chunk at a time
    (no N-sized temporary). Not `np.take(table, counts, out=counts)`: numpy buffers an output
    that overlaps its input, far slower at large N."""
    shift, dtype = code_layout(world)
    if dtype is np.uint8 and int(counts.max(initial=0)) <= 1:
        return counts, shift  # 0 -> 0, 1 -> 1: the counter is its own code
    code = counts if dtype is np.uint8 else np.empty(counts.shape, dtype)
    for lo in range(0, counts.size, CHUNK):
        part = code[lo:lo + CHUNK]
        np.minimum(counts[lo:lo + CHUNK], 2, out=part)  # 0, 1, or 2 for "more than once"
        part[part == 2] = 1 + shift
    return code, shift


def _dropped(ranks: list[dict]) -> Optional[list[int]]:
    """The ids accelerate's gather_for_metrics drops from the last step (past `remainder` of
    the ranks' last batches, in rank order); None where it cannot be read (no remainder, or
    ranks of unequal steps: no loop reaches the last step)."""
    rem = [r["remainder"] for r in ranks]
    if None in rem or len(set(rem)) != 1 or len({r["steps"] for r in ranks}) != 1:
        return None
    keep = rem[0]
    last = [i for r in ranks for i in ((r["tail"] or r["head"])[-1:] or [[]])[0]]
    return last[keep:] if keep > 0 else []


def _for_metrics(value_at: Callable[[int], int], shift: int, ranks: list[dict], cov: dict,
                 n: int, share: Optional[int] = None):
    """What accelerate's gather_for_metrics returns over the epoch (every step whole, the last
    keeping its first `remainder` ids, as report.for_metrics): {"count", "exact"}, or None
    where no loop reaches the last step (unequal steps) or the loader is not prepared.
    Exact when it holds n ids (or the `share` of them a Subset leaves the loader: it can deal
    no others) and no id had all its copies in the dropped part."""
    share = n if share is None else share
    dropped = _dropped(ranks)
    if dropped is None:
        return None
    count = cov["seen"] - len(dropped)
    if count != share or cov["missing_count"] != n - share or cov["out_of_range"]:
        return {"count": count, "exact": False}
    drop: dict[int, int] = {}
    for i in dropped:
        drop[i] = drop.get(i, 0) + 1
    extra = _extra_copies(ranks)
    listed = all(r["repeats_total"] <= LIST_CAP for r in ranks)
    for i, d in drop.items():
        value = value_at(i)
        present, several = value % shift, value // shift
        copies = present + extra.get(i, 0) if listed else present + several  # else a floor
        if copies <= d:
            return {"count": count, "exact": False}
    return {"count": count, "exact": True}


# Ids counted, hashed and checked at a time. Each flush touches most of the counter's cache
# lines, which the loader's work between two flushes has pushed out of the cache, so fewer,
# larger flushes cost less; but the batches waiting for a flush are the loader's own memory,
# kept from reuse. 2^18 (2 MB of ids) measured best of 2^13..2^20 (benchmarks/run.py
# overhead; docs/benchmarks.md).
FLUSH_IDS = 1 << 18


class _Running:
    """What the walk accumulates over the ids, fed a list of batches (about FLUSH_IDS ids) at a
    time: the counter, the order hash, whether the ids are in order (in_order), and the ids
    outside [0, n)."""

    device = torch.device("cpu")

    def __init__(self, counter: torch.Tensor, ones: torch.Tensor, n: int) -> None:
        self.counter, self.ones, self.n = counter, ones, n
        # 9 us per 65,536 ids where sha256 took 300 (xxhash: a dependency of datasets)
        self.order = xxhash.xxh3_128()
        self.falls, self.last = 0, None  # ids below the one before them
        self.fall_at = 0  # the position in the epoch of the first of them
        self.position = 0  # the ids taken so far
        self.outside: set[int] = set()
        self.outside_total = 0

    def in_order(self, last_batch: int) -> bool:
        """The rank's ids in order: they never decrease, but for one fall back inside its
        last batch (`last_batch` ids): the fill or padding that wraps an unshuffled walk back
        to its first ids there (accelerate's even_batches fill, IterableDatasetShard's, a
        DistributedSampler's padding) and nowhere else."""
        return self.falls == 0 or (self.falls == 1
                                   and self.fall_at >= self.position - last_batch)

    def add(self, batches: list[torch.Tensor], shift: int = 0) -> None:
        """Count `batches`, whose ids are their values - shift (one subtraction for all)."""
        if not batches:
            return
        if len(batches) == 1:
            ids = unshift(batches[0], shift)  # a new tensor where shifted: not the loader's
        else:
            ids = torch.cat(batches)  # our own tensor: shifted in place, no second copy
            if shift:
                ids.sub_(shift)
        if not ids.numel():
            return
        arr = ids.numpy()
        self.order.update(memoryview(arr))  # the same digest as hashing batch after batch
        if self.falls < 2:  # (from two on, the answer is known)
            at = np.flatnonzero(arr[1:] < arr[:-1])[:2] + 1
            if self.last is not None and arr[0] < self.last:
                at = np.concatenate(([0], at))
            if at.size and not self.falls:
                self.fall_at = self.position + int(at[0])
            self.falls += int(at.size)
        self.position += arr.size
        self.last = arr[-1]
        if arr.min() < 0 or arr.max() >= self.n:
            inside = (arr >= 0) & (arr < self.n)
            bad = arr[~inside]
            self.outside_total += int(bad.size)
            if len(self.outside) < LIST_CAP:
                self.outside.update(bad[:LIST_CAP].tolist())
            ids = ids[torch.from_numpy(inside)]
        self.count(ids)

    def count(self, ids: torch.Tensor) -> None:
        # uint8: wraps past 255, caught by the total after the walk
        self.counter.index_add_(0, ids, self.ones.expand(ids.numel()))

    def to_host(self, counts: np.ndarray) -> None:
        """The counter is `counts` itself: nothing to copy."""


# The order hash on a device: two lanes of splitmix64's finaliser over (id, position), summed
# modulo 2^64 (int64 arithmetic wraps), so the sum is the same however the ids are split into
# flushes, and differs when the same ids come in another order. Constants as signed int64.
def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_MIX = [_signed(c) for c in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)]
_LANES = [_signed(c) for c in (0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93)]


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (the right shifts made logical by a mask)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX[0]
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX[1]
    return x ^ ((x >> 31) & ((1 << 33) - 1))


class _DeviceOrder:
    def __init__(self, lanes: torch.Tensor) -> None:
        self.lanes = lanes

    def digest(self) -> bytes:
        return np.asarray(self.lanes.tolist(), dtype="<i8").tobytes()


class _DeviceRunning:
    """_Running for ids that live on a device: the counter (N + 1 bytes: the last counts ids
    outside [0, n)), the order hash, the falls (an id below the one before it) and the ids
    outside, all kept on the device, so a step queues a few kernels and never waits for them.
    The host reads it once, at the epoch's end (to_host, order, in_order, outside_total)."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.device, self.n = device, n
        self.counter = torch.zeros(n + 1, dtype=torch.uint8, device=device)
        self.ones = torch.ones(1, dtype=torch.uint8, device=device)
        self.lanes = torch.zeros(2, dtype=torch.int64, device=device)
        self.salt = torch.tensor(_LANES, dtype=torch.int64, device=device).view(2, 1)
        self.falls = torch.zeros((), dtype=torch.int64, device=device)
        self.fall_at = torch.full((), -1, dtype=torch.int64, device=device)
        self.bad = torch.zeros((), dtype=torch.int64, device=device)
        self.last: Optional[torch.Tensor] = None
        self.position = 0
        self.outside: set[int] = set()

    def add(self, batches: list[torch.Tensor], shift: int = 0) -> None:
        if not batches:
            return
        ids = torch.cat(batches) if len(batches) > 1 else batches[0]
        if shift:
            ids = ids - shift
        size = ids.shape[0]
        if not size:
            return
        where = torch.arange(self.position, self.position + size, device=self.device)
        self.position += size
        self.lanes += _mix(ids ^ _mix(where * self.salt)).sum(dim=1)
        # each id below the one before it, and where the last such is (no sync: kept here)
        fell = torch.empty(size, dtype=torch.bool, device=self.device)
        fell[0] = ids[0] < self.last if self.last is not None else False
        fell[1:] = ids[1:] < ids[:-1]
        self.falls += fell.sum()
        self.fall_at = torch.maximum(self.fall_at, torch.where(fell, where, -1).max())
        self.last = ids[-1]
        outside = (ids < 0) | (ids >= self.n)
        self.bad += outside.sum()
        self.counter.index_add_(0, torch.where(outside, self.n, ids),
                                self.ones.expand(size))

    def to_host(self, counts: np.ndarray) -> None:
        counts[:self.n] = self.counter[:self.n].cpu().numpy()

    @property
    def order(self) -> _DeviceOrder:
        return _DeviceOrder(self.lanes)

    def in_order(self, last_batch: int) -> bool:
        """As _Running.in_order (with one fall, the last fall is the fall)."""
        falls = int(self.falls)
        return falls == 0 or (falls == 1 and int(self.fall_at) >= self.position - last_batch)

    @property
    def outside_total(self) -> int:
        return int(self.bad)


def _pack(sizes, made, head, tail, repeat_ids, repeat_counts, outside, digest: bytes):
    flat: list[int] = []
    for size, times in sizes:
        flat += [size, times]
    for worker in sorted(made):
        flat += [worker, made[worker][0], made[worker][1]]
    for group in (head, tail):
        flat.append(len(group))
        for batch, worker in group:
            flat += [worker, len(batch)]
            flat += batch
    flat.append(len(repeat_ids))
    flat += np.asarray(repeat_ids, dtype=np.int64).tolist()
    flat += np.asarray(repeat_counts, dtype=np.int64).tolist()
    flat.append(len(outside))
    flat += outside
    flat += list(digest)
    return torch.tensor(flat, dtype=torch.int64)


def _unpack(flat: list[int], rank: int, head_row: list[int]) -> dict:
    (_, steps, samples, repeats_total, distinct, outside_total, n_sizes, n_workers, remainder,
     ascending, _) = head_row
    pos = 0

    def take(k: int) -> list[int]:
        nonlocal pos
        out = flat[pos:pos + k]
        pos += k
        return out

    sizes = [take(2) for _ in range(n_sizes)]
    workers = {w: [b, s] for w, b, s in (take(3) for _ in range(n_workers))}
    groups, made_by = [], []
    for _ in range(2):
        batches, makers = [], []
        for _ in range(take(1)[0]):
            worker, size = take(2)
            makers.append(worker)
            batches.append(take(size))
        groups.append(batches)
        made_by.append(makers)
    k = take(1)[0]
    repeat_ids, repeat_counts = take(k), take(k)
    outside = take(take(1)[0])
    digest = bytes(take(16)).hex()
    return {"rank": rank, "steps": steps, "samples": samples, "sizes": sizes,
            "workers": workers, "head": groups[0], "tail": groups[1],
            "head_workers": made_by[0], "tail_workers": made_by[1],
            "repeats": [[i, c] for i, c in zip(repeat_ids, repeat_counts)],
            "repeats_total": repeats_total, "distinct": distinct,
            "out_of_range": outside, "out_of_range_total": outside_total,
            "order_hash": digest, "ascending": bool(ascending),
            "remainder": None if remainder == -2 else remainder}


def _extra_copies(ranks: list[dict]) -> dict[int, int]:
    """id -> copies beyond the first that ranks listed (each rank's own repeats)."""
    extra: dict[int, int] = {}
    for r in ranks:
        for i, c in r["repeats"]:
            extra[i] = extra.get(i, 0) + c - 1
    return extra


def _summarise(epoch: int, code: np.ndarray, shift: int, ranks: list[dict]) -> dict[str, Any]:
    """The counted epoch on the main process, from the reduced code per sample (ranks holding
    it + shift x ranks holding it more than once) and every rank's listed repeats. Read a
    chunk at a time (_Tally)."""
    tally = _Tally(shift, _extra_copies(ranks))
    for lo in range(0, code.size, CHUNK):
        tally.add(code[lo:lo + CHUNK], lo)
    return tally.record(epoch, ranks)


class _Tally:
    """The counted epoch, summed up one chunk of the reduced code at a time, so that the
    whole code need never be held (BitCounts reduces a chunk, reads it, drops it). `wanted`:
    ids whose code is kept (`values`) for what is read after the last chunk (the exact copy
    counts of listed repeats, what gather_for_metrics dropped)."""

    def __init__(self, shift: int, wanted=()) -> None:
        self.shift = shift
        self.bits = shift.bit_length() - 1  # shift is a power of 2: bit operations, fast in numpy
        self.missing: list[int] = []
        self.dup_ids: list[int] = []
        self.dup_present: list[int] = []
        self.n_missing = self.n_dup = self.n_several = self.n_present = self.n_shared = 0
        self.levels: set[int] = set()
        self.wanted = np.unique(np.asarray(list(wanted), dtype=np.int64))
        self.values: dict[int, int] = {}

    def add(self, part: np.ndarray, lo: int) -> None:
        shift = self.shift
        if self.wanted.size:
            hit = self.wanted[(self.wanted >= lo) & (self.wanted < lo + part.size)]
            self.values.update(zip(hit.tolist(), part[hit - lo].tolist()))
        top = int(part.max(initial=0))
        if top < shift:  # nobody received any of these more than once (a sharded loader)
            present, several = part, None
        else:
            present, several = part & (shift - 1), part >> self.bits
        held = int(np.count_nonzero(present))
        # which rank counts occur: up to 8 ranks, 0 where a sample is missing, the largest
        # (`top`), and a test per level between (cheaper than a bincount; for a sharded
        # loader, whose levels are 0 and 1 or 2, no pass at all, or one)
        levels = self.levels
        if several is None and top <= 8:
            levels.update(k for k in range(1, top) if np.any(present == k))
            if held < part.size:
                levels.add(0)
            if top:
                levels.add(top)
        else:
            levels.update(np.flatnonzero(np.bincount(present)).tolist())
        self.n_missing += int(part.size) - held
        self.n_present += held
        if held < part.size and len(self.missing) < LIST_CAP:
            gone = np.flatnonzero(present == 0)[:LIST_CAP - len(self.missing)]
            self.missing += (gone + lo).tolist()
        if several is None and top <= 1:
            return  # no duplicates here
        shared = present > 1  # received by several ranks
        self.n_shared += int(np.count_nonzero(shared))
        dup = np.flatnonzero(shared if several is None else shared | (several > 0))
        self.n_dup += int(dup.size)
        if len(self.dup_ids) < LIST_CAP:
            keep = dup[:LIST_CAP - len(self.dup_ids)]
            self.dup_ids += (keep + lo).tolist()
            self.dup_present += present[keep].tolist()
        if several is not None:
            self.n_several += int(np.count_nonzero(several))

    def value(self, i: int) -> int:
        """The reduced code of a wanted id."""
        return self.values[i]

    def record(self, epoch: int, ranks: list[dict]) -> dict[str, Any]:
        shift = self.shift
        extra = _extra_copies(ranks)
        # Exact copy counts where every rank's repeats were listed whole (always, unless a
        # rank repeats more than LIST_CAP ids); else a lower bound, said so (most_copies_exact).
        exact = all(r["repeats_total"] <= LIST_CAP for r in ranks)
        duplicates = [(i, p + extra.get(i, 0)) for i, p in zip(self.dup_ids, self.dup_present)]
        # The most copies of one sample: the most ranks holding one, or, for a sample some rank
        # received more than once (listed with its count), the ranks holding it plus those
        # extra copies. Exact under the same condition as the copy counts, else a lower bound.
        most = max(self.levels, default=0)
        for i, more in extra.items():
            most = max(most, self.value(i) % shift + more)
        outside = sorted({i for r in ranks for i in r["out_of_range"]})
        return {
            "epoch": epoch, "gather": "count", "ranks": ranks,
            "coverage": {
                "seen": sum(r["samples"] for r in ranks),
                "unique": self.n_present + len(outside),
                "missing": self.missing, "missing_count": self.n_missing,
                "duplicates": duplicates, "duplicate_count": self.n_dup,
                "most_copies": most, "most_copies_exact": exact,
                "ranks_per_sample": sorted(self.levels),
                "repeated_within_a_rank": self.n_several,
                "on_several_ranks": self.n_shared,
                "out_of_range": outside[:LIST_CAP],
            },
        }


# A flush of ids spanning at most this many ids per id is counted in a dense scratch (a few
# ns an id); a wider one (ids scattered over the dataset: a shuffled sampler) by a sort.
SCRATCH_SPAN = 8


class _BitRunning(_Running):
    """_Running over two bitmaps: `seen` (received at least once) and `again` (more than
    once), and the exact counts of the first LIST_CAP samples to come again (`exact`)."""

    def __init__(self, n: int) -> None:
        size = -(-max(n, 1) // 8)
        super().__init__(None, None, n)
        self.seen = np.zeros(size, dtype=np.uint8)
        self.again = np.zeros(size, dtype=np.uint8)
        self.exact: dict[int, int] = {}

    def count(self, ids: torch.Tensor) -> None:
        arr = ids.numpy()
        if not arr.size:
            return
        lo = int(arr.min()) & ~7
        span = int(arr.max()) + 1 - lo
        if span <= SCRATCH_SPAN * arr.size + 64:
            # how many times each id of the span came in this flush (int32: no wrap)
            scratch = np.zeros(-(-span // 8) * 8, dtype=np.int32)
            torch.from_numpy(scratch).index_add_(0, torch.from_numpy(arr - lo),
                                                 torch.ones(1, dtype=torch.int32)
                                                 .expand(arr.size))
            first, last = lo >> 3, (lo >> 3) + scratch.size // 8
            new = np.packbits(scratch > 0, bitorder="little")
            old = self.seen[first:last]
            again = (old & new) | np.packbits(scratch > 1, bitorder="little")
            if again.any():
                self.again[first:last] |= again
                before = np.unpackbits(old, bitorder="little")
                came = np.flatnonzero((scratch > 1) | ((scratch > 0) & (before > 0)))
                self._note(came + lo, scratch[came], before[came])
            self.seen[first:last] = old | new
            return
        ids_u, times = np.unique(arr, return_counts=True)
        byte, mask = ids_u >> 3, (1 << (ids_u & 7)).astype(np.uint8)
        before = (self.seen[byte] & mask) != 0
        came = before | (times > 1)
        _or_into(self.seen, byte, mask)
        if came.any():
            _or_into(self.again, byte[came], mask[came])
            self._note(ids_u[came], times[came], before[came].astype(np.int64))

    def _note(self, ids: np.ndarray, times: np.ndarray, before: np.ndarray) -> None:
        """Ids that came again: `times` in this flush, `before` (0/1) once before it."""
        exact = self.exact
        if len(exact) >= LIST_CAP:  # full: only the ids it lists count on
            keys = np.fromiter(exact, dtype=np.int64, count=len(exact))
            sel = np.isin(ids, keys)
            ids, times = ids[sel], times[sel]
            for i, t in zip(ids.tolist(), times.tolist()):
                exact[i] += t
            return
        for i, t, b in zip(ids.tolist(), times.tolist(), before.tolist()):
            if i in exact:
                exact[i] += t
            elif len(exact) < LIST_CAP:
                exact[i] = t + b

    def code(self, lo: int, hi: int, shift: int, dtype) -> np.ndarray:
        """The per-sample code (0, 1, 1 + shift: see encode) of samples lo..hi-1."""
        bytes_ = slice(lo >> 3, -(-hi // 8))
        seen = np.unpackbits(self.seen[bytes_], bitorder="little", count=hi - lo)
        again = np.unpackbits(self.again[bytes_], bitorder="little", count=hi - lo)
        if dtype is np.uint8:
            again *= shift  # (0 or shift: fits a byte up to 15 ranks)
            seen += again
            return seen
        return seen.astype(dtype) + again.astype(dtype) * shift

    def to_host(self, counts) -> None:
        """The bitmaps are on the host already."""


def _or_into(bitmap: np.ndarray, byte: np.ndarray, mask: np.ndarray) -> None:
    """bitmap[byte] |= mask, for sorted `byte` that may repeat (ids sharing a byte)."""
    if not byte.size:
        return
    starts = np.flatnonzero(np.r_[True, byte[1:] != byte[:-1]])
    bitmap[byte[starts]] |= np.bitwise_or.reduceat(mask, starts)
