"""Pure analysis of a trace: coverage, duplicates and why, balance, order, a conclusion.

Plain Python over plain data (the JSON the ranks wrote), so it is tested without processes.
"""

from __future__ import annotations

import math
from typing import Any, Optional

REPORT_SCHEMA = "sharddemo.report/1"

# What each mode promises: sharded modes split the dataset, replicated ones repeat it.
SHARDED = "sharded"
REPLICATED = "replicated"
MODE_KIND = {"prepared": SHARDED, "sampler": SHARDED, "replicated": REPLICATED}


def _interleave_steps(ranks: list[list[list[int]]]) -> list[int]:
    """What a per-batch all_gather returns: step by step, rank 0's batch, then rank 1's ..."""
    out: list[int] = []
    for step in range(max((len(b) for b in ranks), default=0)):
        for batches in ranks:
            if step < len(batches):
                out.extend(batches[step])
    return out


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def duplicate_reason(mode: str, trace: dict, extra: int) -> tuple[str, str, bool]:
    """Why a sample appears more than once in this mode's epoch: a short code, a sentence,
    and whether the library's own rule accounts for all `extra` repeated samples (False:
    something else is going on)."""
    opts = trace.get("options", {})
    n, b, w = trace["dataset_size"], trace["batch_size"], trace["world_size"]
    drop_last = opts.get("drop_last", False)
    if mode == "sampler":
        per_rank = n // w if drop_last else math.ceil(n / w)
        pad = per_rank * w - n
        return ("sampler-padding",
                f"DistributedSampler padding: every rank gets ceil({n}/{w}) = {per_rank} samples, "
                f"so it repeats the first {pad} index(es) of the epoch's order",
                extra == max(pad, 0))
    if mode == "prepared":
        steps = math.ceil(math.ceil(n / b) / w)
        fill = steps * w * b - n
        return ("even-batches-fill",
                f"accelerate even_batches loop-around: every rank gets {steps} full batch(es) of "
                f"{b}, so the last round is filled from the start of the epoch ({fill} sample(s)); "
                "gather_for_metrics drops them",
                extra == max(fill, 0))
    if mode == "replicated":
        return ("replication",
                f"replication: the loader is not sharded, so each of the {w} ranks walks all {n} "
                "samples",
                extra == (w - 1) * n)
    return ("unexplained", "not explained by the loader's own padding", False)


def coverage(flat: list[list[int]], n: int) -> dict:
    """Unique, missing, out-of-range and duplicated ids over all ranks' ids.

    Counted with numpy's bincount: a dict of 10 million counts, sorted, took over 20 s.
    """
    import numpy as np

    ids = np.fromiter((i for ids in flat for i in ids), dtype=np.int64,
                      count=sum(len(x) for x in flat))
    inside = ids[(ids >= 0) & (ids < n)]
    counts = np.bincount(inside, minlength=n)
    dup = np.flatnonzero(counts > 1)
    outside = np.unique(ids[(ids < 0) | (ids >= n)])
    return {
        "seen": int(len(ids)),
        "unique": int(np.count_nonzero(counts)) + len(outside),
        "missing": np.flatnonzero(counts == 0).tolist(),
        "out_of_range": outside.tolist(),
        "duplicates": list(zip(dup.tolist(), counts[dup].tolist())),
    }


def analyse_epoch(mode: str, trace: dict, record: dict, previous: Optional[dict]) -> dict:
    n = trace["dataset_size"]
    ranks = [r["batches"] for r in record["ranks"]]
    flat = [_flat(b) for b in ranks]
    cov = coverage(flat, n)
    steps = [len(b) for b in ranks]
    extra = cov["seen"] - cov["unique"]
    code, reason, explained = duplicate_reason(mode, trace, extra)
    out: dict[str, Any] = {
        "epoch": record["epoch"],
        "ranks": [
            {"rank": r["rank"], "batches": r["batches"], "steps": len(r["batches"]),
             "samples": len(ids)}
            for r, ids in zip(record["ranks"], flat)
        ],
        "steps_equal": len(set(steps)) <= 1,
        "gathered": record.get("gathered"),
        "seen": cov["seen"],
        "times_dataset": round(cov["seen"] / n, 4),
        "unique": cov["unique"],
        "missing": cov["missing"],
        "out_of_range": cov["out_of_range"],
        "duplicates": [{"id": i, "count": c, "reason": code} for i, c in cov["duplicates"]],
        "reasons": {code: reason} if extra else {},
        "duplicates_explained": explained if extra else True,
    }
    out["gather"] = record.get("gather", "batch")
    out["gathered_count"] = record.get("gathered_count", len(record.get("gathered") or []))
    if record.get("gathered") is not None:
        # Per batch, all_gather interleaves the ranks step by step.
        out["gathered_matches_ranks"] = record["gathered"] == _interleave_steps(ranks)
    if "gathered_for_metrics_count" in record:
        out["gathered_for_metrics"] = record.get("gathered_for_metrics")
        out["gathered_for_metrics_count"] = record["gathered_for_metrics_count"]
        out["gather_for_metrics_exact"] = record.get("gather_for_metrics_exact")
    out["ranks_same_order"] = len(flat) > 1 and all(ids == flat[0] for ids in flat[1:])
    if previous is None:
        out["order_changed"] = None
    else:
        before = [_flat(r["batches"]) for r in previous["ranks"]]
        out["order_changed"] = before != flat
    return out


