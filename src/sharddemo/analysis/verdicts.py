"""The verdicts of an epoch's analysis, and its conclusion in plain words.

What `--check` fails on (broken_promises), the audit's named verdicts, and the one-sentence
conclusion in plain words."""

from __future__ import annotations

from typing import Optional, cast

from sharddemo.analysis.idtext import ids_text
from sharddemo.analysis.modes import REPLICATED, SHARDED, expect, global_batch, mode_kind
from sharddemo.analysis.reasons import REASON_LABEL, loader_pads, missing_ok, not_its_data
from sharddemo.analysis.types import LoaderDescription, Trace

def replicated_ok(e: dict) -> bool:
    """Say whether every rank saw every sample the loader kept.

    drop_last may keep fewer than N, the same ones on every rank."""
    samples = [r["samples"] for r in e["ranks"]]
    # drop_last can keep nothing at all (N < B): then every rank saw all of nothing.
    return missing_ok(e) and e["same_ids_on_every_rank"] and (samples[0] > 0 or not any(samples))


def broken_promises(mode: str, trace: Trace, epochs: list[dict]) -> list[str]:
    """List what `--check` fails on.

    A sharded mode with missing samples or unequal step counts, a replicated one whose ranks did
    not each see everything."""
    kind = mode_kind(mode, trace)
    # on a mesh the trace is over the data-parallel groups (analysis.mesh.groups_trace)
    who = "the data-parallel groups" if trace.get("groups") else "the ranks"
    problems = []
    for e in epochs:
        tag = f"{mode} epoch {e['epoch']}"
        if kind == SHARDED:
            if not missing_ok(e):
                problems.append(f"{tag}: {e['missing_count']} sample(s) never seen: "
                                f"{_missing(e)}")
            copies = sorted({d["reason"] for d in e["duplicates"]} & {
                "replication", "stream-replication"})
            if not e["duplicates_explained"] and copies:
                problems.append(f"{tag}: {who} did not split the data: samples arrived "
                                f"{_most_copies(e)} ("
                                + " and ".join(REASON_LABEL[c] for c in copies) + ")")
            elif not e["duplicates_explained"]:
                problems.append(f"{tag}: duplicates the loader's own padding does not explain")
            if not e["steps_equal"]:
                steps = [r["steps"] for r in e["ranks"]]
                problems.append(f"{tag}: ranks take unequal step counts {steps} (DDP would hang)")
        elif not replicated_ok(e):
            # With drop_last every rank still sees all the full batches, not the dropped tail.
            problems.append(f"{tag}: {who} did not each see the whole dataset (less what "
                            "drop_last drops)")
        if any(d["reason"] == "worker-replication" for d in e["duplicates"]):
            # (with dispatch_batches the workers are rank 0's, whose loader feeds every rank)
            problems.append(f"{tag}: the DataLoader workers each yielded the whole stream "
                            f"(worker replication): samples arrived {_most_copies(e)}")
        if e["out_of_range"]:
            outside = ids_text(e["out_of_range"], brackets=True)
            problems.append(f"{tag}: ids outside the dataset: {outside}")
    return problems


def _raised_where(raised: list[dict]) -> str:
    """`at epoch 0, step 0 (its first batch)`, or each rank's step where they differ."""
    epoch = raised[0]["epoch"]
    steps = [r["step"] for r in raised]
    if len(set(steps)) == 1:
        first = " (its first batch)" if steps[0] == 0 else ""
        return f"at epoch {epoch}, step {steps[0]}{first}"
    return f"in epoch {epoch} (" + ", ".join(f"rank {r['rank']} at step {r['step']}"
                                            for r in raised) + ")"


def _raised_error(raised: list[dict]) -> str:
    """The error, once where every rank said the same, else each rank's."""
    errors = [r["error"] for r in raised]
    if len(set(errors)) == 1:
        return errors[0]
    return "; ".join(f"rank {r['rank']}: {r['error']}" for r in raised)


def _library(raised: list[dict]) -> str:
    tops = {(r.get("frame") or "").split(".")[0].split(":")[0] for r in raised} - {""}
    return f"inside {', '.join(sorted(tops))}" if tops else "inside a library"


def raised_sentence(raised: list[dict], world: int) -> str:
    """Say in one sentence where a loader raised inside a library on every rank, and why.

    Raised on every rank (rank.walk.settle): where, and the error with its cause (or the library
    frame it came from)."""
    ranks = "every rank" if len(raised) == world else f"{len(raised)} of {world} ranks"
    return (f"The loader raised {_library(raised)} on {ranks} {_raised_where(raised)}, where "
            f"the walk stopped: {_raised_error(raised)}.")


def raised_promise(mode: str, raised: list[dict]) -> str:
    """What `--check` names: the mode, the epoch, the error."""
    return (f"{mode} epoch {raised[0]['epoch']}: the loader raised {_library(raised)} on every "
            f"rank {_raised_where(raised)}: {_raised_error(raised)}")


