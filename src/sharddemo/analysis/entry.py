"""The watch's judgement, pure (no torch): an epoch's record from the ranks -> the report
entry that `sharddemo.watch` prints as one line and appends to its JSON-lines report
(docs/watch.md, docs/watch.schema.json). The same analysis as `audit` (build_report), plus
what only a watch knows: a resume from its checkpoint (judged in analysis/entry_resume.py),
and the epoch numbers of a real run. The line's words are analysis/entry_line.py's; a window
of steps within the epoch is judged in analysis/entry_window.py.
"""

from __future__ import annotations

from typing import Optional, cast

import numpy as np

from sharddemo.analysis.idtext import MORE_REST, ids_text
from sharddemo.analysis.tokens import judge_tokens
from sharddemo.analysis.entry_line import partial_line, plural, watch_line
from sharddemo.analysis.entry_resume import (fill_ids, fill_source, replay_cause,
                                             restart_cause, judge_resume, unknown_resume)
from sharddemo.analysis.types import EpochRecord, LoaderDescription, Trace
from sharddemo.record import largest_id, loader_share
from sharddemo.mesh import explain_on_mesh, peer_verdict

WATCH_SCHEMA = "sharddemo.watch/1"


def watch_trace(header: dict, *, name: str, role: str, description: LoaderDescription, n: int,
                batch_size: Optional[int], records: list[EpochRecord],
                groups: bool = False) -> Trace:
    """A trace of one watched loader (`records`: the previous epoch's, for the order, and
    this one's), as a rank command would write it, for build_report. `groups`: the records'
    ranks are a mesh's data-parallel groups (one rank each)."""
    world = header["world_size"]
    per_rank = batch_size or 1
    return cast(Trace, {**header, "dataset_size": n, "batch_size": per_rank,
            "global_batch": per_rank * world, "epochs": len(records), "seed": 0,
            "options": {"audit": {"expect": "sharded"},
                        "drop_last": bool(description.get("drop_last"))},
            "modes": {"audit": {"description": name, "epochs": records,
                                "loader": description, "role": role,
                                "prepared": bool(description.get("prepared"))}},
            **({"groups": True} if groups else {})})


# A stream watched with no dataset_size has N inferred from its largest id. Where its ids are
# sparse (that number is past SPARSE_FROM and over 4 times the ids delivered: ids that begin at
# 2^31, hashes), an analysis over N would take memory in proportion to numbers no sample has,
# and could end the training it watches. Its ids are then numbered 0..K-1 in order for the
# analysis (K: the distinct ids of the epoch and the one before it) and named again in the
# entry (`dataset_size` is then K, and `sparse_ids` true); which samples the epoch missed is
# unknown without N, as the line says.
SPARSE_FROM = 1_000_000


def _sparse_names(records: list[dict], n: int) -> Optional[list[int]]:
    """The distinct ids of `records`, in order, where they are sparse under N = `n` (above);
    None where they are not."""
    if n <= SPARSE_FROM:
        return None
    names = sorted({i for rec in records for r in rec["ranks"] for b in r["batches"] for i in b})
    return names if n > 4 * len(names) else None


def _renumbered(record: dict, index: dict) -> dict:
    """An id record with every id replaced by its number in `index`."""
    gathered = record.get("gathered_for_metrics")
    return {**record,
            "ranks": [{**r, "batches": [[index[i] for i in b] for b in r["batches"]]}
                      for r in record["ranks"]],
            "gathered_for_metrics": (None if gathered is None
                                     else [index[i] for i in gathered])}


