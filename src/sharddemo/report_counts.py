"""The analysis of a counted epoch (counting.py): the same report fields as
report.analyse_epoch, found in counts, order hashes and the first and last batches instead of
every id. Lists (missing, duplicated, ragged steps) hold at most LIST_CAP entries;
`missing_count`, `duplicate_count` and `ragged_step_count` are always exact.

What the count path cannot say, and the small path can: which DataLoader worker delivered
each copy of a duplicated stream sample (`causes` per id); here a stream's repeats are
worker replication when a rank with several workers received some sample more than once.
"""

from __future__ import annotations

from typing import Any, Optional

from sharddemo import report as R

# Most ids any list in a counted record holds (missing, duplicated, out of range, ragged steps,
# a rank's repeats); the totals are always exact. Here, not in counting.py, so that the report
# (built in the parent) never imports torch.
LIST_CAP = 1000
# Most ids of one kept batch the report lists (its first ones; `batch_sizes` has its size), so
# that the report stays small for any batch size too. The analysis reads the batches whole.
KEPT_BATCH_CAP = 4096


def _known_units(rank: dict, order: str) -> tuple[int, dict[int, Any]]:
    """Rank's units (batches for 'batch' order, single ids for 'sample' order) whose position
    is known: the first and last batches it kept. -> (how many units, {position: unit})."""
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


def _dealt_ends(ranks: list[dict], order: str, want: int):
    """The first and the last `want` ids in the order the loader dealt them (rank after rank
    per step, or per sample position), from the kept batches; None where a needed position
    was not kept."""
    units = [_known_units(r, order) for r in ranks]
    longest = max((t for t, _ in units), default=0)

    def at(pos: int):
        out = []
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


def _complete(ranks: list[dict]) -> Optional[list[list[list[int]]]]:
    """Every rank's whole epoch, where each kept all its batches (short epochs)."""
    out = []
    for r in ranks:
        if r["steps"] > len(r["head"]) + len(r["tail"]):
            return None
        out.append(r["head"] + r["tail"])
    return out


def tail_repeats_head(record: dict, order: str) -> Optional[int]:
    """report.tail_repeats_head on the dealt order, from the counts: the `extra` repeated ids
    each arrived twice, and the last `extra` ids dealt equal the first ones dealt (so the rest
    of the head is distinct). The whole order where every batch was kept."""
    ranks, cov = record["ranks"], record["coverage"]
    whole = _complete(ranks)
    if whole is not None:
        dealt = (R.interleave_steps(whole) if order == "batch"
                 else R._interleave_samples([R._flat(b) for b in whole]))
        return R.tail_repeats_head(dealt)
    extra = cov["seen"] - cov["unique"]
    # extra = the sum over duplicated ids of (copies - 1): as many duplicated ids as extra
    # copies means each arrived exactly twice.
    if extra > cov["unique"] or cov["duplicate_count"] != extra or cov["out_of_range"]:
        return None
    ends = _dealt_ends(ranks, order, extra)
    if ends is None:
        return None
    first, last = ends
    return extra if first == last else None


def fill_per_worker(record: dict, limit: int) -> Optional[int]:
    """report.fill_per_worker, from the counts: IterableDatasetShard in each DataLoader worker
    fills that worker's last global batch from the start of its share of the stream. The
    whole orders where every batch was kept. Else, per worker, its first global batch (each
    rank's first batch from that worker, rank after rank) and its last: the fill is the end of
    the last that repeats the start of the first. Each id so placed is an extra copy of an id
    dealt earlier, so where they add up to every extra copy (the caller's test), the fills
    are the only repeats. None where a worker's first or last batch was not kept, its ranks
    hold unequal numbers of its batches, or its last batch does not end that way."""
    ranks = record["ranks"]
    if any("head_workers" not in r for r in ranks):
        return None
    whole = _complete(ranks)
    if whole is not None:
        return R.fill_per_worker(R.worker_orders(
            whole, [r["head_workers"] + r["tail_workers"] for r in ranks]), limit)
    total = 0
    for worker in sorted({int(k) for r in ranks for k in r["workers"]}):
        counts = {r["workers"].get(worker, r["workers"].get(str(worker), [0]))[0] for r in ranks}
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
            again = R.tail_repeats_head(first)
        else:
            at = last.index(first[0]) if first and first[0] in last else len(last)
            again = len(last) - at
            if last[at:] != first[:again]:
                return None
        if again is None or again >= max(limit, 1):
            return None
        total += again
    return total


