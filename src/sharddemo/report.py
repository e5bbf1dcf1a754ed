"""Pure analysis of a trace: coverage, duplicates and why, balance, order, a conclusion, and
the audit's verdicts.

Plain data in, plain data out (the JSON the ranks wrote; numpy only to count ids fast), so it
is tested without processes.
"""

from __future__ import annotations

import math
from typing import Any, Optional

REPORT_SCHEMA = "sharddemo.report/1"

# What each mode promises: sharded modes split the dataset, replicated ones repeat it.
SHARDED = "sharded"
REPLICATED = "replicated"
MODE_KIND = {"replicated": REPLICATED}  # every other mode claims to shard

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


# A few words for each reason code, for the one-sentence conclusion.
REASON_LABEL = {
    "sampler-padding": "DistributedSampler padding",
    "even-batches-fill": "accelerate's even_batches loop-around",
    "shard-fill": "IterableDatasetShard's loop-around",
    "replication": "replication",
    "double-split": "the loader was split twice",
    "ranks-disagree": "the ranks shuffled with different seeds",
    "drop-last": "drop_last",
    "padding": "the loader's own padding",
    "unexplained": "no known reason",
}


def mode_kind(mode: str, trace: dict) -> str:
    if mode == "audit":
        return REPLICATED if _expect(trace) == "replicated" else SHARDED
    return MODE_KIND.get(mode, SHARDED)


def _opts(trace: dict) -> dict:
    return trace.get("options", {})


def _expect(trace: dict) -> str:
    return _opts(trace).get("audit", {}).get("expect", "sharded")


def _is_stream(trace: dict) -> bool:
    return trace.get("source", _opts(trace).get("source", "toy")) in ("iterable", "hf-stream")


