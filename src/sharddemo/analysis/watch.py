"""The watch's judgement, pure (no torch): an epoch's record from the ranks -> the report
entry that `sharddemo.watch` prints as one line and appends to its JSON-lines report
(docs/watch.md, docs/watch.schema.json). The same analysis as `audit` (build_report), plus
what only a watch knows: a resume from its checkpoint, and the epoch numbers of a real run.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from sharddemo.record import largest_id, loader_share

WATCH_SCHEMA = "sharddemo.watch/1"


def watch_trace(header: dict, *, name: str, role: str, description: dict, n: int,
                batch_size: Optional[int], records: list[dict]) -> dict:
    """A trace of one watched loader (`records`: the previous epoch's, for the order, and
    this one's), as a rank command would write it, for build_report."""
    world = header["world_size"]
    per_rank = batch_size or 1
    return {**header, "dataset_size": n, "batch_size": per_rank,
            "global_batch": per_rank * world, "epochs": len(records), "seed": 0,
            "options": {"audit": {"expect": "sharded"},
                        "drop_last": bool(description.get("drop_last"))},
            "modes": {"audit": {"description": name, "epochs": records,
                                "loader": description, "role": role,
                                "prepared": bool(description.get("prepared"))}}}


def judge_epoch(header: dict, record: dict, previous: Optional[dict], *, epoch: int, name: str,
                role: str, description: dict, n: Optional[int], batch_size: Optional[int],
                before: Optional[np.ndarray] = None, present: Optional[np.ndarray] = None,
                loaded: bool = False, unattributed: int = 0, partial: bool = False) -> dict:
    """The record of epoch `epoch` -> the watch's report entry, with its verdicts and line.

    `before`/`present`: how many ranks received each sample before a checkpoint's stop and
    after the restart (a resumed epoch); `loaded`: the first epoch after a checkpoint was
    loaded (its order is compared with the checkpoint's epoch); `unattributed`: batches whose
    indices were not noted. `partial`: the loop stopped before the epoch's end (see
    partial_entry)."""
    from sharddemo.analysis import build_report

    inferred = n is None  # a stream with no dataset_size: N from the ids it delivered
    n = n if n is not None else largest_id(record) + 1
    records = [r for r in (previous, record) if r is not None]
    # The order must change only where the loader is meant to shuffle (its sampler, or a
    # shuffled stream, says so): a loader not known to shuffle (workers interleaving a stream,
    # rows stored in any order) is never told it forgot set_epoch.
    description = {**description, "shuffled": bool(description.get("shuffled"))}
    trace = watch_trace(header, name=name, role=role, description=description, n=n,
                        batch_size=batch_size, records=records)
    report = build_report(trace)["modes"]["audit"]
    e = report["epochs"][-1]
    verdicts = [v for v in report["verdicts"] if v["epoch"] == epoch]
    resume = None
    if before is not None and present is not None:
        resume = resume_check(before, present, epoch)
        # the epoch is what came before the stop and after it: no-missing-samples of the
        # part after the restart alone would count the samples delivered before it
        verdicts = [v for v in verdicts if v["verdict"] != "no-missing-samples"]
        verdicts.append(resume.pop("verdict"))
    if loaded:  # the first epoch after a checkpoint was loaded
        for v in verdicts:
            if v["verdict"] == "order-changes-each-epoch" and not v["ok"]:
                v["detail"] = ("the same shuffled order as the epoch before the checkpoint: "
                               "the restarted loader counts its epochs from 0 again (call "
                               "set_epoch with the real epoch, or resume the loader's "
                               "state: use_stateful_dataloader)")
    failed = [v for v in verdicts if not v["ok"]]
    entry = {
        "schema": WATCH_SCHEMA, "loader": name, "epoch": epoch,
        "world_size": header["world_size"], "dataset_size": n,
        "deals": loader_share(description, n),
        "seen": e["seen"], "unique": e["unique"],
        "missing": {"count": e["missing_count"], "ids": e["missing"][:100],
                    "reason": e["missing_reason"]},
        "duplicated": {"count": e["duplicate_count"],
                       "ids": [d["id"] for d in e["duplicates"]][:100],
                       "reasons": sorted({d["reason"] for d in e["duplicates"]} - {None})},
        "steps": [r["steps"] for r in e["ranks"]],
        "order_changed": e["order_changed"],
        "verdicts": verdicts, "ok": not failed,
        "reasons": e["reasons"],
    }
    if resume is not None:
        entry["resume"] = resume
        entry["seen"] += resume["seen_before"]
        entry["unique"] = n - resume["skipped"]["count"]
        entry["missing"] = {"count": resume["skipped"]["count"],
                            "ids": resume["skipped"]["ids"], "reason": None}
    if unattributed:
        entry["unattributed_batches"] = unattributed
    if inferred:
        entry["dataset_size_inferred"] = True
    if partial:
        entry = partial_entry(entry)
    else:
        entry["line"] = watch_line(entry, failed)
    if inferred:
        entry["line"] += (f" [N = {n} inferred from the largest id seen: "
                          "watch(..., dataset_size=N) gives it]")
    return entry


# What a part of an epoch cannot show: which samples the epoch will miss (its rest has not come),
# its order against the previous epoch's (a part's order is not an epoch's), and whether an eval
# pass counts each sample once (the same: the rest is missing).
WHOLE_EPOCH_ONLY = ("no-missing-samples", "order-changes-each-epoch",
                    "eval-counts-each-sample-once")


def partial_entry(entry: dict) -> dict:
    """An epoch the loop stopped in (a `break`, max_steps, limit_train_batches; the run closed
    or the process ended): `"partial": true`, its steps and samples, and only the verdicts a
    part of an epoch supports. Never "missing": `missing` is null. The repeats a part can hold
    are judged as in a whole epoch (padding and accelerate's fill come only in a rank's last
    batch, so a part that holds them reached the loader's end and the same reasons apply)."""
    verdicts = [v for v in entry["verdicts"] if v["verdict"] not in WHOLE_EPOCH_ONLY]
    entry.update(partial=True, missing=None, order_changed=None, verdicts=verdicts,
                 ok=all(v["ok"] for v in verdicts))
    entry["line"] = partial_line(entry)
    return entry


# What the main process's own part shows without the other ranks' (main_only_entry).
NEEDS_THE_RANKS = ("equal-step-counts", "no-silent-replication")


def main_only_entry(entry: dict, world: int) -> dict:
    """A partial entry the main process wrote alone, where the ranks could no longer meet (the
    process ending): its own steps and samples, marked "ranks": "main-only", and only what
    one rank's part shows (a sample it received twice)."""
    verdicts = [v for v in entry["verdicts"] if v["verdict"] not in NEEDS_THE_RANKS]
    entry.update(world_size=world, ranks="main-only", verdicts=verdicts,
                 ok=all(v["ok"] for v in verdicts))
    entry["line"] = partial_line(entry)
    return entry


def partial_line(entry: dict) -> str:
    """sharddemo: epoch 0 train (partial): 160 samples, 160 distinct, across 2 ranks, 20 steps
    each: ok"""
    steps, world = entry["steps"], entry["world_size"]
    each = (f"{plural(steps[0], 'step')}{' each' if len(steps) > 1 else ''}"
            if len(set(steps)) == 1 else f"steps per rank {steps}")
    alone = entry.get("ranks") == "main-only"
    where = (f"on the main process alone of {world} ranks (the ranks could not meet)" if alone
             else f"across {plural(world, 'rank')}")
    text = (f"sharddemo: epoch {entry['epoch']} {entry['loader']} (partial): "
            f"{plural(entry['seen'], 'sample')}, {entry['unique']} distinct, {where}, {each}")
    failed = [v for v in entry["verdicts"] if not v["ok"]]
    if not failed:
        return text + ": ok"
    return text + ": FAIL " + "; ".join(f"{v['verdict']}: {v['detail']}" for v in failed)


def resume_check(before: np.ndarray, after: np.ndarray, epoch: int) -> dict:
    """A resumed epoch: the samples delivered both before the stop and after the restart
    (repeated) and in neither (skipped), from how many ranks received each in either part."""
    n = min(len(before), len(after))
    before, after = before[:n], after[:n]
    repeated = np.flatnonzero((before > 0) & (after > 0))
    skipped = np.flatnonzero((before == 0) & (after == 0))
    ok = not len(repeated) and not len(skipped)
    detail = "" if ok else (
        f"{len(repeated)} sample(s) delivered again after the restart and {len(skipped)} never: "
        "the resumed run did not continue where it stopped (no common seed, or the loader's "
        "position not restored; docs/resume.md)")
    return {"seen_before": int(np.count_nonzero(before)),
            "repeated": {"count": int(len(repeated)), "ids": repeated[:100].tolist()},
            "skipped": {"count": int(len(skipped)), "ids": skipped[:100].tolist()},
            "verdict": {"verdict": "resume-exact", "epoch": epoch, "ok": ok, "detail": detail}}


def plural(count: int, word: str, many: str = "") -> str:
    """'1 step', '5 steps' ('1 copy', '2 copies' with `many`)."""
    return f"{count:,} {word if count == 1 else (many or word + 's')}"


def watch_line(entry: dict, failed: list[dict]) -> str:
    """The entry's one line: what the ranks received, in calm words where every verdict held
    ('once and 1 again (DistributedSampler padding)', 'order changed: no'), with the failed
    verdicts after FAIL."""
    from sharddemo.analysis.reasons import REASON_LABEL

    n, world, deals = entry["dataset_size"], entry["world_size"], entry["deals"]
    steps = entry["steps"]
    each = (f"{plural(steps[0], 'step')} each" if len(set(steps)) == 1
            else f"steps per rank {steps}")
    again = entry["seen"] - entry["unique"]
    labels = [REASON_LABEL.get(r, r) for r in entry["duplicated"]["reasons"]]
    if not again:
        once = "once"
    elif failed:
        once = plural(again, "repeat")
    else:  # repeats the verdicts explain: the loader's own padding or fill
        once = f"once and {again:,} again" + (f" ({'; '.join(labels)})" if labels else "")
    order_failed = any(v["verdict"] == "order-changes-each-epoch" for v in failed)
    order = {True: "yes", False: "NO" if order_failed else "no",
             None: "-"}[entry["order_changed"]]
    part = f"{deals:,} (a part of {n:,})" if deals < n else f"{n:,}"
    resumed = entry.get("resume")
    if resumed:
        once = (f"{resumed['seen_before']:,} before the stop, {resumed['repeated']['count']:,} "
                f"repeated after the restart, {resumed['skipped']['count']:,} skipped")
    text = (f"sharddemo: epoch {entry['epoch']} {entry['loader']}: {entry['unique']:,} of {part} "
            f"{'sample' if n == 1 else 'samples'} {once} across {plural(world, 'rank')}, "
            f"{each}, order changed: {order}")
    missing = entry["missing"]
    if not failed and missing and missing["count"] and missing["reason"] == "ray-equal-split":
        # rows Ray's equal split drops by design: said, not an alarm
        text += f", missing: {missing['count']:,} ({REASON_LABEL['ray-equal-split']})"
    if not failed:
        return text + ": ok"
    details = "; ".join(f"{v['verdict']}: {v['detail']}" for v in failed)
    reasons = [REASON_LABEL.get(r, r) for r in
               [entry["missing"]["reason"], *entry["duplicated"]["reasons"]] if r]
    reasons = [r for r in dict.fromkeys(reasons) if r not in details]  # not said twice
    return text + ": FAIL " + details + (f" ({'; '.join(reasons)})" if reasons else "")