def raised_verdict(raised: list[dict]) -> dict:
    """The audit's failed verdict for a loader that raised inside a library on every rank."""
    return {"verdict": "loader-runs-every-epoch", "epoch": raised[0]["epoch"], "ok": False,
            "detail": f"raised {_library(raised)} on every rank {_raised_where(raised)}: "
                      f"{_raised_error(raised)}"}


def eval_verdict(e: dict, prepared: bool, n: int) -> tuple[bool, str]:
    """Say whether an eval loader's metrics count each of the N samples once.

    A prepared loader's metrics go through gather_for_metrics, which drops accelerate's fill;
    any other loader's metrics are averaged over exactly what the ranks received."""
    extra = e["seen"] - e["unique"]
    if prepared and e.get("gather_for_metrics_exact") is not None:
        if e["gather_for_metrics_exact"]:
            return True, ""
        if e["missing_count"]:
            why = " (drop_last)" if e["missing_reason"] == "drop-last" else ""
            return False, (f"{e['missing_count']} of {n} eval samples are never evaluated{why}: "
                           f"{_missing(e)}")
        return False, f"gather_for_metrics returns {e['gathered_for_metrics_count']} ids, not {n}"
    # an eval loader over a Subset (random_split's validation part) evaluates its own data
    lost = e["missing_count"] and not (e["missing_reason"] == "subset"
                                       and e["missing_explained"])
    if not lost and not extra:
        return True, ""
    parts = []
    if lost:
        why = " (drop_last)" if e["missing_reason"] == "drop-last" else ""
        parts.append(f"{e['missing_count']} of {n} eval samples are never evaluated{why}")
    if extra:
        reason = e["duplicates"][0]["reason"] if e["duplicates"] else None
        label = f" ({REASON_LABEL[reason]})" if reason in REASON_LABEL else ""
        twice = [d["id"] for d in e["duplicates"]][:12]
        parts.append(f"{extra} eval sample(s) are evaluated more than once{label}, ids {twice}: "
                     "metrics averaged over the ranks count them again (validate on one "
                     "device, make N divisible by the world size, or drop the copies)")
    return False, "; ".join(parts)


def audit_verdicts(trace: Trace, epochs: list[dict], role: str = "train",
                   prepared: bool = False, loader: Optional[LoaderDescription] = None,
                   set_epoch_called: bool = False) -> list[dict]:
    """Return the audit's verdicts per epoch: [{"verdict", "epoch", "ok", "detail"}].

    An eval loader (role "eval") also gets eval-counts-each-sample-once. `loader`: its
    description (rank.describe.describe_loader), whose `shuffled` says whether a new order is
    due each epoch. `set_epoch_called`: the walk called set_epoch before each epoch, as the loop
    does."""
    w = trace["world_size"]
    promised = expect(trace)
    # on a mesh the ranks here are its data-parallel groups (one rank each)
    ranks, rank = (("groups", "group") if trace.get("groups") else ("ranks", "rank"))
    out = []

    def add(name, epoch, ok, detail=""):
        out.append({"verdict": name, "epoch": epoch, "ok": bool(ok), "detail": detail})

    previous = None
    for e in epochs:
        k = e["epoch"]
        ok = missing_ok(e)
        outside = not_its_data(e, loader, trace["dataset_size"])
        lost = (f"{e['missing_count'] - outside} of the {trace['dataset_size'] - outside} "
                f"samples it deals never seen (and {outside} not its data)" if outside
                else f"{e['missing_count']} never seen")
        add("no-missing-samples", k, ok, "" if ok else
            f"{lost}: {_missing(e)}")
        if promised == "sharded":
            ok = e["duplicates_explained"]
            extra = e["seen"] - e["unique"]
            repeats = f"{extra:,} repeat{'' if extra == 1 else 's'}"
            # padding named only where the loader pads (not a loader every rank reads whole)
            add("no-unexplained-duplicates", k, ok, "" if ok else
                f"{repeats}, more than the loader's padding explains" if loader_pads(loader)
                else f"{repeats}, none explained: the loader does not pad")
        steps = [r["steps"] for r in e["ranks"]]
        add("equal-step-counts", k, e["steps_equal"],
            "" if e["steps_equal"] else f"steps per rank {steps}: DDP would hang")
        if promised == "sharded":
            ok = w == 1 or not copies_across_ranks(e)
            # every rank the same set of ids (a sampler's own repeats within a rank included)
            same = e["same_ids_on_every_rank"]
            add("no-silent-replication", k, ok, "" if ok else
                f"all {w} {ranks} received the same samples: the loader is not sharded" if same
                else _shared_deliveries(e, rank) + ": the loader is not sharded")
        else:
            ok = replicated_ok(e)
            short = [r["rank"] for r in e["ranks"] if r["samples"] < max(x["samples"] for x in e["ranks"])]
            add("every-rank-sees-everything", k, ok, "" if ok else
                f"the {ranks} did not each receive the whole dataset (less what drop_last "
                "drops)" + (f": {ranks} {', '.join(map(str, short))} received fewer"
                            if short else ""))
        if role == "eval":
            ok, detail = eval_verdict(e, prepared, trace["dataset_size"])
            add("eval-counts-each-sample-once", k, ok, detail)
        if previous is not None:
            # The sampler's own word where it has one: the padding or fill that wraps an
            # unshuffled walk back to its first ids makes its ids decrease once.
            shuffled = (loader or {}).get("shuffled")
            if shuffled is None:
                shuffled = not all(r["ascending"] for r in e["ranks"])
            ok = bool(e["order_changed"]) or not shuffled
            add("order-changes-each-epoch", k, ok, "" if ok else
                "the same shuffled order as the previous epoch, although set_epoch was called "
                "before each epoch as the training loop does: the call does not reach what "
                "draws the order (a sampler or batch sampler of its own needs its own "
                "set_epoch call)" if set_epoch_called else
                "the same shuffled order as the previous epoch: set_epoch is never called")
        previous = e
    return out


