"""The watch's line in words, pure (no torch): an epoch's report entry -> the one line
`sharddemo.watch` prints for it (watch_line; partial_line for a part of an epoch), and how a
resumed epoch's restarts are said in it (restart_words, restarts_said). The judgement that
fills the entry is analysis/entry.py; a resumed epoch's, analysis/entry_resume.py."""

from __future__ import annotations

from typing import Optional

from sharddemo.analysis.tokens import tokens_words


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

    n, deals = entry["dataset_size"], entry["deals"]
    steps = entry["steps"]
    each = (f"{plural(steps[0], 'step')} each" if len(set(steps)) == 1
            else f"steps per {'group' if entry.get('mesh') else 'rank'} {steps}")
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
                 f"{r.get('step')}{', after its last step' if r.get('at_edge') else ''}"
                 f"{restored_words(r)})")
    elif resumed:
        skipped = resumed["skipped"]
        once = (f": {resumed['seen_before']:,} before the stop, {resumed['repeated']['count']:,} "
                f"repeated after {restarts_said(resumed.get('restarts') or [])}, "
                + (f"{skipped['count']:,} never delivered (what drop_last leaves out)"
                   if skipped.get("reason") == "drop-last" else
                   f"{skipped['count']:,} skipped"))
    text = (f"sharddemo: epoch {entry['epoch']} {entry['loader']}: {entry['unique']:,} of {part} "
            f"{'sample' if n == 1 else 'samples'}{'' if once[0] in ',:' else ' '}{once}"
            f"{split_words(entry)} {across(entry)}, {each}, order changed: {order}")
    missing = entry["missing"]
    if not failed and missing and missing["count"] and missing["reason"] == "ray-equal-split":
        # rows Ray's equal split drops by design: said, not an alarm, in the reason's own
        # sentence (with iter_torch_batches(drop_last=True) it names the short last batches
        # too, which the bare label does not: the line would put them on the split)
        said = (entry.get("reasons") or {}).get("ray-equal-split") or REASON_LABEL[
            "ray-equal-split"]
        text += f", missing: {missing['count']:,} ({said})"
    text += tokens_words(entry)
    if not failed:
        return text + ": ok"
    details = "; ".join(f"{v['verdict']}: {v['detail']}" for v in failed)
    reasons = [REASON_LABEL.get(r, r) for r in
               [(entry["missing"] or {}).get("reason"), *entry["duplicated"]["reasons"]]
               if r and counts_failed]
    reasons = [r for r in dict.fromkeys(reasons) if r not in details]  # not said twice
    return text + ": FAIL " + details + (f" ({'; '.join(reasons)})" if reasons else "")


def across(entry: dict) -> str:
    """'across 2 ranks', or on a mesh 'across 2 data-parallel groups (mesh dp=2 x tp=2, data
    dims dp)': what the counts are over (a mesh's groups are counted once each)."""
    mesh = entry.get("mesh")
    if not mesh:
        return f"across {plural(entry['world_size'], 'rank')}"
    shape = " x ".join(f"{d}={s}" for d, s in mesh["dims"].items())
    groups = mesh["data_groups"]
    data = ", ".join(mesh["data_dims"]) or "none"
    return (f"across {groups} data-parallel group{'s' if groups != 1 else ''} (mesh {shape}, "
            f"data dims {data})")


def split_words(entry: dict) -> str:
    """' (2 split across two packed rows, each counted once)' where samples of packed rows ran
    on from one row into the next (rank.ids.flatten_packs), else ''."""
    split = entry.get("split_samples")
    if not split:
        return ""
    return f" ({split:,} split across two packed rows, each counted once)"


