"""One epoch of one loader -> what it means.

Coverage, duplicates and why, missing and why, balance, order, gather_for_metrics, workers. Written
once, over an epoch view (analysis.views), whether every id or only counts lie behind it."""

from __future__ import annotations

from typing import Any, Optional, cast

from sharddemo.analysis.modes import REPLICATED, global_batch, mode_kind, opts
from sharddemo.analysis.reasons import (REASON_SENTENCE, explain_duplicates, explain_missing,
                                        is_double_split, reason_sentence)
from sharddemo.analysis.types import LoaderDescription, Trace
from sharddemo.analysis.views import EpochView, IdsEpoch, interleave_steps
from sharddemo.record import loader_share


def worker_shares(view: EpochView, configured: int,
                  dispatched: bool = False) -> tuple[list[dict], list[dict]]:
    """Return each rank's workers: what each made, and those that made nothing.

    Per rank and worker: batches, samples and the worker's share of its rank; and the workers that
    made nothing (of the `configured` per rank). With dispatch_batches every batch is made by one of
    rank 0's workers and sliced to the ranks: idle is rank 0's."""
    made = view.made_by()
    rows, idle = [], []
    if dispatched:
        used = {w for mine in made for w in mine}
        idle = [{"rank": 0, "worker": k} for k in range(configured) if k not in used]
        configured = 0
    for r, (mine, total) in enumerate(zip(made, view.samples)):
        for worker in sorted(mine):
            batches, samples = mine[worker]
            rows.append({"rank": r, "worker": worker, "batches": batches, "samples": samples,
                         "share": round(samples / total, 4) if total else 0.0})
        idle += [{"rank": r, "worker": k} for k in range(configured) if k not in mine]
    return rows, idle


def _duplicates(view: EpochView, loader: LoaderDescription, hint: Optional[str], kind: str, w: int,
                per_rank_batch: int, n: int) -> tuple[Optional[str], bool, dict[int, list[str]],
                                                     dict[str, str]]:
    """Return why the epoch's samples repeat, and whether that explains them all.

    The duplicates' reason code, whether it explains them all, per-id causes (a stream's, where the
    view knows them) and the reasons' sentences."""
    extra = view.cov["seen"] - view.cov["unique"]
    if not extra:
        return None, True, {}, {}
    draws = loader.get("draws")
    if loader.get("iterable_dataset") and draws and draws["replacement"]:
        # a stream that draws with replacement (WebDataset resampled=True): its own draw
        code, explained = explain_duplicates(view, loader, hint, kind, w, per_rank_batch, n)
        return code, explained, {}, {code: reason_sentence(code, loader, n)}
    known = view.workers_known()
    # IterableDatasetShard with several DataLoader workers: one fill per worker.
    shard_workers = bool(loader.get("iterable_shard") and known and view.several_workers()
                         and not (is_double_split(loader) or hint))
    if shard_workers and view.fill_per_worker(w * per_rank_batch) == extra:
        return "shard-fill", True, {}, {"shard-fill": REASON_SENTENCE["shard-fill"]}
    # a stream's repeats that are its own loop-around fill (never the case for an unsplit
    # stream, whose repeats are whole copies)
    again = view.repeats_head("batch") if loader.get("iterable_shard") else None
    stream_padded = again is not None and 0 < again < w * per_rank_batch
    if loader.get("iterable_dataset") and known and not (
            (loader.get("iterable_shard") and not shard_workers) or loader.get("dispatcher")
            or is_double_split(loader) or hint) and not stream_padded:
        # IterableDatasetShard's fill: up to a global batch a DataLoader worker, on several ranks
        workers = len({k for ws in view.worker_sets() for k in ws if k >= 0}) or 1
        per_id, codes = view.stream_causes(w * per_rank_batch * workers
                                           if loader.get("iterable_shard") else 0)
        code = "worker-replication" if "worker-replication" in codes else "stream-replication"
        explained = codes == {"stream-replication"} and kind == REPLICATED
        return code, explained, per_id, {c: REASON_SENTENCE[c] for c in sorted(codes)}
    code, explained = explain_duplicates(view, loader, hint, kind, w, per_rank_batch, n)
    return code, explained, {}, {code: reason_sentence(code, loader, n)}


