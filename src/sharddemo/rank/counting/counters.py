"""The count path's log of an epoch on one rank: Counts (one byte per sample) and BitCounts (two
bits, from options.BITS_FROM samples), fed batch after batch by rank.recorder.Recorder; their
`finish`, a collective, gives the counted record on the main process."""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np
import torch

from sharddemo.rank.collect import (all_reduce_bytes, exchange_ints,
                                    gather_ragged, reduce_to_main)
from sharddemo.rank.counting.device import DeviceRunning
from sharddemo.rank.counting.host import BitRunning, Running, Shrunk, popcount
from sharddemo.rank.counting.summary import (Tally, dropped_ids, extra_copies, for_metrics,
                                             summarise)
from sharddemo.rank.counting.wire import (CHUNK, code_layout, encode, pack_detail,
                                          unpack_detail)
from sharddemo.rank.describe import index_domain, is_prepared, remainder
from sharddemo.rank.ids import unshift
from sharddemo.record import LIST_CAP, loader_share


# First and last batches each rank keeps in full (at least; one per DataLoader worker where
# there are more workers, so that every worker's first and last batch is kept).
KEEP_BATCHES = 3


# Ids counted, hashed and checked at a time. Each flush touches most of the counter's cache
# lines, which the loader's work between two flushes has pushed out of the cache, so fewer,
# larger flushes cost less; but the batches waiting for a flush are the loader's own memory,
# kept from reuse. 2^18 (2 MB of ids) measured best of 2^13..2^20 (benchmarks/run.py
# overhead; docs/benchmarks.md).
FLUSH_IDS = 1 << 18


# A rank may receive one sample at most this many times in an epoch (the uint8 counter).
MAX_COPIES = 255


class TooManyCopies(RuntimeError):
    """A rank received one sample more than MAX_COPIES times in an epoch: the count path's
    byte counter cannot hold that."""