def broken_promises(mode: str, trace: dict, epochs: list[dict]) -> list[str]:
    """What `--check` fails on: a sharded mode with missing samples or unequal step counts,
    a replicated one whose ranks did not each see everything."""
    n, kind = trace["dataset_size"], MODE_KIND.get(mode, SHARDED)
    problems = []
    for e in epochs:
        tag = f"{mode} epoch {e['epoch']}"
        if kind == SHARDED:
            if e["missing"]:
                problems.append(f"{tag}: {len(e['missing'])} sample(s) never seen: {_short(e['missing'])}")
            if not e["steps_equal"]:
                steps = [r["steps"] for r in e["ranks"]]
                problems.append(f"{tag}: ranks take unequal step counts {steps} (DDP would hang)")
        else:
            for r in e["ranks"]:
                if sorted(set(_flat(r["batches"]))) != list(range(n)):
                    problems.append(f"{tag}: rank {r['rank']} did not see the whole dataset")
        if e["out_of_range"]:
            problems.append(f"{tag}: ids outside the dataset: {_short(e['out_of_range'])}")
        if e.get("gathered_matches_ranks") is False:
            problems.append(f"{tag}: accelerator.gather did not return what the ranks saw")
    return problems


def conclude(mode: str, trace: dict, epochs: list[dict]) -> str:
    """One sentence in plain words, with the arithmetic stated."""
    n, b, w = trace["dataset_size"], trace["batch_size"], trace["world_size"]
    first = epochs[0]
    sums = f"(world size {w} x per-rank batch {b} = global batch {w * b})"
    seen = first["seen"]
    times = f"{first['times_dataset']:g}x"
    kind = MODE_KIND.get(mode, SHARDED)
    dup = sum(d["count"] - 1 for d in first["duplicates"])
    if kind == REPLICATED:
        order = ("in the same order, so the ranks train on identical batches"
                 if first["ranks_same_order"] else "each in its own order")
        return (f"Every rank walked the whole dataset {order}: {seen} samples per epoch for "
                f"a dataset of {n} = {times} {sums}; shard it with accelerator.prepare or a "
                "DistributedSampler.")
    text = (f"The {w} ranks split each epoch between them: {seen} samples per epoch for a "
            f"dataset of {n} = {times} {sums}")
    if first["missing"]:
        text += f", but {len(first['missing'])} sample(s) were never seen"
    if dup:
        why = first["reasons"][first["duplicates"][0]["reason"]].split(":")[0]
        text += f", {dup} repeated by padding ({why})"
    if "gather_for_metrics_exact" in first:
        text += ("; gather_for_metrics returns exactly the dataset, use it for metrics"
                 if first["gather_for_metrics_exact"] else
                 "; gather_for_metrics did not return exactly the dataset")
    if len(epochs) > 1:
        changed = [e["order_changed"] for e in epochs[1:]]
        text += ("; the order changes every epoch" if all(changed)
                 else "; the order does NOT change between epochs")
    return text + "."


def _short(ids: list[int], limit: int = 12) -> str:
    shown = ", ".join(str(i) for i in ids[:limit])
    return f"[{shown}{', ...' if len(ids) > limit else ''}]"


def build_report(trace: dict, *, launch_command: Optional[str] = None,
                 config_file: Optional[str] = None) -> dict:
    """Trace (what the ranks did) -> report (what it means). Deterministic for a given trace."""
    modes: dict[str, Any] = {}
    problems: list[str] = []
    for mode, data in trace["modes"].items():
        epochs: list[dict] = []
        previous = None
        for record in data["epochs"]:
            epochs.append(analyse_epoch(mode, trace, record, previous))
            previous = record
        broken = broken_promises(mode, trace, epochs)
        problems += broken
        modes[mode] = {
            "description": data.get("description", ""),
            "kind": MODE_KIND.get(mode, SHARDED),
            "prepared": data.get("prepared", False),
            "epochs": epochs,
            "broken_promises": broken,
            "conclusion": conclude(mode, trace, epochs),
        }
    report = {
        "schema": REPORT_SCHEMA,
        "world_size": trace["world_size"],
        "backend": trace["backend"],
        "distributed_type": trace.get("distributed_type"),
        "device": trace.get("device"),
        "dataset_size": trace["dataset_size"],
        "batch_size": trace["batch_size"],
        "global_batch": trace["batch_size"] * trace["world_size"],
        "epochs": trace["epochs"],
        "seed": trace["seed"],
        "options": trace.get("options", {}),
        "config_file": config_file,
        "launch_command": launch_command,
        "modes": modes,
        "broken_promises": problems,
    }
    if "timings" in trace:
        report["timings"] = trace["timings"]
    return report
