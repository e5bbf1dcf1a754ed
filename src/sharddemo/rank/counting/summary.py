"""The counted epoch on the main process: the reduced code per sample read a chunk at a time
(Tally, summarise) into the record's coverage, and what accelerate's gather_for_metrics
returns over it (for_metrics). No torch."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from sharddemo.rank.counting.wire import CHUNK
from sharddemo.record import LIST_CAP


def extra_copies(ranks: list[dict]) -> dict[int, int]:
    """id -> copies beyond the first that ranks listed (each rank's own repeats)."""
    extra: dict[int, int] = {}
    for r in ranks:
        for i, c in r["repeats"]:
            extra[i] = extra.get(i, 0) + c - 1
    return extra


def summarise(epoch: int, code: np.ndarray, shift: int, ranks: list[dict]) -> dict[str, Any]:
    """The counted epoch on the main process, from the reduced code per sample (ranks holding
    it + shift x ranks holding it more than once) and every rank's listed repeats. Read a
    chunk at a time (Tally)."""
    tally = Tally(shift, extra_copies(ranks))
    for lo in range(0, code.size, CHUNK):
        tally.add(code[lo:lo + CHUNK], lo)
    return tally.record(epoch, ranks)


class Tally:
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
        extra = extra_copies(ranks)
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


def dropped_ids(ranks: list[dict]) -> Optional[list[int]]:
    """The ids accelerate's gather_for_metrics drops from the last step (past `remainder` of
    the ranks' last batches, in rank order); None where it cannot be read (no remainder, or
    ranks of unequal steps: no loop reaches the last step)."""
    rem = [r["remainder"] for r in ranks]
    if None in rem or len(set(rem)) != 1 or len({r["steps"] for r in ranks}) != 1:
        return None
    keep = rem[0]
    last = [i for r in ranks for i in ((r["tail"] or r["head"])[-1:] or [[]])[0]]
    return last[keep:] if keep > 0 else []


def for_metrics(value_at: Callable[[int], int], shift: int, ranks: list[dict], cov: dict,
                 n: int, share: Optional[int] = None):
    """What accelerate's gather_for_metrics returns over the epoch (every step whole, the last
    keeping its first `remainder` ids, as report.for_metrics): {"count", "exact"}, or None
    where no loop reaches the last step (unequal steps) or the loader is not prepared.
    Exact when it holds n ids (or the `share` of them a Subset leaves the loader: it can deal
    no others) and no id had all its copies in the dropped part."""
    share = n if share is None else share
    dropped = dropped_ids(ranks)
    if dropped is None:
        return None
    count = cov["seen"] - len(dropped)
    if count != share or cov["missing_count"] != n - share or cov["out_of_range"]:
        return {"count": count, "exact": False}
    drop: dict[int, int] = {}
    for i in dropped:
        drop[i] = drop.get(i, 0) + 1
    extra = extra_copies(ranks)
    listed = all(r["repeats_total"] <= LIST_CAP for r in ranks)
    for i, d in drop.items():
        value = value_at(i)
        present, several = value % shift, value // shift
        copies = present + extra.get(i, 0) if listed else present + several  # else a floor
        if copies <= d:
            return {"count": count, "exact": False}
    return {"count": count, "exact": True}
