"""What a rank sends at the epoch's end on the count path: its counter recoded as a code per
sample that one reduce sums (code_layout, encode), and its detail (batch sizes, workers, kept
batches, repeats, ids outside, the order hash) packed into int64s (pack_detail, unpack_detail)
and the slot that holds it (slot_ints)."""

from __future__ import annotations

import numpy as np
import torch

from sharddemo.options import code_width
from sharddemo.record import LIST_CAP


# Counters are recoded, reduced and read this many samples at a time (no temporary of N
# elements, and a bounded copy where the code goes wider than it is or to a device).
CHUNK = 1 << 22


def code_layout(world: int) -> tuple[int, type]:
    """(shift, numpy dtype) of the per-sample code for `world` ranks (options.code_width)."""
    shift, width = code_width(world)
    return shift, {1: np.uint8, 2: np.uint16, 4: np.uint32}[width]


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


def slot_ints(keep: int, batch: int, workers: int) -> int:
    """The int64s of one rank's slot (Counts `slots`): a flag, the figures (11), and room for
    a detail whose kept batches hold up to `batch` ids each (a larger one is gathered ragged):
    up to 16 runs of batch sizes, every worker's figures, the first and last `keep` batches,
    LIST_CAP repeats with their counts, LIST_CAP ids outside the dataset, and the order hash
    (see pack_detail). About 3,100 for batches of 4 and 3 kept (25 KB a rank)."""
    return (1 + 11 + 2 * 16 + 3 * (workers + 2) + 2 * (1 + keep * (2 + batch))
            + 1 + 2 * LIST_CAP + 1 + LIST_CAP + 16)


def pack_detail(sizes, made, head, tail, repeat_ids, repeat_counts, outside, digest: bytes):
    """A rank's detail as one int64 tensor, for the gather: its batch-size runs, each worker's
    batches and samples, the kept first and last batches with their workers, its repeats and
    their counts, its ids outside the dataset, and the order hash's 16 bytes."""
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


def unpack_detail(flat: list[int], rank: int, head_row: list[int]) -> dict:
    """A rank's entry of the counted record ("ranks"), from the detail pack_detail made and
    the row of figures the rank exchanged (`head_row`)."""
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