def judge_epoch(header: dict, record: dict, previous: Optional[dict], *, epoch: int, name: str,
                role: str, description: dict, n: Optional[int], batch_size: Optional[int],
                before: Optional[np.ndarray] = None, present: Optional[np.ndarray] = None,
                loaded: bool = False, unattributed: int = 0, partial: bool = False,
                id_field: object = None, restarts: Optional[list] = None,
                again: Optional[np.ndarray] = None, unknown_before: bool = False,
                mesh: Optional[dict] = None, peers: Optional[dict] = None,
                tokens: Optional[list] = None, weights: Optional[dict] = None,
                max_token_skew: Optional[float] = None, split_samples: int = 0,
                stream_restored: bool = False, sizes: Optional[list[int]] = None) -> dict:
    """The record of epoch `epoch` -> the watch's report entry, with its verdicts and line.

    On a mesh (`mesh`: sharddemo.mesh.MeshLayout.describe()), `record` holds one rank per
    data-parallel group (its first), numbered by group, and `header` their count; `peers` is
    sharddemo.mesh.first_peer_difference's finding (None: every peer received the same batches).
    `tokens`: each data-parallel group's token and source sums (watch's tokens= / sources=),
    judged by analysis.tokens with `weights` and `max_token_skew`.

    `before`/`present`: how many ranks received each sample before a checkpoint's stop and
    after the restart (a resumed epoch); `loaded`: the first epoch after a checkpoint was
    loaded (its order is compared with the checkpoint's epoch); `unattributed`: batches whose
    indices were not noted. `restarts`, `again`: the epoch's chain of restarts (judge_resume);
    `unknown_before`: resumed from a checkpoint without the watch's state, so the part before
    the stop is unknown: no missing verdict, the rest judged. `partial`: the loop stopped
    before the epoch's end (see partial_entry); a resumed part carries `resume` too, with the
    samples repeated so far and no `skipped` (the rest of the epoch may still come).
    `id_field`: where the ids are a batch's field (named where some fall outside 0..N-1: the
    verdict ids-in-range, listed only then). `split_samples`: samples of packed rows split
    across two consecutive rows of a rank, already counted once in `record` (the entry and the
    line say how many: docs/watch.md, "Packed rows"). `stream_restored`: an earlier epoch was
    resumed from the loader's own state over a datasets stream (a later epoch's missing samples
    may be that state applied again: named as a cause). `sizes`: each rank's dataset length
    (-1: none) where the ranks' differ, the epoch counted over 0..n-1 (the shortest): the
    verdict ranks-agree-on-dataset names them."""
    from sharddemo.analysis import build_report

    inferred = n is None  # a stream with no dataset_size: N from the ids it delivered
    n = n if n is not None else largest_id(record) + 1
    records = [r for r in (previous, record) if r is not None]
    names = (_sparse_names(records, n) if inferred and before is None and present is None
             else None)
    told_n = n
    if names is not None:  # sparse ids: numbered 0..K-1 for the analysis (SPARSE_FROM)
        index = {v: k for k, v in enumerate(names)}
        records = [_renumbered(r, index) for r in records]
        n = len(names)
    # The order must change only where the loader is meant to shuffle (its sampler, or a
    # shuffled stream, says so): a loader not known to shuffle (workers interleaving a stream,
    # rows stored in any order) is never told it forgot set_epoch.
    description = {**description, "shuffled": bool(description.get("shuffled"))}
    trace = watch_trace(header, name=name, role=role,
                        description=cast(LoaderDescription, description), n=n,
                        batch_size=batch_size, records=cast("list[EpochRecord]", records),
                        groups=mesh is not None)
    report = build_report(trace)["modes"]["audit"]
    e = report["epochs"][-1]
    verdicts = [v for v in report["verdicts"] if v["epoch"] == epoch]
    resume = None
    if unknown_before:  # (a chain that began with such a checkpoint: still unknown)
        resume = unknown_resume(epoch, restarts or [])
        # what came before the stop is unknown: which samples the epoch missed is too
        verdicts = [v for v in verdicts if v["verdict"] != "no-missing-samples"]
    elif (before is not None and present is not None and not before.any()
            and (again is None or not again.any())):
        # restarted before the epoch's first step (a save after the previous epoch, or after
        # its last step): nothing came before, the epoch is judged as any other
        resume = judge_resume(before, present, epoch, restarts, again)
        resume.pop("verdict")
        # (a part: the rest of the epoch may still come, so nothing is called skipped)
        resume["skipped"] = (None if partial else
                             {"count": e["missing_count"], "ids": e["missing"][:100]})
        resume["at_start"] = True
    elif before is not None and present is not None:
        last = (restarts or [{}])[-1]
        # where the loader restored its own state, it goes on after the steps taken before
        # the stop, as skip_first_batches(step) does
        skipped = last.get("skipped_batches") or (
            (last.get("step") or 0) if last.get("loader_state") else 0)
        fill = (fill_ids(record, description, n, batch_size, skipped)
                if loader_share(description, n) == n else None)
        # what drop_last leaves out of an uninterrupted epoch (under one global batch, as
        # explain_missing judges it) is no skip of the resume's
        drops = ((batch_size or 1) * header["world_size"] - 1
                 if description.get("drop_last") and loader_share(description, n) == n else 0)
        resume = judge_resume(before, present, epoch, restarts, again, fill,
                              fill_by=fill_source(description), partial=partial,
                              cause=restart_cause(description, epoch,
                                                  (restarts or [{}])[-1]), drops=drops)
        # the epoch is what came before the stop and after it: no-missing-samples of the
        # part after the restart alone would count the samples delivered before it
        verdicts = [v for v in verdicts if v["verdict"] != "no-missing-samples"]
        verdicts.append(resume.pop("verdict"))
    if loaded:  # the first epoch after a checkpoint was loaded
        for v in verdicts:
            if v["verdict"] == "order-changes-each-epoch" and not v["ok"]:
                v["detail"] = ("the same shuffled order as the epoch before the checkpoint: "
                               + replay_cause(description))
    if names is not None:
        # which samples the epoch missed is unknown without N; the ids in a detail are named
        verdicts = [v for v in verdicts if v["verdict"] != "no-missing-samples"]
        twice = [d["id"] for d in e["duplicates"]][:12]
        for v in verdicts:
            if twice and v["detail"] and f"ids {twice}" in v["detail"]:
                v["detail"] = v["detail"].replace(f"ids {twice}",
                                                  f"ids {[names[i] for i in twice]}")
    if stream_restored and resume is None:
        for v in verdicts:
            if v["verdict"] == "no-missing-samples" and not v["ok"]:
                v["detail"] += (" (a datasets stream restored from the loader's state goes on "
                                "from the restored position at every later epoch until "
                                "set_epoch(epoch) is called on the dataset: call it each "
                                "epoch, as datasets' own examples do; docs/resume.md)")
    if e["out_of_range"]:  # ids that number no sample: one finding, not a contradiction
        verdicts.append({"verdict": "ids-in-range", "epoch": epoch, "ok": False,
                         "detail": out_of_range_detail(sorted(e["out_of_range"]),
                                                       None if inferred else n, id_field)})
    if sizes is not None:  # (each rank's dataset length, where they differ: counted over `n`)
        ok, detail = sizes_agree(sizes, list(range(len(sizes))))
        verdicts.append({"verdict": "ranks-agree-on-dataset", "epoch": epoch, "ok": ok,
                         "detail": detail + (f"; counted over ids 0..{n - 1:,}, the shortest"
                                             if not ok else "")})
    if mesh is not None:
        verdicts.append(peer_verdict(mesh, peers, description, epoch))
        explain_on_mesh(verdicts, mesh, description)
    measured: dict = {}
    if tokens is not None:
        measured, more = judge_tokens(tokens, weights, max_token_skew, epoch)
        verdicts.extend(more)
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
    if resume is not None and resume.pop("at_start", False):
        entry["resume"] = resume
    elif resume is not None and resume.get("unknown_before"):
        entry["resume"] = resume
        entry["missing"] = None
    elif resume is not None:
        # the epoch's steps as the loop counts them over the chain: the main process's steps
        # before the last restart (its checkpoint's) and each rank's since; the part's own in
        # resume.steps_after
        resume["steps_after"] = entry["steps"]
        taken = (resume["restarts"][-1].get("step") or 0) if resume["restarts"] else 0
        entry["steps"] = [taken + s for s in entry["steps"]]
        entry["resume"] = resume
        entry["seen"] += resume["seen_before"]
        if partial:  # (no skipped: the samples of the chain so far, in any part)
            had, got = cast(np.ndarray, before), cast(np.ndarray, present)  # given when partial
            n_ = min(len(had), len(got))
            entry["unique"] = int(np.count_nonzero((had[:n_] > 0) | (got[:n_] > 0)))
        else:
            entry["unique"] = n - resume["skipped"]["count"]
            entry["missing"] = {"count": resume["skipped"]["count"],
                                "ids": resume["skipped"]["ids"],
                                "reason": resume["skipped"].get("reason")}
    entry.update(measured)
    if mesh is not None:
        entry["mesh"] = {**mesh, "peers_differ": peers}
        entry["world_size"] = mesh["world"]
    if unattributed:
        entry["unattributed_batches"] = unattributed
    if split_samples:
        entry["split_samples"] = split_samples
    if names is not None:
        entry["missing"] = None
        entry["sparse_ids"] = True
        entry["duplicated"]["ids"] = [names[i] for i in entry["duplicated"]["ids"]]
    if inferred:
        entry["dataset_size_inferred"] = True
    if partial:
        entry = partial_entry(entry)
    else:
        entry["line"] = watch_line(entry, failed)
    if names is not None:
        entry["line"] += (f" [N unknown: {len(names):,} distinct ids up to {told_n - 1:,}, too "
                          "sparse to take N from the largest; which samples were missed is not "
                          "judged: watch(..., dataset_size=N) gives it]")
    elif inferred and not partial:  # (a part's largest id says nothing of the stream's N)
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


