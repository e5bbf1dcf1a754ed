"""The watch's judgement, pure (no torch): an epoch's record from the ranks -> the report
entry that `sharddemo.watch` prints as one line and appends to its JSON-lines report
(docs/watch.md, docs/watch.schema.json). The same analysis as `audit` (build_report), plus
what only a watch knows: a resume from its checkpoint, and the epoch numbers of a real run.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from sharddemo.analysis.idtext import MORE_REST, ids_text
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
                again: Optional[np.ndarray] = None, unknown_before: bool = False) -> dict:
    """The record of epoch `epoch` -> the watch's report entry, with its verdicts and line.

    `before`/`present`: how many ranks received each sample before a checkpoint's stop and
    after the restart (a resumed epoch); `loaded`: the first epoch after a checkpoint was
    loaded (its order is compared with the checkpoint's epoch); `unattributed`: batches whose
    indices were not noted. `restarts`, `again`: the epoch's chain of restarts (resume_check);
    `unknown_before`: resumed from a checkpoint without the watch's state, so the part before
    the stop is unknown: no missing verdict, the rest judged. `partial`: the loop stopped
    before the epoch's end (see partial_entry); a resumed part carries `resume` too, with the
    samples repeated so far and no `skipped` (the rest of the epoch may still come).
    `id_field`: where the ids are a batch's field (named where some fall outside 0..N-1: the
    verdict ids-in-range, listed only then)."""
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
    trace = watch_trace(header, name=name, role=role, description=description, n=n,
                        batch_size=batch_size, records=records)
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
        resume = resume_check(before, present, epoch, restarts, again)
        resume.pop("verdict")
        # (a part: the rest of the epoch may still come, so nothing is called skipped)
        resume["skipped"] = (None if partial else
                             {"count": e["missing_count"], "ids": e["missing"][:100]})
        resume["at_start"] = True
    elif before is not None and present is not None:
        skipped = ((restarts or [{}])[-1].get("skipped_batches") or 0)
        fill = (fill_ids(record, description, n, batch_size, skipped)
                if loader_share(description, n) == n else None)
        resume = resume_check(before, present, epoch, restarts, again, fill,
                              fill_by=fill_source(description), partial=partial,
                              cause=restart_cause(description, epoch,
                                                  (restarts or [{}])[-1]))
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
    if e["out_of_range"]:  # ids that number no sample: one finding, not a contradiction
        verdicts.append({"verdict": "ids-in-range", "epoch": epoch, "ok": False,
                         "detail": out_of_range_detail(sorted(e["out_of_range"]),
                                                       None if inferred else n, id_field)})
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
            n_ = min(len(before), len(present))
            entry["unique"] = int(np.count_nonzero((before[:n_] > 0) | (present[:n_] > 0)))
        else:
            entry["unique"] = n - resume["skipped"]["count"]
            entry["missing"] = {"count": resume["skipped"]["count"],
                                "ids": resume["skipped"]["ids"], "reason": None}
    if unattributed:
        entry["unattributed_batches"] = unattributed
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
            f"{plural(entry['seen'], 'sample')}, {entry['unique']:,} distinct, {where}, {each}")
    text += partial_resume_words(entry.get("resume"))
    failed = [v for v in entry["verdicts"] if not v["ok"]]
    if not failed:
        return text + ": ok"
    return text + ": FAIL " + "; ".join(f"{v['verdict']}: {v['detail']}" for v in failed)


def partial_resume_words(resumed: Optional[dict]) -> str:
    """What a part of a resumed epoch says of its resume: the deliveries before the stop and
    the samples repeated so far; never skipped or missing (the rest of the epoch may still
    come). '' where the part is not resumed."""
    if not resumed:
        return ""
    if resumed.get("unknown_before"):
        return ("; resumed: what came before the stop unknown (the checkpoint holds no state "
                "of the watch's), the part after the restart judged")
    restarts = resumed.get("restarts") or [{}]
    if not resumed["seen_before"] and not resumed["repeated"]["count"]:
        r = restarts[-1]
        return (f" (restarted before its first step: saved at epoch {r.get('epoch')} step "
                f"{r.get('step')}{', after its last step' if r.get('at_edge') else ''})")
    return (f": {resumed['seen_before']:,} before the stop, "
            f"{resumed['repeated']['count']:,} repeated so far after "
            f"{restarts_said(restarts)} (the rest of the epoch may still come: the samples "
            "not delivered yet are not judged)")


# why a resumed run does not continue where it stopped, where the loader's description names
# no mechanism: what must hold, not a guess at what the script did
RESTART_CAUSE = ("the loader's order and position were not restored: the launches must share "
                 "the seed and the epoch of what draws the order, or the loader keep its own "
                 "state; docs/resume.md")


def prepared_random_sampler(description: dict) -> bool:
    """accelerate prepared a loader over torch's RandomSampler (not its seedable one, not a
    stateful loader): each pass draws from a generator that accelerate synchronises across
    the ranks, and that takes no epoch."""
    classes = description.get("classes") or []
    return (bool(description.get("prepared")) and "RandomSampler" in classes
            and not description.get("seedable_sampler")
            and "StatefulDataLoader" not in classes)


def restart_cause(description: dict, epoch: int, last: Optional[dict] = None) -> str:
    """Why a resumed epoch repeats or skips samples (resume_check's `cause`), from what the
    restart did (`last`: the epoch's last restart) and what the loader is: never a cause the
    script may not have (a seed it set, a set_epoch it calls). A changed number of ranks, or a
    loop that skipped nothing of the steps taken before the stop, comes first: either alone
    repeats samples, whatever the order."""
    last = last or {}
    saved_on, resumed_on = last.get("saved_on"), last.get("resumed_on")
    if saved_on and resumed_on and saved_on != resumed_on:
        return (f"the restart changed the number of ranks ({saved_on} -> {resumed_on}): a "
                "position counted in batches of one world size is other samples at another; "
                "docs/resume.md")
    stateful = "StatefulDataLoader" in (description.get("classes") or [])
    if last.get("step") and not last.get("skipped_batches") and not stateful:
        return (f"the resumed loop skipped none of the {last['step']} steps taken before the "
                "stop (skip_first_batches, or a loader that keeps its own state, restores the "
                "position); docs/resume.md")
    if prepared_random_sampler(description):
        if epoch == 0:
            return ("accelerate's prepared RandomSampler draws each launch's order from its "
                    "generator: the launches did not deal the same order (accelerate's set_seed "
                    "before the loader is built makes them; docs/resume.md)")
        return (f"accelerate's prepared RandomSampler takes no epoch: a new launch deals a new "
                f"order, or with set_seed epoch 0's again, never epoch {epoch}'s "
                "(use_stateful_dataloader=True restores the position; docs/resume.md)")
    if description.get("distributed_sampler"):
        return (f"a DistributedSampler deals epoch {epoch}'s order in a new launch only with the "
                f"stopped run's seed and set_epoch({epoch}) before the pass; docs/resume.md")
    return RESTART_CAUSE


def replay_cause(description: dict) -> str:
    """Why the first epoch after a checkpoint deals the order of the epoch before it."""
    if prepared_random_sampler(description):
        return ("accelerate's prepared RandomSampler takes no epoch: with set_seed a new launch "
                "deals epoch 0's order again (use_stateful_dataloader=True restores the "
                "loader's state; use_seedable_sampler=True takes loader.set_epoch(epoch))")
    return ("the restarted loader counts its epochs from 0 again (set the epoch of what draws "
            "the order, e.g. set_epoch with the real epoch, or resume the loader's state: "
            "use_stateful_dataloader)")


# whose fill a restart's fill is where it does not say (saved before `by` was kept), and the
# default of resume_check
FILL_BY = "accelerate's even_batches"


def resume_check(before: np.ndarray, after: np.ndarray, epoch: int,
                 restarts: Optional[list] = None,
                 again: Optional[np.ndarray] = None,
                 fill: Optional[np.ndarray] = None,
                 fill_by: str = FILL_BY, partial: bool = False,
                 cause: str = RESTART_CAUSE) -> dict:
    """A resumed epoch: the samples delivered both before a stop and after its restart
    (repeated) and in no part (skipped), from how many ranks received each sample in each part.

    `before`: how many ranks received each sample in the parts before the last restart (a
    chain of restarts sums its parts); `after`: the part after the last restart; `restarts`:
    the epoch's restarts, oldest first, as the checkpoints carried them (each restart but the
    last with its own repeated samples, found when the next checkpoint was saved); `again`:
    the samples an earlier restart of the chain repeated (1), so that the epoch's total
    counts each repeated sample once; `fill`: the samples accelerate's even_batches fill or a
    DistributedSampler's padding dealt after the last restart (fill_ids; `fill_by` names which):
    delivered before the stop too, they are the loader's own fill, as in an uninterrupted run,
    not a repeat of the resume's. `partial`: the epoch is still a part (the loop stopped in
    it): `skipped` is None and only the repeats fail the verdict (a repeat is a fault as soon
    as it happens; a sample not delivered yet may still come). `cause`: why a resumed run does
    not continue where it stopped, as far as the loader's description tells (restart_cause).

    Two restarts, N = 8: before the first stop 0-3, then 2-5 (2 and 3 repeated), then 5-7 (5
    repeated): `before` counts 0-5 (2 and 3 twice), `again` marks 2 and 3, `after` is 5-7:
    repeated 2, 3, 5 (3 samples), skipped none, seen 4 + 4 + 3 = 11 before + after."""
    n = min(len(before), len(after))
    before, after = before[:n].astype(np.int64), after[:n]
    both = (before > 0) & (after > 0)
    filled = np.zeros(n, dtype=bool)
    if fill is not None and len(fill):
        filled[fill[(fill >= 0) & (fill < n)]] = True
    last = both & ~filled
    chain = last if again is None else last | (again[:n] > 0)
    repeated = np.flatnonzero(chain)
    skipped = np.flatnonzero((before == 0) & (after == 0))
    restarts = [dict(r) for r in restarts or []] or [restart(epoch, None, None, None)]
    restarts[-1]["seen_before"] = int(before.sum())
    restarts[-1]["repeated"] = id_list(np.flatnonzero(last))
    if (both & filled).any():
        restarts[-1]["fill"] = {**id_list(np.flatnonzero(both & filled)), "by": fill_by}
    # (a part: a sample not delivered yet may still come, so only the repeats count)
    ok = not len(repeated) and (partial or not len(skipped))
    detail = "" if ok else (
        f"{len(repeated)} sample(s) delivered again after "
        f"{'a restart' if len(restarts) > 1 else 'the restart'}"
        + (" so far" if partial else f" and {len(skipped)} never")
        + f": the resumed run did not continue where it stopped ({cause})")
    said = [r for r in restarts if r.get("from_start") or (
        r.get("saved_on") and r.get("resumed_on") and r["saved_on"] != r["resumed_on"])]
    if not ok and said:
        detail += "; " + "; ".join(restart_words(r) for r in said)
    return {"seen_before": int(before.sum()), "repeated": id_list(repeated),
            "skipped": None if partial else id_list(skipped), "restarts": restarts,
            "verdict": {"verdict": "resume-exact", "epoch": epoch, "ok": ok, "detail": detail}}


def out_of_range_detail(outside: list[int], n: Optional[int], id_field: object = None) -> str:
    """The one finding for ids that cannot number a sample: outside 0..N-1 (negative, where N
    is not known)."""
    source = f"id_field {id_field!r}" if id_field is not None else "the loader"
    where = f"outside 0..{n - 1}" if n is not None else "below 0"
    shown = ids_text(outside, more=MORE_REST)
    return (f"{source} gave {plural(len(outside), 'id')} {where} ({shown}): the "
            "watch counts samples by ids 0..N-1 (dataset_size=N); these name no sample of the "
            "dataset")


def fill_ids(record: dict, description: dict, n: int, batch_size: Optional[int],
             skipped: int) -> np.ndarray:
    """The samples accelerate's even_batches fill dealt in the part of an epoch after a restart
    (each rank's last batch, where it lies past the epoch's K = ceil(N/B) global batches, and
    the completion of the short batch K-1), from the ranks' last batches in the record.

    Rank r's j-th batch of the epoch is global batch j*W + r (BatchSamplerShard deals them
    round-robin); a rank that skipped `skipped` batches (skip_first_batches) and then took s
    steps ended at batch skipped + s - 1. N = 80, B = 4, W = 3: K = 20, rank 2 ends at batch
    6, global 20: its last batch is fill (the first 4 samples of the epoch's order)."""
    if pads_as_distributed_sampler(description):
        return padding_ids(record, description, n, batch_size, skipped)
    shard = description.get("batch_sampler_shard") or description.get("dispatcher")
    if (not shard or description.get("even_batches") is False or description.get("drop_last")
            or description.get("split_batches") or not batch_size):
        return np.zeros(0, dtype=np.int64)
    ranks = record.get("ranks") or []
    world, k, rest = len(ranks), -(-n // batch_size), n % batch_size
    out: list = []
    for r, rank in enumerate(ranks):
        batches = rank.get("tail") or rank.get("head") or []
        if not rank.get("steps") or not batches:
            continue
        last = list(batches[-1])
        at = (skipped + rank["steps"] - 1) * world + r
        if at >= k:
            out += last
        elif at == k - 1 and rest:
            out += last[rest:]
    return np.unique(np.asarray(out, dtype=np.int64))


def padding_ids(record: dict, description: dict, n: int, batch_size: Optional[int],
                skipped: int) -> np.ndarray:
    """The samples a DistributedSampler's padding dealt in the part of an epoch after a
    restart, from the ranks' last batches in the record: the sampler pads its order to
    ceil(N/W) x W ids by repeating its first ones, and rank r takes positions r, r + W, ...,
    so rank r's p-th sample is position p*W + r, padding from position N on. A rank that
    skipped `skipped` batches of B and then took s steps began its last batch at its sample
    (skipped + s - 1) * B. N = 79, B = 4, W = 2: 40 samples a rank, rank 1's 40th (its last
    batch's 4th) is position 79, the padding (the order's first sample again)."""
    if description.get("drop_last") or not batch_size:
        return np.zeros(0, dtype=np.int64)
    ranks = record.get("ranks") or []
    world, out = len(ranks), []
    for r, rank in enumerate(ranks):
        batches = rank.get("tail") or rank.get("head") or []
        if not rank.get("steps") or not batches:
            continue
        start = (skipped + rank["steps"] - 1) * batch_size
        out += [i for k, i in enumerate(batches[-1]) if (start + k) * world + r >= n]
    return np.unique(np.asarray(out, dtype=np.int64))


def pads_as_distributed_sampler(description: dict) -> bool:
    """Whether a rank's fill is a DistributedSampler's padding (a sampler of its own, not
    sharded again by accelerate), not accelerate's even_batches fill."""
    shard = description.get("batch_sampler_shard") or description.get("dispatcher")
    return bool(not shard and description.get("distributed_sampler")
                and not description.get("iterable_shard"))


def fill_source(description: dict) -> str:
    """Whose fill fill_ids reads, in words."""
    return "the DistributedSampler's padding" if pads_as_distributed_sampler(description) \
        else FILL_BY


def id_list(ids: np.ndarray) -> dict:
    return {"count": int(len(ids)), "ids": ids[:100].tolist()}


def restart(epoch: int, step: Optional[int], saved_on: Optional[int],
            resumed_on: Optional[int], at_edge: bool = False) -> dict:
    """One restart of a chain, as the report keeps it: the epoch and the step (of the main
    process, in the epoch, over the whole chain) where the checkpoint was saved, on how many
    ranks it was saved and resumed; `at_edge`: saved after the epoch's last step (the run
    resumes with the next epoch). `seen_before` and `repeated` are filled as the epoch goes on
    (resume_check); `skipped_batches`, by the resumed loader (skip_first_batches)."""
    out = {"epoch": epoch, "step": step, "saved_on": saved_on, "resumed_on": resumed_on,
           "seen_before": None, "repeated": None, "skipped_batches": None}
    if at_edge:
        out["at_edge"] = True
    return out


def restart_words(r: dict) -> str:
    """'saved at epoch 0 step 3 on 2 ranks (24 samples delivered), resumed on 3:
    skip_first_batches(3) skipped 3 batches on each of 3 ranks, 36 samples at the new size'."""
    before = r.get("seen_before")
    text = (f"saved at epoch {r['epoch']} step {r['step']} on "
            f"{plural(r['saved_on'] or 0, 'rank')}"
            f"{f' ({before:,} samples delivered)' if before is not None else ''}, resumed on "
            f"{r['resumed_on']}")
    if r.get("at_edge"):
        text += " (after the epoch's last step: the run went on with the next epoch)"
    skipped = r.get("skipped_batches")
    if skipped and r.get("batch_size") and r.get("resumed_on"):
        skipped_samples = skipped * r["resumed_on"] * r["batch_size"]
        text += (f": skip_first_batches({skipped}) skipped {skipped} batches on each of "
                 f"{plural(r['resumed_on'], 'rank')}, {skipped_samples:,} samples at the new "
                 "size")
    start = r.get("from_start")
    if start:
        left, total = start["epoch_steps"] - start["steps_before"], start["epoch_steps"]
        text += (f": {start['by']} began the epoch's order again from its start (the "
                 "DataLoader has no state_dict: its position was not restored) while counting "
                 f"on from step {start['steps_before']} of the epoch's {total} per rank: the "
                 f"batches after the restart (at most {left} per rank) are the order's first "
                 "ones again, and those past them never come")
    if r.get("fill"):
        count = r["fill"]["count"]
        text += (f"; {plural(count, 'sample')} delivered again {'is' if count == 1 else 'are'}"
                 f" the resumed size's own fill ({r['fill'].get('by', FILL_BY)}), not counted "
                 "as repeated")
    return text


def unknown_resume(epoch: int, restarts: list) -> dict:
    """A resume from a checkpoint that holds no state of the watch's (saved before the watch
    was added): the part before the stop is unknown; the rest is judged."""
    return {"seen_before": None, "repeated": None, "skipped": None, "unknown_before": True,
            "restarts": [dict(r) for r in restarts]}


def plural(count: int, word: str, many: str = "") -> str:
    """'1 step', '5 steps' ('1 copy', '2 copies' with `many`)."""
    return f"{count:,} {word if count == 1 else (many or word + 's')}"


def restarts_said(restarts: list) -> str:
    """'the restart' (one, on as many ranks as it was saved on), else each restart in order:
    'the restarts at epoch 0 step 3 (2 ranks, 5 repeated), epoch 1 step 4 (2 -> 3 ranks, 4
    repeated)'."""
    if len(restarts) <= 1 and not any(r.get("saved_on") != r.get("resumed_on")
                                     or r.get("at_edge") for r in restarts):
        return "the restart"
    said = []
    for r in restarts:
        ranks = (f"{r['saved_on']} -> {plural(r['resumed_on'] or 0, 'rank')}"
                 if r.get("saved_on") and r["saved_on"] != r.get("resumed_on")
                 else plural(r.get("resumed_on") or 0, "rank"))
        edge = ", after the epoch's last step" if r.get("at_edge") else ""
        again = r.get("repeated")
        count = f", {again['count']:,} repeated" if again is not None else ""
        if r.get("fill"):
            count += f", {r['fill']['count']:,} of the fill ({r['fill'].get('by', FILL_BY)})"
        said.append(f"epoch {r['epoch']} step {r['step']} ({ranks}{edge}{count})")
    return f"the restart{'s' if len(said) > 1 else ''} at " + ", ".join(said)


# the verdicts about which samples the ranks received, and how often: a failed one may be
# explained in part by the loader's padding or fill, which the line then names
COUNT_VERDICTS = frozenset({"no-missing-samples", "no-unexplained-duplicates",
                            "no-silent-replication", "every-rank-sees-everything",
                            "eval-counts-each-sample-once", "resume-exact"})


def watch_line(entry: dict, failed: list[dict]) -> str:
    """The entry's one line: what the ranks received, in calm words where every verdict held
    ('and 1 again (DistributedSampler padding)', 'order changed: no'), with the failed
    verdicts after FAIL."""
    from sharddemo.analysis.reasons import REASON_LABEL

    n, world, deals = entry["dataset_size"], entry["world_size"], entry["deals"]
    steps = entry["steps"]
    each = (f"{plural(steps[0], 'step')} each" if len(set(steps)) == 1
            else f"steps per rank {steps}")
    again = entry["seen"] - entry["unique"]
    labels = [REASON_LABEL.get(r, r) for r in entry["duplicated"]["reasons"]]
    # the loader's padding or fill is named beside a failed verdict about the counts, which it
    # may explain in part, never beside one it has nothing to do with (the order)
    counts_failed = any(v["verdict"] in COUNT_VERDICTS for v in failed)
    if not again:
        once = "once"
    elif counts_failed:
        once = ", " + plural(again, "repeat")
    else:  # repeats the verdicts explain: the loader's own padding, fill or draws (`again`
        # deliveries more than the distinct samples: not "N once", which some came more than)
        once = f"and {again:,} again" + (f" ({'; '.join(labels)})" if labels else "")
    order_failed = any(v["verdict"] == "order-changes-each-epoch" for v in failed)
    order = {True: "yes", False: "NO" if order_failed else "no",
             None: "-"}[entry["order_changed"]]
    part = f"{deals:,} (a part of {n:,})" if deals < n else f"{n:,}"
    resumed = entry.get("resume")
    if resumed and resumed.get("unknown_before"):
        once = (f": {plural(entry['seen'], 'sample')} after the restart, what came before the "
                "stop unknown (the checkpoint holds no state of the watch's: no missing "
                "verdict)")
    elif resumed and not resumed["seen_before"]:
        r = (resumed.get("restarts") or [{}])[-1]
        once += (f" (restarted before its first step: saved at epoch {r.get('epoch')} step "
                 f"{r.get('step')}{', after its last step' if r.get('at_edge') else ''})")
    elif resumed:
        once = (f": {resumed['seen_before']:,} before the stop, {resumed['repeated']['count']:,} "
                f"repeated after {restarts_said(resumed.get('restarts') or [])}, "
                f"{resumed['skipped']['count']:,} skipped")
    text = (f"sharddemo: epoch {entry['epoch']} {entry['loader']}: {entry['unique']:,} of {part} "
            f"{'sample' if n == 1 else 'samples'}{'' if once[0] in ',:' else ' '}{once} across "
            f"{plural(world, 'rank')}, "
            f"{each}, order changed: {order}")
    missing = entry["missing"]
    if not failed and missing and missing["count"] and missing["reason"] == "ray-equal-split":
        # rows Ray's equal split drops by design: said, not an alarm, in the reason's own
        # sentence (with iter_torch_batches(drop_last=True) it names the short last batches
        # too, which the bare label does not: the line would put them on the split)
        said = (entry.get("reasons") or {}).get("ray-equal-split") or REASON_LABEL[
            "ray-equal-split"]
        text += f", missing: {missing['count']:,} ({said})"
    if not failed:
        return text + ": ok"
    details = "; ".join(f"{v['verdict']}: {v['detail']}" for v in failed)
    reasons = [REASON_LABEL.get(r, r) for r in
               [(entry["missing"] or {}).get("reason"), *entry["duplicated"]["reasons"]]
               if r and counts_failed]
    reasons = [r for r in dict.fromkeys(reasons) if r not in details]  # not said twice
    return text + ": FAIL " + details + (f" ({'; '.join(reasons)})" if reasons else "")