def partial_line(entry: dict) -> str:
    """sharddemo: epoch 0 train (partial): 160 samples, 160 distinct, across 2 ranks, 20 steps
    each: ok"""
    steps, world = entry["steps"], entry["world_size"]
    each = (f"{plural(steps[0], 'step')}{' each' if len(steps) > 1 else ''}"
            if len(set(steps)) == 1 else f"steps per rank {steps}")
    alone = entry.get("ranks") == "main-only"
    where = (f"on the main process alone of {world} ranks ({entry.get('alone_because')}, so "
             "the ranks no longer met)" if alone else across(entry))
    text = (f"sharddemo: epoch {entry['epoch']} {entry['loader']} (partial): "
            f"{plural(entry['seen'], 'sample')}, {entry['unique']:,} distinct"
            f"{split_words(entry)}, {where}, {each}")
    text += partial_resume_words(entry.get("resume"))
    text += tokens_words(entry)
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
                f"{r.get('step')}{', after its last step' if r.get('at_edge') else ''}"
                f"{restored_words(r)})")
    return (f": {resumed['seen_before']:,} before the stop, "
            f"{resumed['repeated']['count']:,} repeated so far after "
            f"{restarts_said(restarts)} (the rest of the epoch may still come: the samples "
            "not delivered yet are not judged)")


# whose fill a restart's fill is where it does not say (saved before `by` was kept), and the
# default of judge_resume
FILL_BY = "accelerate's even_batches"


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
    text += restored_words(r, ": ")
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


def restarts_said(restarts: list) -> str:
    """'the restart' (one, on as many ranks as it was saved on), else each restart in order:
    'the restarts at epoch 0 step 3 (2 ranks, 5 repeated), epoch 1 step 4 (2 -> 3 ranks, 4
    repeated)'."""
    if len(restarts) <= 1 and not any(r.get("saved_on") != r.get("resumed_on")
                                     or r.get("at_edge") or r.get("changed")
                                     for r in restarts):
        return "the restart"
    said = []
    for r in restarts:
        ranks = (f"{r['saved_on']} -> {plural(r['resumed_on'] or 0, 'rank')}"
                 if r.get("saved_on") and r["saved_on"] != r.get("resumed_on")
                 else plural(r.get("resumed_on") or 0, "rank"))
        edge = ", after the epoch's last step" if r.get("at_edge") else ""
        other = {k: v for k, v in (r.get("changed") or {}).items() if k != "world_size"}
        if other:
            edge += ", " + changes_said(other)
        again = r.get("repeated")
        count = f", {again['count']:,} repeated" if again is not None else ""
        if r.get("fill"):
            count += f", {r['fill']['count']:,} of the fill ({r['fill'].get('by', FILL_BY)})"
        said.append(f"epoch {r['epoch']} step {r['step']} ({ranks}{edge}{count})")
    return f"the restart{'s' if len(said) > 1 else ''} at " + ", ".join(said)


# a topology change (a restart's `changed`) in words
CHANGE_WORDS = {"world_size": "ranks", "mesh": "mesh", "num_workers": "DataLoader workers",
                "batch_size": "batch size"}


def changes_said(changed: dict) -> str:
    """'DataLoader workers 2 -> 4, batch size 4 -> 8'."""
    return ", ".join(f"{CHANGE_WORDS.get(k, k)} {_figure(k, v[0])} -> {_figure(k, v[1])}"
                     for k, v in changed.items())


def _figure(key: str, value) -> str:
    """A topology figure in words: a mesh's None is a flat world ('none')."""
    return "none (a flat world)" if key == "mesh" and value is None else str(value)


def restored_words(r: dict, lead: str = "; ") -> str:
    """What a restart from the loader's own state says of it: '; the loader restored its own
    state (loader.state_dict()), saved with DataLoader workers 2 -> 4'; '' for another
    restart (accelerate's, the Trainer's, Lightning's: said as before)."""
    other = {k: v for k, v in (r.get("changed") or {}).items() if k != "world_size"}
    if not r.get("loader_state"):
        return f"{lead}the topology changed: {changes_said(other)}" if other else ""
    text = f"{lead}the loader restored its own state (loader.state_dict())"
    return text + (f" on a changed topology: {changes_said(other)}" if other else "")


def plural(count: int, word: str, many: str = "") -> str:
    """'1 step', '5 steps' ('1 copy', '2 copies' with `many`)."""
    return f"{count:,} {word if count == 1 else (many or word + 's')}"