def analyse_epoch(mode: str, trace: Trace, view: EpochView, previous: Optional[EpochView],
                  loader: Optional[LoaderDescription] = None, hint: Optional[str] = None) -> dict:
    """Return the report's epoch object (docs/report.md) for one epoch view.

    `previous`: the view of the epoch before (order_changed), None for the first."""
    n, w = trace["dataset_size"], trace["world_size"]
    loader = cast(LoaderDescription, dict(loader or {}))
    # drop_last as the loader's objects say it, or as the run was asked for (older traces).
    loader["drop_last"] = bool(loader.get("drop_last") or opts(trace).get("drop_last"))
    kind = mode_kind(mode, trace)
    cov = view.cov
    per_rank_batch = max(1, global_batch(trace) // max(w, 1))
    dup_code, explained, per_id, reasons = _duplicates(view, loader, hint, kind, w,
                                                       per_rank_batch, n)
    missing = cov["missing_count"]
    miss_code, miss_explained = None, True
    if missing:
        if kind == REPLICATED and not loader.get("drop_last"):
            miss_code, miss_explained = None, False
        else:
            miss_code, miss_explained = explain_missing(missing, loader, hint,
                                                        global_batch(trace), dup_code, n,
                                                        cov["unique"])
        if miss_code:
            reasons[miss_code] = reason_sentence(miss_code, loader, n, missing, miss_explained)
    steps = view.steps
    hang = min(steps) if len(set(steps)) > 1 else None
    ragged, ragged_total = view.ragged()
    out: dict[str, Any] = {
        "epoch": view.epoch,
        "ranks": view.rank_entries(),
        "steps_equal": hang is None,
        "hang_at_step": hang,
        "ragged_steps": ragged,
        "ragged_step_count": ragged_total,
        "gather": view.gather,
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
        "duplicates": [{"id": i, "count": c, "reason": per_id[i][0] if i in per_id else dup_code,
                        **({"causes": per_id[i]} if i in per_id else {})}
                       for i, c in cov["duplicates"]],
        "duplicate_count": cov["duplicate_count"],
        "most_copies": cov["most_copies"],
        "most_copies_exact": cov["most_copies_exact"],
        "duplicates_explained": explained,
        "reasons": reasons,
    }
    if view.gather == "batch":  # what the per-batch gathers returned, step after step
        out["gathered"] = interleave_steps(cast(IdsEpoch, view).ranks)  # (the ids view's gather)
    if loader.get("prepared"):
        listed, count, exact = view.for_metrics(n, loader_share(loader, n))
        out["gathered_for_metrics"] = listed
        out["gathered_for_metrics_count"] = count
        out["gather_for_metrics_exact"] = exact
        out["gather_for_metrics_equals_gather"] = count is not None and count == cov["seen"]
    if view.workers_known():
        rows, idle = worker_shares(view, int(loader.get("num_workers") or 0),
                                   dispatched=bool(loader.get("dispatcher")))
        out["workers"] = rows
        out["idle_workers"] = idle
    how, keys = view.order_key()
    out["ranks_same_order"] = (len(keys) > 1 and view.samples[0] > 0
                               and all(k == keys[0] for k in keys[1:]))
    before = previous.order_key() if previous is not None else None
    out["order_changed"] = None if before is None or before[0] != how else before[1] != keys
    out["same_ids_on_every_rank"] = view.same_ids()
    # copies past a sample's first that reached another rank (the rest: a rank's own repeats)
    out["copies_on_other_ranks"] = out["seen"] - out["unique"] - view.own_repeats()
    return out

