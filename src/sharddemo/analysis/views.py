"""One epoch as the analysis reads it, whichever record lies behind it.

`epoch_view(record, n)` returns an `IdsEpoch` (every id each rank received, the `batch` and
`epoch` records) or a `CountedEpoch` (per-sample counts, order hashes and the first and last
batches, the `count` record; see sharddemo.record). Both answer the same questions, so
`analysis.epoch.analyse_epoch` is written once: coverage, which ids repeat where (the dealt
order's tail against its head, per DataLoader worker too), whether the ranks replicate or
disagree, ragged steps, what gather_for_metrics returned, which worker made what, and each
rank's order. A new question is added to both views, or it is not asked.

What the counted view cannot say, and the ids view can: which DataLoader worker delivered each
copy of a duplicated stream sample (`causes` per id); there a stream's repeats are worker
replication when a rank with several workers received some sample more than once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional, cast

import numpy as np

# the dealt order, on plain id lists (shared by both views)
from sharddemo.analysis.orders import (dealt, fill_per_worker, flat,  # noqa: F401
                                      in_order, interleave_samples, tail_repeats_head,
                                      worker_orders)
from sharddemo.analysis.types import Coverage, EpochRecord
from sharddemo.record import KEPT_BATCH_CAP, LIST_CAP, interleave_steps  # noqa: F401




def coverage(flat_ids: list[list[int]], n: int) -> Coverage:
    """Count the unique, missing, out-of-range and duplicated ids over all ranks' ids.

    Counted with numpy's bincount: a dict of counts, sorted, is many times slower at millions
    of ids (docs/benchmarks.md, "Figures behind design choices").
    """
    ids = np.fromiter((i for ids in flat_ids for i in ids), dtype=np.int64,
                      count=sum(len(x) for x in flat_ids))
    inside = ids[(ids >= 0) & (ids < n)]
    counts = np.bincount(inside, minlength=n)
    dup = np.flatnonzero(counts > 1)
    outside = np.unique(ids[(ids < 0) | (ids >= n)])
    return {
        "seen": int(len(ids)),
        "unique": int(np.count_nonzero(counts)) + len(outside),
        "missing": np.flatnonzero(counts == 0).tolist(),
        "missing_count": int(np.count_nonzero(counts == 0)),
        "out_of_range": outside.tolist(),
        "duplicates": list(zip(dup.tolist(), counts[dup].tolist())),
        "duplicate_count": int(len(dup)),
        "most_copies": int(counts.max(initial=0)),
        "most_copies_exact": True,
    }


def exactly_once(ids: list[int], n: int, share: Optional[int] = None) -> bool:
    """Say whether the epoch dealt every id of the dataset exactly once.

    Or, for a loader that deals `share` of its n ids (loader_share), that many distinct ids (it
    can deal no others)."""
    if share is not None and share < n:
        return len(ids) == share == len(set(ids)) and all(0 <= i < n for i in ids)
    return len(ids) == n and sorted(ids) == list(range(n))


class EpochView(ABC):
    """What both epoch views answer, from every id (IdsEpoch) or from the counts (CountsEpoch).

    `cov`: seen, unique, missing (a list, capped on the count path), missing_count,
    out_of_range, duplicates [(id, copies)], duplicate_count, most_copies, most_copies_exact.
    `steps` and `samples`: each rank's batches and ids. A view that leaves a method out cannot
    be made (an abstract method), so the two paths answer the same questions."""

    gather: str
    epoch: int
    cov: Coverage
    steps: list[int]
    samples: list[int]

    @abstractmethod
    def workers_known(self) -> bool:
        """Say whether the DataLoader worker of every batch is known on every rank."""

    @abstractmethod
    def worker_sets(self) -> list[set]:
        """Return each rank's set of DataLoader workers (empty where they are not known)."""

    def several_workers(self) -> bool:
        """Say whether more than one DataLoader worker made the batches."""
        return len({k for ws in self.worker_sets() for k in ws if k >= 0}) > 1

    @abstractmethod
    def repeats_head(self, order: str) -> Optional[int]:
        """Return how many ids at the dealt order's end repeat its start (None: none)."""

    @abstractmethod
    def fill_per_worker(self, limit: int) -> Optional[int]:
        """Return the fill a worker's last global batch took from its start (None: none)."""

    @abstractmethod
    def replicated(self) -> bool:
        """Say whether the loader is not sharded: every rank walked the same samples."""

    @abstractmethod
    def ranks_disagree(self, n: int) -> bool:
        """Say whether the ranks' clean slices overlap and leave holes (of `n` samples)."""

    @abstractmethod
    def stream_causes(self, fill: int = 0) -> tuple[dict[int, list[str]], set[str]]:
        """Return the cause of each duplicated id, and the epoch's causes."""

    @abstractmethod
    def ragged(self) -> tuple[list[int], int]:
        """Return the steps where the ranks' batches differ in size (capped) and their count."""

    @abstractmethod
    def for_metrics(self, n: int, share: int) -> tuple[Optional[list[int]], Optional[int],
                                                       Optional[bool]]:
        """Return what accelerator.gather_for_metrics returned over the epoch: its ids, their
        count, and whether it counted each of the `share` samples once."""

    @abstractmethod
    def made_by(self) -> list[dict[int, list[int]]]:
        """Return, per rank, each DataLoader worker's batches and samples."""

    @abstractmethod
    def order_key(self) -> tuple[str, list]:
        """Return what the order is compared by: ("ids", ids) or ("hash", order hashes)."""

    @abstractmethod
    def same_ids(self) -> bool:
        """Say whether every rank received the same set of ids."""

    @abstractmethod
    def own_repeats(self) -> int:
        """Return the copies of a sample past its first on the same rank, over the ranks (the
        epoch's seen - unique, less these, are the copies that reached another rank)."""

    @abstractmethod
    def rank_entries(self) -> list[dict]:
        """Return each rank's entry of the report's epoch."""


