"""Gradient-accumulation windows: which ids each optimizer step consumed.

A training loop that accumulates K batches steps its optimizer once per K batches of each rank
(transformers' Trainer: the last window of an epoch takes what is left, steps % K). Window j on
rank r is that rank's batches j*K .. j*K+K-1; the optimizer step j sums the gradients of every
rank's window j. Pure and torch-free: it reads the per-rank batches of an epoch record.
"""

from __future__ import annotations

from typing import Any

# Windows listed one by one in the report; the counts cover them all.
WINDOW_CAP = 100


def window_counts(steps: list[int], k: int) -> dict:
    """Return what the windows are from each rank's step count alone.

    A counted epoch keeps only the step counts: they give the optimizer steps, and how many batches
    the last window takes on each rank.

    >>> window_counts([977, 977], 3)
    {'k': 3, 'optimizer_steps': 326, 'steps_per_rank': [977, 977], 'last_batches': [2, 2], 'uneven_last': True}
    """
    count = max((-(-s // k) for s in steps), default=0)
    last = [min(k, max(0, s - (count - 1) * k)) for s in steps] if count else []
    return {"k": k, "optimizer_steps": count, "steps_per_rank": list(steps),
            "last_batches": last, "uneven_last": any(b != k for b in last)}


def accumulation_windows(ranks: list[list[list[int]]], k: int) -> dict:
    """ranks[r] = rank r's batches of one epoch, in order -> the windows of K batches.

    >>> w = accumulation_windows([[[0, 1], [2, 3], [4]], [[5, 6], [7, 8], [9]]], 2)
    >>> [x["samples"] for x in w["windows"]], w["last_batches"], w["uneven_last"]
    ([8, 2], [1, 1], True)
    """
    steps = [len(batches) for batches in ranks]
    count = max((-(-s // k) for s in steps), default=0)
    windows: list[dict[str, Any]] = []
    for j in range(count):
        per_rank = [[i for batch in batches[j * k:(j + 1) * k] for i in batch] for batches in ranks]
        sizes = [len(batches[j * k:(j + 1) * k]) for batches in ranks]
        windows.append({"window": j, "batches": sizes, "ranks": per_rank,
                        "samples": sum(len(ids) for ids in per_rank)})
    # Each rank's windows, laid end to end, are its epoch: nothing skipped, nothing twice.
    partition = all([i for w in windows for i in w["ranks"][r]] == [i for b in batches for i in b]
                    for r, batches in enumerate(ranks))
    seen: set[int] = set()
    across: set[int] = set()
    for w in windows:
        mine = {i for ids in w["ranks"] for i in ids}
        across |= mine & seen
        seen |= mine
    return {
        **window_counts(steps, k),
        "partition": partition,
        "in_several_windows": sorted(across),
        "windows": windows[:WINDOW_CAP] + (windows[-1:] if count > WINDOW_CAP else []),
        "windows_listed": min(count, WINDOW_CAP + 1),
    }
