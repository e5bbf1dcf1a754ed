"""An epoch's ids in the order they were dealt, on plain id lists (shared by both views of
analysis/views.py): a rank's ids flat, the ranks' dealt order, the tail that repeats the head
(padding, fill), each DataLoader worker's order, and whether a rank's ids are in order."""

from __future__ import annotations

from typing import Optional

import numpy as np

from sharddemo.record import interleave_steps


def interleave_samples(flat: list[list[int]]) -> list[int]:
    """The order a DistributedSampler deals from: rank r's i-th id sits at i * W + r."""
    out: list[int] = []
    for i in range(max((len(ids) for ids in flat), default=0)):
        out.extend(ids[i] for ids in flat if i < len(ids))
    return out


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def dealt(ranks: list[list[list[int]]], order: str) -> list[int]:
    """Return the order the loader dealt: 'batch' or 'sample'.

    'batch': whole batches round-robin (accelerate); 'sample': single ids round-robin (a
    DistributedSampler)."""
    return interleave_steps(ranks) if order == "batch" else interleave_samples(
        [flat(b) for b in ranks])


def tail_repeats_head(order: list[int]) -> Optional[int]:
    """Return how many ids at the end of `order` deal its start again, else None.

    That is, where `order` is a run of distinct ids followed by that run dealt again from its
    start (tiled when short).

    [3, 1, 4, 0, 2, 3, 1] -> 2 (the last two repeat the first two); [3, 1, 3, 1] -> 2; [0, 1, 1,
    0] -> None. This is what padding by "repeat the start of the epoch" leaves, whether a
    DistributedSampler, accelerate's even_batches or IterableDatasetShard did it.
    """
    arr = np.asarray(order, dtype=np.int64)
    unique = len(np.unique(arr))
    head = arr[:unique]
    if len(np.unique(head)) != unique:
        return None
    tail = arr[unique:]
    if len(tail) and not np.array_equal(tail, np.resize(head, len(tail))):
        return None
    return int(len(tail))


def worker_orders(ranks: list[list[list[int]]], workers: list[list[int]]) -> list[list[int]]:
    """Return, for each DataLoader worker, the order its batches were dealt in.

    Step by step, rank 0's batch from that worker, then rank 1's ... (`workers[r][k]`: who made
    rank r's k-th batch). What IterableDatasetShard in each worker dealt, one global batch at a
    time."""
    made = sorted({k for made_by in workers for k in made_by})
    return [interleave_steps([[b for b, k in zip(batches, made_by) if k == worker]
                              for batches, made_by in zip(ranks, workers)])
            for worker in made]


def fill_per_worker(orders: list[list[int]], limit: int) -> Optional[int]:
    """Return how many ids the workers' own fills dealt again, else None.

    IterableDatasetShard inside DataLoader workers: each worker iterates its own copy over its
    share of the stream and fills its own last global batch from the start of that share. The
    ids dealt again in all, where every worker's order (worker_orders) is distinct ids and then
    fewer than `limit` (one global batch) dealt again from its start; else None."""
    total = 0
    for order in orders:
        again = tail_repeats_head(order)
        if again is None or again >= max(limit, 1):
            return None
        total += again
    return total


def in_order(batches: list) -> bool:
    """Say whether a rank's ids are in order.

    They never decrease, but for one fall back inside its last batch: the fill or padding that
    wraps an unshuffled walk back to its first ids there (accelerate's even_batches fill,
    IterableDatasetShard's, a DistributedSampler's padding) and nowhere else. The count path's
    rank answers the same (rank.counting.Running)."""
    ids = [i for batch in batches for i in batch]
    last = len(batches[-1]) if batches else 0
    falls = [k + 1 for k, (a, b) in enumerate(zip(ids, ids[1:])) if b < a][:2]
    return not falls or (len(falls) == 1 and falls[0] >= len(ids) - last)