def kept_with_drop_last(mode: str, trace: dict) -> Optional[int]:
    """Distinct samples an epoch keeps with drop_last, where the rule is exact (None: not
    stated)."""
    n, b, w = trace["dataset_size"], trace["batch_size"], trace["world_size"]
    opts = _opts(trace)
    if mode == "sampler":
        return w * ((n // w) // b * b)  # the sampler cuts to floor(N/W), the loader to full batches
    if mode == "replicated":
        return n // b * b  # every rank keeps the same full batches
    if mode == "prepared" and not (_is_stream(trace) or opts.get("split_batches")
                                   or opts.get("dispatch_batches")):
        return (n // b) // w * w * b  # complete rounds of W full batches only
    return None


def explain_duplicates(mode: str, trace: dict, extra: int) -> tuple[str, str, bool]:
    """Why samples appear more than once in this mode's epoch: a code, a sentence, and
    whether the library's own rule accounts for all `extra` repeats (False: something else
    is going on)."""
    n, b, w = trace["dataset_size"], trace["batch_size"], trace["world_size"]
    opts = _opts(trace)
    global_batch = b if opts.get("split_batches") else w * b
    if mode == "sampler":
        per_rank = math.ceil(n / w)
        pad = per_rank * w - n
        return ("sampler-padding",
                f"DistributedSampler padding: every rank gets ceil({n}/{w}) = {per_rank} samples, "
                f"so it repeats the first {pad} index(es) of the epoch's order",
                extra == pad)
    if mode == "replicated":
        return ("replication",
                f"replication: the loader is not sharded, so each of the {w} ranks walks all {n} "
                "samples", extra == (w - 1) * n)
    if mode == "double-split":
        return ("double-split",
                "double split: each rank's DistributedSampler half was dealt round-robin across "
                "the ranks again by accelerator.prepare, and each short round filled from its start",
                True)
    if mode == "unseeded":
        return ("ranks-disagree",
                "the ranks shuffled with different seeds (use_seedable_sampler without set_seed), "
                "so their slices of their own permutations overlap", True)
    if mode == "audit":
        if _expect(trace) == "replicated":
            return ("replication", f"replication: the loader is meant to give each of the {w} "
                    "ranks every sample", True)
        return ("padding",
                f"padding: fewer repeats than one global batch ({global_batch}), as a "
                "DistributedSampler's padding or accelerate's even_batches fill make",
                extra < global_batch)
    if mode == "prepared" and _is_stream(trace) and opts.get("dispatch_batches") is False:
        return ("shard-fill",
                "IterableDatasetShard: every rank reads the whole stream and the last round is "
                "filled from its start; a stream has no length, so gather_for_metrics keeps them",
                extra < global_batch)
    if mode == "prepared":
        if not (_is_stream(trace) or opts.get("split_batches") or opts.get("dispatch_batches")):
            steps = math.ceil(math.ceil(n / b) / w)
            fill = steps * w * b - n
            return ("even-batches-fill",
                    f"accelerate even_batches loop-around: every rank gets {steps} full batch(es) "
                    f"of {b}, so the last round is filled from the start of the epoch ({fill} "
                    "sample(s)); gather_for_metrics drops them", extra == fill)
        return ("even-batches-fill",
                "accelerate even_batches loop-around: the last round is filled from the start of "
                "the epoch so every rank gets as many batches", extra < global_batch)
    return ("unexplained", "not explained by the loader's own padding", False)


def explain_missing(mode: str, trace: dict, missing: int) -> tuple[Optional[str], str, bool]:
    """Why samples were never seen: a code (None: no reason, a broken promise), a sentence,
    and whether that reason accounts for all of them."""
    n, b, w = trace["dataset_size"], trace["batch_size"], trace["world_size"]
    if mode == "double-split":
        return ("double-split", "double split: accelerator.prepare split the batches of each "
                "rank's DistributedSampler half again, so the batches dealt to the other rank "
                "are never seen", True)
    if mode == "unseeded":
        return ("ranks-disagree", "the ranks shuffled with different seeds, so their slices "
                "do not cover the dataset", True)
    if _opts(trace).get("drop_last") and mode == "audit":
        return ("drop-last", "drop_last: the loader drops its incomplete last batch or round",
                missing < w * b + w)
    if _opts(trace).get("drop_last"):
        kept = kept_with_drop_last(mode, trace)
        if kept is not None:
            return ("drop-last", f"drop_last: only {kept} samples make complete batches "
                    f"(and rounds), the other {n - min(kept, n)} are dropped", missing == n - min(kept, n))
        return ("drop-last", "drop_last: the incomplete last batch or round is dropped",
                missing < w * b + w)
    return (None, "", False)


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
    reasons: dict[str, str] = {}
    dup_code, explained = None, True
    if extra:
        dup_code, sentence, explained = explain_duplicates(mode, trace, extra)
        reasons[dup_code] = sentence
    miss_code, miss_explained = None, True
    if cov["missing"]:
        miss_code, sentence, miss_explained = explain_missing(mode, trace, len(cov["missing"]))
        if miss_code:
            reasons.setdefault(miss_code, sentence)
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
        "missing_reason": miss_code,
        "missing_explained": bool(miss_code) and miss_explained if cov["missing"] else True,
        "out_of_range": cov["out_of_range"],
        "duplicates": [{"id": i, "count": c, "reason": dup_code} for i, c in cov["duplicates"]],
        "duplicates_explained": explained,
        "reasons": reasons,
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
        out["gather_for_metrics_equals_gather"] = (
            record["gathered_for_metrics_count"] == out["gathered_count"]
            and (record.get("gathered_for_metrics") is None
                 or record["gathered_for_metrics"] == record.get("gathered")))
    out["ranks_same_order"] = (len(flat) > 1 and bool(flat[0])
                               and all(ids == flat[0] for ids in flat[1:]))
    if previous is None:
        out["order_changed"] = None
    else:
        before = [_flat(r["batches"]) for r in previous["ranks"]]
        out["order_changed"] = before != flat
    return out


def broken_promises(mode: str, trace: dict, epochs: list[dict]) -> list[str]:
    """What `--check` fails on: a sharded mode with missing samples or unequal step counts,
    a replicated one whose ranks did not each see everything."""
    n, kind = trace["dataset_size"], mode_kind(mode, trace)
    problems = []
    for e in epochs:
        tag = f"{mode} epoch {e['epoch']}"
        if kind == SHARDED:
            if e["missing"] and not (e["missing_reason"] == "drop-last" and e["missing_explained"]):
                problems.append(f"{tag}: {len(e['missing'])} sample(s) never seen: {_short(e['missing'])}")
            if not e["duplicates_explained"]:
                problems.append(f"{tag}: duplicates the loader's own padding does not explain")
            if not e["steps_equal"]:
                steps = [r["steps"] for r in e["ranks"]]
                problems.append(f"{tag}: ranks take unequal step counts {steps} (DDP would hang)")
        else:
            # With drop_last every rank still sees all the full batches, not the dropped tail.
            whole = kept_with_drop_last(mode, trace) if _opts(trace).get("drop_last") else n
            for r in e["ranks"]:
                ids = set(_flat(r["batches"]))
                if len(ids) < whole or not ids <= set(range(n)):
                    problems.append(f"{tag}: rank {r['rank']} did not see the whole dataset")
        if e["out_of_range"]:
            problems.append(f"{tag}: ids outside the dataset: {_short(e['out_of_range'])}")
        if e.get("gathered_matches_ranks") is False:
            problems.append(f"{tag}: accelerator.gather did not return what the ranks saw")
    return problems


VERDICTS = {
    "no-missing-samples": "every sample is seen each epoch (drop_last may drop less than a round)",
    "no-unexplained-duplicates": "samples repeat no more than the loader's own padding explains",
    "equal-step-counts": "every rank takes the same number of steps (else DDP hangs)",
    "order-changes-each-epoch": "a shuffled loader gives a new order each epoch (set_epoch)",
    "no-silent-replication": "ranks do not all receive the same, whole dataset",
    "every-rank-sees-everything": "each rank receives the whole dataset (--expect replicated)",
}


def audit_verdicts(trace: dict, epochs: list[dict]) -> list[dict]:
    """The audit's verdicts per epoch: [{"verdict", "epoch", "ok", "detail"}]."""
    n, w = trace["dataset_size"], trace["world_size"]
    expect = _expect(trace)
    out = []

    def add(name, epoch, ok, detail=""):
        out.append({"verdict": name, "epoch": epoch, "ok": bool(ok), "detail": detail})

    previous = None
    for e in epochs:
        k = e["epoch"]
        ok = not e["missing"] or (e["missing_reason"] == "drop-last" and e["missing_explained"])
        add("no-missing-samples", k, ok,
            "" if ok else f"{len(e['missing'])} never seen: {_short(e['missing'])}")
        if expect == "sharded":
            ok = e["duplicates_explained"]
            extra = e["seen"] - e["unique"]
            add("no-unexplained-duplicates", k, ok, "" if ok else
                f"{extra} repeats, more than the loader's padding explains")
        steps = [r["steps"] for r in e["ranks"]]
        add("equal-step-counts", k, e["steps_equal"],
            "" if e["steps_equal"] else f"steps per rank {steps}: DDP would hang")
        per_rank = [set(_flat(r["batches"])) for r in e["ranks"]]
        everyone = all(len(ids) >= n for ids in per_rank)
        if expect == "sharded":
            ok = w == 1 or not everyone
            add("no-silent-replication", k, ok, "" if ok else
                f"all {w} ranks received the whole dataset: the loader is not sharded")
        else:
            add("every-rank-sees-everything", k, everyone, "" if everyone else
                "ranks " + ", ".join(str(r) for r, ids in enumerate(per_rank) if len(ids) < n)
                + " did not receive the whole dataset")
        if previous is not None:
            flat = [_flat(r["batches"]) for r in e["ranks"]]
            before = [_flat(r["batches"]) for r in previous["ranks"]]
            shuffled = any(ids != sorted(ids) for ids in flat)
            ok = flat != before or not shuffled
            add("order-changes-each-epoch", k, ok, "" if ok else
                "the same shuffled order as the previous epoch: set_epoch is never called")
        previous = e
    return out


def conclude(mode: str, trace: dict, epochs: list[dict]) -> str:
    """One sentence in plain words, with the arithmetic stated."""
    n, b, w = trace["dataset_size"], trace["batch_size"], trace["world_size"]
    first = epochs[0]
    sums = f"(world size {w} x per-rank batch {b} = global batch {w * b})"
    seen = first["seen"]
    times = f"{first['times_dataset']:g}x"
    kind = mode_kind(mode, trace)
    dup = sum(d["count"] - 1 for d in first["duplicates"])
    if seen == 0:
        return (f"Every rank received nothing: no batch of this dataset of {n} is complete "
                f"(drop_last with per-rank batch {b} and {w} ranks), so no step is taken at all "
                f"{sums}.")
    if n < w:
        sums += f"; there are more ranks ({w}) than samples ({n})"
    if kind == REPLICATED:
        order = ("in the same order, so the ranks train on identical batches"
                 if first["ranks_same_order"] else "each in its own order")
        dropped = (f"; drop_last dropped {len(first['missing'])} on every rank"
                   if first["missing"] and first["missing_reason"] == "drop-last" else "")
        return (f"Every rank walked the whole dataset {order}: {seen} samples per epoch for "
                f"a dataset of {n} = {times} {sums}{dropped}; shard it with accelerator.prepare "
                "or a DistributedSampler.")
    if w == 1:
        text = (f"A single process (world size 1) walked all {seen} samples per epoch for a "
                f"dataset of {n} = {times}: nothing was sharded {sums}")
    else:
        text = (f"The {w} ranks split each epoch between them: {seen} samples per epoch for a "
                f"dataset of {n} = {times} {sums}")
    missing, why_missing = len(first["missing"]), first["missing_reason"]
    if missing and why_missing == "drop-last":
        text += f"; drop_last dropped {missing}"
    elif missing:
        why = f" ({REASON_LABEL[why_missing]})" if why_missing else " (no known reason)"
        text += f", but {missing} sample(s) were never seen{why}"
    if dup:
        text += f", {dup} extra (repeated) sample(s) ({REASON_LABEL[first['duplicates'][0]['reason']]})"
    if first.get("gather_for_metrics_exact") is not None:
        if first["gather_for_metrics_exact"]:
            text += "; gather_for_metrics returns exactly the dataset, use it for metrics"
        elif first["gather_for_metrics_equals_gather"] and why_missing == "drop-last":
            text += "; gather_for_metrics then equals gather (nothing to drop)"
        else:
            text += "; gather_for_metrics does NOT return exactly the dataset"
    if not first["steps_equal"]:
        text += f"; the ranks take {[r['steps'] for r in first['ranks']]} steps: DDP would hang"
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
        if mode == "audit":
            verdicts = audit_verdicts(trace, epochs)
            broken = [f"{v['verdict']} (epoch {v['epoch']}): {v['detail']}"
                      for v in verdicts if not v["ok"]]
        else:
            verdicts = None
            broken = broken_promises(mode, trace, epochs)
        problems += broken
        modes[mode] = {
            "description": data.get("description", ""),
            "kind": mode_kind(mode, trace),
            "prepared": data.get("prepared", False),
            "epochs": epochs,
            "broken_promises": broken,
            "conclusion": conclude(mode, trace, epochs),
        }
        if verdicts is not None:
            modes[mode]["verdicts"] = verdicts
    where = trace.get("placement") or [
        {"rank": r, "local_rank": r, "node": 0, "host": None} for r in range(trace["world_size"])]
    nodes: dict[str, list[int]] = {}
    for p in where:
        nodes.setdefault(str(p["node"]), []).append(p["rank"])
    for data in modes.values():
        for e in data["epochs"]:
            e["by_node"] = {node: sum(e["ranks"][r]["samples"] for r in ranks)
                            for node, ranks in nodes.items()}
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
        "source": trace.get("source", "toy"),
        "options": trace.get("options", {}),
        "config_file": config_file,
        "launch_command": launch_command,
        "placement": where,
        "nodes": nodes,
        "modes": modes,
        "broken_promises": problems,
    }
    if "timings" in trace:
        report["timings"] = trace["timings"]
    return report
