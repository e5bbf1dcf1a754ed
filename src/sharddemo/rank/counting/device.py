"""The count path's tally for ids that live on a device (DeviceRunning): the counter, an order
hash of its own and the checks, all kept on the device until the epoch's end."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


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


class DeviceRunning:
    """Running for ids that live on a device: the counter (N + 1 bytes: the last counts ids
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
        """As Running.in_order (with one fall, the last fall is the fall)."""
        falls = int(self.falls)
        return falls == 0 or (falls == 1 and int(self.fall_at) >= self.position - last_batch)

    @property
    def outside_total(self) -> int:
        return int(self.bad)