def _replicated(record: dict, world: int) -> bool:
    """report._replicated, from the counts: every rank held the same samples once each, or
    every rank walked the very same sequence (equal order hashes over equal lengths)."""
    ranks, cov = record["ranks"], record["coverage"]
    if world < 2 or ranks[0]["samples"] == 0:
        return False
    if all(r["samples"] == ranks[0]["samples"] and r["order_hash"] == ranks[0]["order_hash"]
           for r in ranks):
        return True
    return (all(r["repeats_total"] == 0 and r["samples"] == ranks[0]["samples"] for r in ranks)
            and set(cov["ranks_per_sample"]) <= {0, world})


def _ranks_disagree(record: dict, n: int) -> bool:
    ranks, cov = record["ranks"], record["coverage"]
    if len(ranks) < 2 or any(r["repeats_total"] for r in ranks):
        return False
    union = cov["unique"]
    return sum(r["samples"] for r in ranks) != union and union < n


def explain_duplicates(record: dict, loader: dict, hint: Optional[str], kind: str,
                       world: int, batch: int, n: int) -> tuple[str, bool]:
    """report.explain_duplicates, decided from the counts."""
    if R.is_double_split(loader):
        return "double-split", True
    if hint:
        return hint, True
    if R.draws_repeat(loader, n) and sum(r["samples"] for r in record["ranks"]) < (
            loader["draws"]["count"] + world * batch):
        return "sampler-draws", True
    code, order = R.padding_mechanism(loader)
    if code is not None:
        again = tail_repeats_head(record, order)
        limit = world if order == "sample" else world * batch
        if again is not None and 0 < again < max(limit, 1):
            return code, True
    if _replicated(record, world):
        if R.dispatched_from_other_workers(loader, [{int(k) for k in r["workers"]}
                                                    for r in record["ranks"]]):
            return "worker-replication", False
        return "replication", kind == R.REPLICATED
    if _ranks_disagree(record, n) and (code is not None or loader.get("seedable_sampler")):
        return "ranks-disagree", False
    return code or "unexplained", False


def _ragged(ranks: list[dict]) -> tuple[list[int], int]:
    """Steps where the ranks' batches differ in size, from the run-length batch sizes."""
    cuts = {0}
    runs = []
    for r in ranks:
        pos, mine = 0, []
        for size, times in r["sizes"]:
            mine.append((pos, pos + times, size))
            pos += times
            cuts.add(pos)
        runs.append(mine)
    cuts = sorted(cuts)
    steps: list[int] = []
    total = 0
    for lo, hi in zip(cuts, cuts[1:]):
        sizes = {size for mine in runs for a, b, size in mine if a <= lo < b}
        if len(sizes) > 1:
            total += hi - lo
            steps.extend(range(lo, min(hi, lo + max(0, LIST_CAP - len(steps)))))
    return steps, total



def _for_metrics(record: dict) -> tuple[Optional[int], Optional[bool]]:
    """What gather_for_metrics would return over the epoch: its length and whether it is
    every sample exactly once, found on the main rank where the counts are
    (counting._for_metrics). (None, None) where no loop reaches the last step."""
    got = record["coverage"].get("for_metrics")
    return (None, None) if got is None else (got["count"], got["exact"])