def main_only_entry(entry: dict, world: int, why: str) -> dict:
    """A partial entry the main process wrote alone, where the ranks could no longer meet (the
    process ending): its own steps and samples, marked "ranks": "main-only", and only what
    one rank's part shows (a sample it received twice). `why`: what left the ranks apart
    ("close() was not called before the process's exit")."""
    verdicts = [v for v in entry["verdicts"] if v["verdict"] not in NEEDS_THE_RANKS]
    entry.update(world_size=world, ranks="main-only", alone_because=why, verdicts=verdicts,
                 ok=all(v["ok"] for v in verdicts))
    entry["line"] = partial_line(entry)
    return entry


def out_of_range_detail(outside: list[int], n: Optional[int], id_field: object = None) -> str:
    """The one finding for ids that cannot number a sample: outside 0..N-1 (negative, where N
    is not known)."""
    source = f"id_field {id_field!r}" if id_field is not None else "the loader"
    where = f"outside 0..{n - 1}" if n is not None else "below 0"
    shown = ids_text(outside, more=MORE_REST)
    return (f"{source} gave {plural(len(outside), 'id')} {where} ({shown}): the "
            "watch counts samples by ids 0..N-1 (dataset_size=N); these name no sample of the "
            "dataset")


def sizes_agree(sizes: list[int], named: list[int]) -> tuple[bool, str]:
    """Whether every rank's dataset has the same length (`sizes[r]`, -1: it has none), and
    where not, the detail naming each rank's (as `named[r]`)."""
    ok = len(set(sizes)) <= 1
    return ok, "" if ok else "the ranks' datasets differ in length: " + ", ".join(
        f"rank {named[r]} has {'no length' if size < 0 else f'{size:,}'}"
        for r, size in enumerate(sizes))