class Counts:
    """The count path's log of one epoch on this rank (see sharddemo.rank.counting): fed batch
    after batch by a Recorder, then `finish` exchanges it (a collective) and returns the counted
    record on the main process. Per batch only bookkeeping; the ids are counted, hashed and
    checked FLUSH_IDS at a time (one index_add_, one hash update, one comparison), which is what
    keeps the walk close to the bare loop's speed."""

    def __init__(self, n: int, keep: int = KEEP_BATCHES, background: bool = True, *,
                 slots: Optional[tuple[int, int]] = None) -> None:
        self.n = int(n)
        # the reduce in gloo's background thread while the small exchanges go on (sharddemo's
        # own ranks); False in a user's process (sharddemo.watch): a gloo process group that
        # ran async work and is left to the interpreter's teardown can abort the process at
        # exit ("terminate called without an active exception"; docs/benchmarks.md, "Figures
        # behind design choices")
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
        # (ids, None, shift, worker), or (a block, its row, shift, worker): add_rows
        self.tail: collections.deque = collections.deque(maxlen=keep)
        self.pending: list[torch.Tensor] = []  # values, all with the shift `shift_now`
        self.pending_ids = self.shift_now = 0
        self.samples = self.steps = 0
        # The current run of equal batch sizes and of batches from one worker (a batch's
        # bookkeeping is a few additions; the runs are stored when they end).
        self.size_now, self.size_run = -1, 0
        self.worker_now, self.worker_batches, self.worker_samples = None, 0, 0

    # ids that live on a device are counted there (DeviceRunning)
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
        # the same memory: torch's index_add_ counts fast (ids on a device: DeviceRunning,
        # chosen at the first batch)
        return Running(torch.from_numpy(self.counts), torch.ones(1, dtype=torch.uint8), self.n)

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
                self.state = DeviceRunning(ids.device, self.n)
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
            self.tail.append((ids, None, shift, worker))
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
        if head:
            for row in block[:head]:
                self.head.append((unshift(row, shift), worker))
        # (the last rows by their block and index, read at _close: no tensor made a row
        # here, each a call into torch on the per-batch path)
        for i in range(max(head, count - self.keep), count):
            self.tail.append((block, i, shift, worker))
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
        tail = [(unshift(t if i is None else t[i], shift).tolist(), worker)
                for t, i, shift, worker in self.tail]
        return head, tail

    def shrink(self, n: int) -> None:
        """Count over 0..n-1 only, from here to the epoch's end (`n` below this counter's N).

        For a watch whose ranks' datasets differ in length (each rank's counter sized from
        its own): every rank shrinks to the same N before finish, so that the epoch's
        collectives have the same size on every rank (gloo aborts on unequal sizes). The ids
        this rank received in n..N-1 become ids outside [0, n), as they would have been
        counted with N = n from the start: their total, and the first LIST_CAP listed. Call
        it right before finish (nothing is counted after it)."""
        if n >= self.n:
            return
        self.state.add(self.pending, self.shift_now)
        self.pending, self.pending_ids = [], 0
        self.state.to_host(self.counts)  # (ids counted on a device: their counter, here)
        cut = self.counts[n:]
        cut_ids = (np.flatnonzero(cut)[:LIST_CAP] + n).tolist()
        cut_total = int(cut.sum(dtype=np.int64))
        kept = self.counts[:n].copy()
        old = self.state
        self.n = n
        self._counter()  # (a new buffer: the counter of n, then the slots)
        self.counts[:] = kept
        self.state = Shrunk(old, cut_ids, cut_total)

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
        # sum is `distinct` and nothing repeats (a max and a count, cheaper than a sum and a
        # scan: docs/benchmarks.md, "Figures behind design choices").
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
        mine = pack_detail(sizes, made, head, tail, repeats, counts[repeats],
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
        ranks = [unpack_detail(part.tolist(), r, h) for r, (part, h) in enumerate(zip(parts, heads))]
        record = summarise(epoch, code[:n], shift, ranks)
        # (gather_for_metrics is accelerate's: only a prepared loader has one to check)
        share = loader_share(index_domain(loader), n) if is_prepared(loader) else n
        record["coverage"]["for_metrics"] = for_metrics(lambda i: int(code[i]), shift, ranks,
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
    the bitmaps, reduced onto the main process, read there and dropped: Tally), so that no
    N-sized array is ever made; the detail goes first, so that the main process knows which
    samples' codes to keep. The record is the byte counter's, but for which repeats are
    listed where a rank repeats more than LIST_CAP samples (the first to come again, not the
    lowest ids). Ids on a device are copied to the host (no device bitmap)."""

    counts_on_device = False

    def _counter(self):
        self.slots = None  # (the slots are the byte counter's one-collective end)
        return BitRunning(self.n)

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
        repeats_total = popcount(state.again)
        mine = pack_detail(self.sizes, self.made, head, tail, repeat_ids,
                     [state.exact[i] for i in repeat_ids], sorted(state.outside)[:LIST_CAP],
                     state.order.digest())
        row = [0, self.steps, self.samples, repeats_total, popcount(state.seen),
               state.outside_total, len(self.sizes), len(self.made), remainder(loader),
               int(state.in_order(self.last_size())), int(mine.numel())]
        heads = exchange_ints(accelerator, row)
        parts = gather_ragged(accelerator, mine, [h[-1] for h in heads])
        main = accelerator.is_main_process
        world = accelerator.num_processes
        shift, dtype = code_layout(world)
        ranks, tally = None, None
        if main:
            ranks = [unpack_detail(part.tolist(), r, h)
                     for r, (part, h) in enumerate(zip(parts, heads))]
            tally = Tally(shift, [*extra_copies(ranks), *(dropped_ids(ranks) or [])])
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
        record["coverage"]["for_metrics"] = for_metrics(tally.value, shift, ranks,
                                                         record["coverage"], n, share)
        return record


def _too_many_copies(heads: list[list[int]], epoch: int) -> None:
    bad = [r for r, h in enumerate(heads) if h[0]]
    if bad:
        raise TooManyCopies(f"rank(s) {bad} received some sample more than {MAX_COPIES} "
                            f"times in epoch {epoch}: too many for the count path; use "
                            "--gather epoch")


def _add_made(made: dict[int, list[int]], worker: int, batches: int, samples: int) -> None:
    entry = made.setdefault(worker, [0, 0])
    entry[0] += batches
    entry[1] += samples