class IdsEpoch(EpochView):
    """Every id each rank received, batch by batch (the `batch` and `epoch` records)."""

    def __init__(self, record: EpochRecord, n: int) -> None:
        self.record = record
        self.epoch = record["epoch"]
        self.gather = record.get("gather", "batch")
        self.ranks = [r["batches"] for r in record["ranks"]]
        self.workers = [r.get("workers") or [] for r in record["ranks"]]
        self.flat = [flat(b) for b in self.ranks]
        self.cov = coverage(self.flat, n)
        self.steps = [len(b) for b in self.ranks]
        self.samples = [len(ids) for ids in self.flat]

    def workers_known(self) -> bool:
        return all(len(wk) == len(b) for wk, b in zip(self.workers, self.ranks)) and any(
            x >= -1 for wk in self.workers for x in wk)

    def worker_sets(self) -> list[set]:
        return [set(wk) for wk in self.workers] if self.workers_known() else []

    def repeats_head(self, order: str) -> Optional[int]:
        return tail_repeats_head(dealt(self.ranks, order))

    def fill_per_worker(self, limit: int) -> Optional[int]:
        return fill_per_worker(worker_orders(self.ranks, self.workers), limit)

    def replicated(self) -> bool:
        """Say whether the loader is not sharded: every rank walked the same samples.

        Each once, or the very same sequence (a sampler that repeats ids, the same on every
        rank)."""
        ids = self.flat
        if len(ids) < 2 or not ids[0]:
            return False
        if all(x == ids[0] for x in ids[1:]):
            return True
        first = sorted(ids[0])
        return len(set(first)) == len(first) and all(sorted(x) == first for x in ids[1:])

    def ranks_disagree(self, n: int) -> bool:
        """Say whether the ranks' ids overlap and leave holes: slices cut from different orders.

        Every rank's ids are distinct, but some id is on several ranks while others are on none.
        """
        ids = self.flat
        if len(ids) < 2 or any(len(set(x)) != len(x) for x in ids):
            return False
        union = set().union(*map(set, ids))
        return sum(len(x) for x in ids) != len(union) and len(union) < n

    def stream_causes(self, fill: int = 0) -> tuple[dict[int, list[str]], set[str]]:
        """Return the cause of each duplicated id, found in the records.

        `worker-replication` when some rank received it from several of its DataLoader workers,
        and `stream-replication` where several ranks read it (but `shard-fill` where no more
        than `fill` ids reached several ranks: IterableDatasetShard fills each worker's last
        global batch from its start, the only ids a sharded stream gives more than one rank).
        The records say which rank and which worker delivered each copy."""
        dups = [i for i, _ in self.cov["duplicates"]]
        wanted = set(dups)
        where: dict[int, set] = {}
        for r, (batches, made_by) in enumerate(zip(self.ranks, self.workers)):
            for batch, worker in zip(batches, made_by):
                for i in batch:
                    if i in wanted:
                        where.setdefault(i, set()).add((r, worker))
        ranks_of: dict[int, dict[int, set]] = {}  # id -> rank -> the workers that made it
        for i in dups:
            per_rank = ranks_of[i] = {}
            for r, worker in where.get(i, set()):
                per_rank.setdefault(r, set()).add(worker)
        shared = sum(1 for per_rank in ranks_of.values() if len(per_rank) > 1)
        across = "shard-fill" if 0 < shared <= fill else "stream-replication"
        out = {}
        for i, per_rank in ranks_of.items():
            causes = []
            if any(len(ws) > 1 and min(ws) >= 0 for ws in per_rank.values()):
                causes.append("worker-replication")
            if len(per_rank) > 1:
                causes.append(across)
            out[i] = causes or ["stream-replication"]
        return out, {c for causes in out.values() for c in causes}

    def ragged(self) -> tuple[list[int], int]:
        steps = [s for s in range(max(self.steps, default=0))
                 if len({len(b[s]) for b in self.ranks if s < len(b)}) > 1]
        return steps[:LIST_CAP], len(steps)

    def for_metrics(self, n: int, share: int):
        """Return what accelerator.gather_for_metrics returned over the epoch.

        Recorded as it came when walked per batch; for an epoch gathered at once, every batch
        whole except the last step, which keeps its first `remainder` ids (accelerate's
        gradient_state.remainder, read on the ranks) when that is positive. (None, None, None)
        where no training loop could reach the last step (unequal step counts). -> (the ids
        where listed, count, exact)."""
        record = self.record
        if self.gather == "batch" or record.get("gathered_for_metrics") is not None:
            metrics = record.get("gathered_for_metrics")
        else:
            metrics = None
            remainders = record.get("remainder") or []
            if remainders and None not in remainders and len(set(self.steps)) == 1 \
                    and len(set(remainders)) == 1:
                done = [i for batches in self.ranks for batch in batches[:-1] for i in batch]
                last = [i for batches in self.ranks for i in (batches[-1] if batches else [])]
                keep = cast(int, remainders[0])  # (None is not among them)
                metrics = done + (last[:keep] if keep > 0 else last)
        if metrics is None:
            return None, None, None
        return (metrics if self.gather == "batch" else None, len(metrics),
                exactly_once(metrics, n, share))

    def made_by(self) -> list[dict[int, list[int]]]:
        out = []
        for batches, made in zip(self.ranks, self.workers):
            counts: dict[int, list[int]] = {}
            for batch, worker in zip(batches, made):
                entry = counts.setdefault(worker, [0, 0])
                entry[0] += 1
                entry[1] += len(batch)
            out.append(counts)
        return out

    def order_key(self) -> tuple[str, list]:
        return "ids", self.flat

    def same_ids(self) -> bool:
        sets = [set(ids) for ids in self.flat]
        return all(x == sets[0] for x in sets[1:])

    def own_repeats(self) -> int:
        return sum(len(ids) - len(set(ids)) for ids in self.flat)

    def rank_entries(self) -> list[dict]:
        return [{"rank": r["rank"], "batches": r["batches"], "steps": len(r["batches"]),
                 "samples": len(ids), **({"workers": r["workers"]} if r.get("workers") else {}),
                 "ascending": in_order(r["batches"])}
                for r, ids in zip(self.record["ranks"], self.flat)]