def analyse_counted_epoch(mode: str, trace: dict, record: dict, previous: Optional[dict],
                          loader: Optional[dict] = None, hint: Optional[str] = None) -> dict:
    n, w = trace["dataset_size"], trace["world_size"]
    loader = dict(loader or {})
    loader["drop_last"] = bool(loader.get("drop_last") or R._opts(trace).get("drop_last"))
    kind = R.mode_kind(mode, trace)
    ranks, cov = record["ranks"], record["coverage"]
    steps = [r["steps"] for r in ranks]
    extra = cov["seen"] - cov["unique"]
    per_rank_batch = max(1, R.global_batch(trace) // max(w, 1))
    reasons: dict[str, str] = {}
    dup_code, explained = None, True
    known = all(all(int(k) >= -1 for k in r["workers"]) for r in ranks) and any(
        r["workers"] for r in ranks)
    stream_padded = (loader.get("iterable_shard") and 0 < (tail_repeats_head(record, "batch") or 0)
                     < w * per_rank_batch)
    # IterableDatasetShard with several DataLoader workers: one fill per worker.
    shard_workers = bool(loader.get("iterable_shard") and known
                         and R.several_workers([[int(k) for k in r["workers"]] for r in ranks])
                         and not (R.is_double_split(loader) or hint))
    if extra and shard_workers and fill_per_worker(record, w * per_rank_batch) == extra:
        dup_code, explained = "shard-fill", True
        reasons[dup_code] = R.REASON_SENTENCE[dup_code]
    elif extra and loader.get("iterable_dataset") and known and not (
            (loader.get("iterable_shard") and not shard_workers) or loader.get("dispatcher")
            or R.is_double_split(loader) or hint) and not stream_padded:
        codes = set()
        if any(r["repeats_total"] and sum(int(k) >= 0 for k in r["workers"]) > 1 for r in ranks):
            codes.add("worker-replication")
        if max(cov["ranks_per_sample"], default=0) > 1 or not codes:
            codes.add("stream-replication")
        dup_code = "worker-replication" if "worker-replication" in codes else "stream-replication"
        explained = codes == {"stream-replication"} and kind == R.REPLICATED
        for code in sorted(codes):
            reasons[code] = R.REASON_SENTENCE[code]
    elif extra:
        dup_code, explained = explain_duplicates(record, loader, hint, kind, w, per_rank_batch, n)
        reasons[dup_code] = R.reason_sentence(dup_code, loader, n)
    missing = cov["missing_count"]
    miss_code, miss_explained = None, True
    if missing:
        if kind == R.REPLICATED and not loader.get("drop_last"):
            miss_code, miss_explained = None, False
        else:
            miss_code, miss_explained = R.explain_missing(missing, loader, hint,
                                                          R.global_batch(trace), dup_code, n,
                                                          cov["unique"])
        if miss_code:
            reasons[miss_code] = R.reason_sentence(miss_code, loader, n, missing,
                                                   miss_explained)
    hang = min(steps) if len(set(steps)) > 1 else None
    ragged, ragged_total = _ragged(ranks)
    out: dict[str, Any] = {
        "epoch": record["epoch"],
        "ranks": [
            {"rank": r["rank"], "steps": r["steps"], "samples": r["samples"],
             "first_batches": [b[:KEPT_BATCH_CAP] for b in r["head"]],
             "last_batches": [b[:KEPT_BATCH_CAP] for b in r["tail"]], "batch_sizes": r["sizes"],
             "order_hash": r["order_hash"], "ascending": r["ascending"]}
            for r in ranks
        ],
        "steps_equal": hang is None,
        "hang_at_step": hang,
        "ragged_steps": ragged,
        "ragged_step_count": ragged_total,
        "gather": "count",
        "gathered": None,
        "gathered_count": cov["seen"],
        "seen": cov["seen"],
        "times_dataset": round(cov["seen"] / n, 4) if n else 0.0,
        "unique": cov["unique"],
        "missing": cov["missing"],
        "missing_count": missing,
        "missing_reason": miss_code,
        "missing_explained": bool(miss_code) and miss_explained if missing else True,
        "out_of_range": cov["out_of_range"],
        "duplicates": [{"id": i, "count": c, "reason": dup_code} for i, c in cov["duplicates"]],
        "duplicate_count": cov["duplicate_count"],
        "most_copies": cov["most_copies"],
        "most_copies_exact": cov["most_copies_exact"],
        "duplicates_explained": explained,
        "reasons": reasons,
    }
    if loader.get("prepared"):
        count, exact = _for_metrics(record)
        out["gathered_for_metrics"] = None
        out["gathered_for_metrics_count"] = count
        out["gather_for_metrics_exact"] = exact
        out["gather_for_metrics_equals_gather"] = count is not None and count == cov["seen"]
    if known:
        rows, idle = [], []
        configured = int(loader.get("num_workers") or 0)
        if loader.get("dispatcher"):
            made = {int(k) for r in ranks for k in r["workers"]}
            idle = [{"rank": 0, "worker": k} for k in range(configured) if k not in made]
            configured = 0
        for r in ranks:
            total = r["samples"]
            for worker in sorted(r["workers"], key=int):
                b, s = r["workers"][worker]
                rows.append({"rank": r["rank"], "worker": int(worker), "batches": b,
                             "samples": s, "share": round(s / total, 4) if total else 0.0})
            idle += [{"rank": r["rank"], "worker": k} for k in range(configured)
                     if k not in {int(x) for x in r["workers"]}]
        out["workers"] = rows
        out["idle_workers"] = idle
    hashes = [r["order_hash"] for r in ranks]
    out["ranks_same_order"] = len(ranks) > 1 and ranks[0]["samples"] > 0 and len(set(hashes)) == 1
    if previous is None or "coverage" not in previous:
        out["order_changed"] = None
    else:
        out["order_changed"] = hashes != [r["order_hash"] for r in previous["ranks"]]
    out["same_ids_on_every_rank"] = _same_ids(record)
    return out


def _same_ids(record: dict) -> bool:
    """Every rank received the same set of ids (report.replicated_ok's test)."""
    ranks, cov = record["ranks"], record["coverage"]
    if len(ranks) < 2:
        return True
    levels = set(cov["ranks_per_sample"]) - {0}
    return levels <= {len(ranks)} and not cov["out_of_range"]
