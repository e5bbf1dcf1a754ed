"""The count path's tallies on the host: Running (a uint8 counter over the dataset, the order
hash, whether the ids come in order, the ids outside it) and BitRunning (two bitmaps, for the
largest datasets), each fed a flush of batches at a time by counters.Counts."""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from sharddemo.rank.counting.wire import CHUNK
from sharddemo.rank.ids import unshift
from sharddemo.record import LIST_CAP


class Running:
    """What the walk accumulates over the ids, fed a list of batches (about FLUSH_IDS ids) at a
    time: the counter, the order hash, whether the ids are in order (in_order), and the ids
    outside [0, n)."""

    device = torch.device("cpu")

    def __init__(self, counter: torch.Tensor, ones: torch.Tensor, n: int) -> None:
        self.counter, self.ones, self.n = counter, ones, n
        # xxh3, far cheaper than sha256 (docs/benchmarks.md, "Figures behind design
        # choices"); xxhash is a dependency of datasets
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


class Shrunk:
    """A counter's state after Counts.shrink: the order, the falls and the ids outside of the
    state it replaces (host or device), with the ids cut off the counter added to the ids
    outside. Nothing more is counted into it: shrink comes right before the epoch's end."""

    device = torch.device("cpu")

    def __init__(self, old, cut_ids: list[int], cut_total: int) -> None:
        self.old = old
        self.outside: set[int] = set(old.outside) | set(cut_ids)
        self.outside_total = int(old.outside_total) + cut_total

    @property
    def order(self):
        return self.old.order

    def in_order(self, last_batch: int) -> bool:
        return self.old.in_order(last_batch)

    def add(self, batches: list[torch.Tensor], shift: int = 0) -> None:
        if any(b.numel() for b in batches):
            raise RuntimeError("a shrunk counter counts nothing more (shrink before finish)")

    def to_host(self, counts: np.ndarray) -> None:
        """The counter is already on the host, shrunk: nothing to copy."""


# A flush of ids spanning at most this many ids per id is counted in a dense scratch (a few
# ns an id); a wider one (ids scattered over the dataset: a shuffled sampler) by a sort.
SCRATCH_SPAN = 8


class BitRunning(Running):
    """Running over two bitmaps: `seen` (received at least once) and `again` (more than
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


def popcount(bitmap: np.ndarray) -> int:
    """The bits set in a uint8 bitmap (a chunk at a time: no N-sized temporary)."""
    total = 0
    count = getattr(np, "bitwise_count", None)  # numpy 2
    for lo in range(0, bitmap.size, CHUNK):
        part = bitmap[lo:lo + CHUNK]
        total += int(count(part).sum(dtype=np.int64) if count is not None
                     else np.unpackbits(part).sum(dtype=np.int64))
    return total