class CountedEpoch(EpochView):
    """An epoch read from its counts (the `count` record): the same answers without every id.

    Per-sample counts reduced on the main rank, each rank's first and last batches and its order
    hash."""

    def __init__(self, record: EpochRecord, n: int) -> None:
        self.record = record
        self.epoch = record["epoch"]
        self.gather = "count"
        self.rank_records = record["ranks"]
        self.cov = record["coverage"]
        self.steps = [r["steps"] for r in self.rank_records]
        self.samples = [r["samples"] for r in self.rank_records]

    def workers_known(self) -> bool:
        ranks = self.rank_records
        return all(all(int(k) >= -1 for k in r["workers"]) for r in ranks) and any(
            r["workers"] for r in ranks)

    def worker_sets(self) -> list[set]:
        return [{int(k) for k in r["workers"]} for r in self.rank_records]

    # -- the dealt order's ends, from the kept batches
    def _complete(self) -> Optional[list[list[list[int]]]]:
        """Every rank's whole epoch, where each kept all its batches (short epochs)."""
        out: list[list[list[int]]] = []
        for r in self.rank_records:
            if r["steps"] > len(r["head"]) + len(r["tail"]):
                return None
            out.append(r["head"] + r["tail"])
        return out

    @staticmethod
    def _known_units(rank: dict, order: str) -> tuple[int, dict[int, Any]]:
        """Return a rank's units whose position is known: the first and last batches it kept.

        Units are batches for 'batch' order, single ids for 'sample' order. -> (how many,
        {position: unit})."""
        head, tail = rank["head"], rank["tail"]
        if order == "batch":
            total = rank["steps"]
            known = dict(enumerate(head))
            known.update({total - len(tail) + k: b for k, b in enumerate(tail)})
            return total, known
        total = rank["samples"]
        first = [i for b in head for i in b]
        last = [i for b in tail for i in b]
        known = dict(enumerate(first))
        known.update({total - len(last) + k: i for k, i in enumerate(last)})
        return total, known

    def _dealt_ends(self, order: str, want: int):
        """Return the first and the last `want` ids in the order the loader dealt them.

        Read from the kept batches; None where a needed position was not kept."""
        units = [self._known_units(r, order) for r in self.rank_records]
        longest = max((t for t, _ in units), default=0)

        def at(pos: int):
            out: list[int] = []
            for total, known in units:
                if pos < total:
                    if pos not in known:
                        return None
                    unit = known[pos]
                    out.extend(unit if order == "batch" else [unit])
            return out

        first: list[int] = []
        pos = 0
        while len(first) < want and pos < longest:
            got = at(pos)
            if got is None:
                return None
            first += got
            pos += 1
        last: list[int] = []
        pos = longest - 1
        while len(last) < want and pos >= 0:
            got = at(pos)
            if got is None:
                return None
            last = got + last
            pos -= 1
        return first[:want], last[-want:] if want else []

    def repeats_head(self, order: str) -> Optional[int]:
        """Return tail_repeats_head on the dealt order, from the counts.

        The `extra` repeated ids each arrived twice, and the last `extra` ids dealt equal the
        first ones dealt (so the rest of the head is distinct). The whole order where every
        batch was kept."""
        cov = self.cov
        whole = self._complete()
        if whole is not None:
            return tail_repeats_head(dealt(whole, order))
        extra = cov["seen"] - cov["unique"]
        # extra = the sum over duplicated ids of (copies - 1): as many duplicated ids as extra
        # copies means each arrived exactly twice.
        if extra > cov["unique"] or cov["duplicate_count"] != extra or cov["out_of_range"]:
            return None
        ends = self._dealt_ends(order, extra)
        if ends is None:
            return None
        first, last = ends
        return extra if first == last else None

    def fill_per_worker(self, limit: int) -> Optional[int]:
        """Return fill_per_worker from the kept batches.

        The whole orders where every batch was kept. Else, per worker, its first global batch
        (each rank's first batch from that worker, rank after rank) and its last: the fill is
        the end of the last that repeats the start of the first. Each id so placed is an extra
        copy of an id dealt earlier, so where they add up to every extra copy (the caller's
        test), the fills are the only repeats. None where a worker's first or last batch was not
        kept, its ranks hold unequal numbers of its batches, or its last batch does not end that
        way."""
        ranks = self.rank_records
        if any("head_workers" not in r for r in ranks):
            return None
        whole = self._complete()
        if whole is not None:
            return fill_per_worker(worker_orders(
                whole, [r["head_workers"] + r["tail_workers"] for r in ranks]), limit)
        total = 0
        for worker in sorted({int(k) for r in ranks for k in r["workers"]}):
            counts = {r["workers"].get(worker, r["workers"].get(str(worker), [0]))[0]
                      for r in ranks}
            if len(counts) != 1:
                return None
            first: list[int] = []
            last: list[int] = []
            for r in ranks:
                mine = [b for b, k in zip(r["head"], r["head_workers"]) if k == worker]
                ends = [b for b, k in zip(r["tail"], r["tail_workers"]) if k == worker]
                if not mine or not ends:
                    return None
                first += mine[0]
                last += ends[-1]
            if counts == {1}:  # one global batch: it is the whole order, filled from itself
                again = tail_repeats_head(first)
            else:
                at = last.index(first[0]) if first and first[0] in last else len(last)
                again = len(last) - at
                if last[at:] != first[:again]:
                    return None
            if again is None or again >= max(limit, 1):
                return None
            total += again
        return total

    def replicated(self) -> bool:
        """Say whether the loader is not sharded, from the counts and the order hashes.

        Every rank held the same samples once each, or every rank walked the very same sequence
        (equal order hashes over equal lengths)."""
        ranks, cov = self.rank_records, self.cov
        world = len(ranks)
        if world < 2 or ranks[0]["samples"] == 0:
            return False
        if all(r["samples"] == ranks[0]["samples"] and r["order_hash"] == ranks[0]["order_hash"]
               for r in ranks):
            return True
        return (all(r["repeats_total"] == 0 and r["samples"] == ranks[0]["samples"]
                    for r in ranks)
                and set(cov["ranks_per_sample"]) <= {0, world})

    def ranks_disagree(self, n: int) -> bool:
        ranks = self.rank_records
        if len(ranks) < 2 or any(r["repeats_total"] for r in ranks):
            return False
        union = self.cov["unique"]
        return sum(r["samples"] for r in ranks) != union and union < n

    def stream_causes(self, fill: int = 0) -> tuple[dict[int, list[str]], set[str]]:
        """Return IdEpoch.stream_causes, from the counts.

        `shard-fill` where no more than `fill` samples reached several ranks."""
        codes = set()
        if any(r["repeats_total"] and sum(int(k) >= 0 for k in r["workers"]) > 1
               for r in self.rank_records):
            codes.add("worker-replication")
        shared = self.cov.get("on_several_ranks")
        if max(self.cov["ranks_per_sample"], default=0) > 1:
            codes.add("shard-fill" if shared is not None and 0 < shared <= fill
                      else "stream-replication")
        elif not codes:
            codes.add("stream-replication")
        return {}, codes

    def ragged(self) -> tuple[list[int], int]:
        """Steps where the ranks' batches differ in size, from the run-length batch sizes."""
        cuts = {0}
        runs = []
        for r in self.rank_records:
            pos, mine = 0, []
            for size, times in r["sizes"]:
                mine.append((pos, pos + times, size))
                pos += times
                cuts.add(pos)
            runs.append(mine)
        cuts_sorted = sorted(cuts)
        steps: list[int] = []
        total = 0
        for lo, hi in zip(cuts_sorted, cuts_sorted[1:]):
            sizes = {size for mine in runs for a, b, size in mine if a <= lo < b}
            if len(sizes) > 1:
                total += hi - lo
                steps.extend(range(lo, min(hi, lo + max(0, LIST_CAP - len(steps)))))
        return steps, total

    def for_metrics(self, n: int, share: int):
        """Found on the main rank where the counts are (rank.counting.for_metrics)."""
        got = self.cov.get("for_metrics")
        return (None, None, None) if got is None else (None, got["count"], got["exact"])

    def made_by(self) -> list[dict[int, list[int]]]:
        return [{int(k): list(v) for k, v in r["workers"].items()} for r in self.rank_records]

    def order_key(self) -> tuple[str, list]:
        return "hash", [r["order_hash"] for r in self.rank_records]

    def own_repeats(self) -> int:
        return sum(int(r["repeats_total"]) for r in self.rank_records)

    def same_ids(self) -> bool:
        """Every rank received the same set of ids."""
        if len(self.rank_records) < 2:
            return True
        levels = set(self.cov["ranks_per_sample"]) - {0}
        return levels <= {len(self.rank_records)} and not self.cov["out_of_range"]

    def rank_entries(self) -> list[dict]:
        return [{"rank": r["rank"], "steps": r["steps"], "samples": r["samples"],
                 "first_batches": [b[:KEPT_BATCH_CAP] for b in r["head"]],
                 "last_batches": [b[:KEPT_BATCH_CAP] for b in r["tail"]],
                 "batch_sizes": r["sizes"], "order_hash": r["order_hash"],
                 "ascending": r["ascending"]}
                for r in self.rank_records]


def epoch_view(record: EpochRecord, n: int) -> EpochView:
    """The view of one epoch record, ids or counts behind it."""
    return CountedEpoch(record, n) if record.get("gather") == "count" else IdsEpoch(record, n)