def _shared_deliveries(e: dict, rank: str) -> str:
    """'26 of the 320 deliveries are samples another rank received too': the copies past a
    sample's first that reached another rank (a rank's own repeats not counted)."""
    return (f"{e['copies_on_other_ranks']:,} of the {e['seen']:,} deliveries are samples "
            f"another {rank} received too")


def copies_across_ranks(e: dict) -> set:
    """Return the reasons an epoch gives for samples that reached several ranks.

    Replication, a stream every rank read: its duplicates' reasons and per-id causes, and the
    epoch's own reasons (the count path keeps no per-id causes: a stream's codes are the
    epoch's)."""
    said = set(e.get("reasons") or {})
    for d in e["duplicates"]:
        said |= {d["reason"], *d.get("causes", [])}
    return said & {"replication", "stream-replication"}


def _most_copies(e: dict) -> str:
    """Return "up to K times", K the most copies of one sample in the epoch.

    "at least" where the count path could only bound it (a rank repeated more ids than it
    lists)."""
    return f"up to {'' if e['most_copies_exact'] else 'at least '}{e['most_copies']} times"


def conclude(mode: str, trace: Trace, epochs: list[dict],
             loader: Optional[LoaderDescription] = None) -> str:
    """Return one sentence in plain words, with the arithmetic stated.

    `loader`: its description (rank.describe.describe_loader), where it deals only part of the
    data."""
    n, w = trace["dataset_size"], trace["world_size"]
    g = global_batch(trace)
    b = g // max(w, 1)
    first = epochs[0]
    # on a device mesh the counts are over its data-parallel groups (analysis.mesh)
    ranks = "data-parallel groups" if trace.get("groups") else "ranks"
    sums = (f"({w} data-parallel groups x per-rank batch {b} = global batch {g})"
            if trace.get("groups") else f"(world size {w} x per-rank batch {b} = global batch {g})")
    seen = first["seen"]
    times = f"{first['times_dataset']:g}x"
    kind = mode_kind(mode, trace)
    # every copy past a sample's first (its duplicates list may be capped; these totals not)
    dup = seen - first["unique"]
    if seen == 0:
        why = (f"no batch of this dataset of {n} is complete (drop_last with per-rank batch "
               f"{b} and {w} ranks)" if first["missing_reason"] == "drop-last"
               else f"the loader yielded no sample of this dataset of {n}")
        return f"Every {ranks[:-1]} received nothing: {why}, so no step is taken at all {sums}."
    if n < w:
        sums += f"; there are more ranks ({w}) than samples ({n})"
    if kind == REPLICATED:
        order = (f"in the same order, so the {ranks} train on identical batches"
                 if first["ranks_same_order"] else "each in its own order")
        dropped = (f"; drop_last dropped {first['missing_count']} on every rank"
                   if first["missing"] and first["missing_reason"] == "drop-last" else "")
        workers = ""
        if any(d["reason"] == "worker-replication" for d in first["duplicates"]):
            workers = (f"; worse, each rank's DataLoader workers each yielded the whole stream, "
                       f"so samples arrived {_most_copies(first)} "
                       f"({REASON_LABEL['worker-replication']})")
        every = "Every data-parallel group" if trace.get("groups") else "Every rank"
        return (f"{every} walked the whole dataset {order}: {seen} samples per epoch for "
                f"a dataset of {n} = {times} {sums}{dropped}{workers}; shard it with "
                "accelerator.prepare or a DistributedSampler.")
    copies = {d["reason"] for d in first["duplicates"]} & {
        "replication", "worker-replication", "stream-replication"}
    if w == 1 and trace.get("groups"):
        text = (f"The mesh has one data-parallel group (no data dim), so every rank walked all "
                f"{seen} samples per epoch for a dataset of {n} = {times}: nothing was split "
                f"{sums}")
    elif w == 1:
        text = (f"A single process (world size 1) walked all {seen} samples per epoch for a "
                f"dataset of {n} = {times}: nothing was sharded {sums}")
    elif ((loader or {}).get("draws") or {}).get("replacement") and not copies:
        draws = cast(dict, loader)["draws"]
        text = (f"The {w} {ranks} drew {seen} samples per epoch between them for a dataset of "
                f"{n} = {times} {sums}, with replacement ({draws['sampler']})")
        if draws["count"] and w > 1 and seen >= draws["count"] + w * b:
            text += (f"; each {ranks[:-1]} drew its own {draws['count']} (num_samples) from the "
                     f"whole dataset: the sampler is not split over the {ranks}, so an epoch "
                     f"is {w} draws")
    elif copies == {"worker-replication"} and not copies_across_ranks(first):
        # the ranks split the stream; within each, every worker yielded its share
        text = (f"The {w} {ranks} split each epoch between them, but within each rank every "
                f"DataLoader worker yielded the rank's whole share: {seen} samples per epoch "
                f"for a dataset of {n} = {times} {sums}, samples received "
                f"{_most_copies(first)} ({REASON_LABEL['worker-replication']})")
    elif copies:
        why = " and ".join(REASON_LABEL[c] for c in sorted(copies))
        text = (f"The {w} {ranks} did NOT split the epoch: {seen} samples per epoch for a dataset "
                f"of {n} = {times} {sums}, samples received {_most_copies(first)} ({why})")
    else:
        text = (f"The {w} {ranks} split each epoch between them: {seen} samples per epoch for a "
                f"dataset of {n} = {times} {sums}")
    missing, why_missing = first["missing_count"], first["missing_reason"]
    if missing and why_missing == "drop-last":
        text += f"; drop_last dropped {missing}"
    elif missing and why_missing in ("subset", "sampler-draws") and first["missing_explained"]:
        text += (f"; {missing} sample(s) are not its data" if why_missing == "subset"
                 else f"; {missing} sample(s) were not drawn") + f" ({REASON_LABEL[why_missing]})"
    elif missing:
        outside = not_its_data(first, loader, n)
        # (a subset that does not explain them all explains only the samples outside it)
        code = why_missing if why_missing != "subset" or not outside else None
        why = f" ({REASON_LABEL[code]})" if code else " (no known reason)"
        if outside:
            text += (f", but {missing - outside} of the {n - outside} sample(s) it deals were "
                     f"never seen{why}; the other {outside} are not its data (it reads a "
                     "subset)")
        else:
            text += f", but {missing} sample(s) were never seen{why}"
    if dup and not copies and first["duplicates"]:
        text += f", {dup} extra (repeated) sample(s) ({REASON_LABEL[first['duplicates'][0]['reason']]})"
    if first.get("gather_for_metrics_exact") is not None:
        if first["gather_for_metrics_exact"]:
            data = "the loader's data" if why_missing == "subset" else "the dataset"
            text += f"; gather_for_metrics returns exactly {data}, use it for metrics"
        elif first["gather_for_metrics_equals_gather"] and why_missing == "drop-last":
            text += "; gather_for_metrics then equals gather (nothing to drop)"
        else:
            text += "; gather_for_metrics does NOT return exactly the dataset"
    if not first["steps_equal"]:
        text += (f"; the ranks take {[r['steps'] for r in first['ranks']]} steps: a training "
                 f"loop would hang at step {first['hang_at_step']} (DDP's all-reduce waits for "
                 "the ranks that have run out)")
    elif first["ragged_steps"]:
        ragged = ids_text(first["ragged_steps"], 5, total=first.get("ragged_step_count"),
                          brackets=True)
        text += (f"; the ranks' batches differ in size at step(s) {ragged}: "
                 "a plain accelerator.gather of them fails (pad_across_processes, or "
                 "gather_for_metrics(use_gather_object=True))")
    if len(epochs) > 1:
        changed = [e["order_changed"] for e in epochs[1:]]
        text += ("; the order changes every epoch" if all(changed)
                 else "; the order does NOT change between epochs")
    return text + "."


def _missing(e: dict) -> str:
    """Return an epoch's missing ids as a short list, or say they are not named."""
    # (no ids listed but some missing: the samples' keys are not known, analysis.keys)
    return ids_text(e["missing"], total=e["missing_count"], brackets=True,
                    empty="[not named: the samples' keys are not known]"
                    if e["missing_count"] else None)
