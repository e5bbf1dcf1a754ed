"""The watch's judgement of a resumed epoch, pure (no torch): which samples the part after a
restart delivered again and which no part delivered (judge_resume), the loader's own fill
told apart from a repeat (fill_ids, padding_ids), why a resume does not continue where it
stopped (restart_cause, replay_cause), and a restart as the report keeps it (restart). Used by
analysis/entry.py's judge_epoch and by the watch's checkpoint (watching/checkpointing.py). Not
`audit --resume-at`'s comparison of launches: that is analysis/resume.py."""

from __future__ import annotations

from typing import Optional

import numpy as np

from sharddemo.analysis.entry_line import FILL_BY, changes_said, restart_words


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
    """Why a resumed epoch repeats or skips samples (judge_resume's `cause`), from what the
    restart did (`last`: the epoch's last restart) and what the loader is: never a cause the
    script may not have (a seed it set, a set_epoch it calls). A changed number of ranks, or a
    loop that skipped nothing of the steps taken before the stop, comes first: either alone
    repeats samples, whatever the order."""
    last = last or {}
    saved_on, resumed_on = last.get("saved_on"), last.get("resumed_on")
    if (saved_on and resumed_on and saved_on != resumed_on and last.get("loader_state")
            and description.get("stream") == "litdata"):
        # litdata 0.2.76 neither refuses nor replays per rank: it re-splits (measured:
        # docs/resume.md, "litdata")
        return (f"the restart changed the number of ranks ({saved_on} -> {resumed_on}) and "
                "litdata re-split the rest of the epoch onto the new ranks (its elastic "
                "resume, litData PR 878): it goes on from the saved position rounded down to a "
                f"whole batch on each of the {resumed_on} ranks, so the samples past that point "
                "come again, and its drop_last cuts the rest to whole batches on every rank; "
                "docs/resume.md")
    if saved_on and resumed_on and saved_on != resumed_on:
        return (f"the restart changed the number of ranks ({saved_on} -> {resumed_on}): a "
                "position counted in batches of one world size is other samples at another; "
                "docs/resume.md")
    changed = {k: v for k, v in (last.get("changed") or {}).items() if k != "world_size"}
    if changed:
        return (f"the restart changed {changes_said(changed)}: a position saved at one "
                "topology is other samples at another; docs/resume.md")
    stateful = ("StatefulDataLoader" in (description.get("classes") or [])
                or last.get("loader_state"))
    if last.get("step") and not last.get("skipped_batches") and not stateful:
        return (f"the resumed loop skipped none of the {last['step']} steps taken before the "
                "stop (skip_first_batches, or a loader that keeps its own state, restores the "
                "position); docs/resume.md")
    if last.get("loader_state") and description.get("stream") == "datasets":
        # the loader restored its own state (its load_state_dict), and in it the stream's: the
        # library's own resume is what did not continue (measured: docs/resume.md)
        held = ("a shuffled stream's state holds its source's position, not its shuffle "
                "buffer (datasets issue 7901)" if description.get("shuffled") else
                "the stream went on from its own state elsewhere than where it stopped, or "
                "the launches built different streams")
        return ("the loader restored its own state (loader.state_dict()), the stream's own "
                f"state with it (datasets IterableDataset): {held}; docs/resume.md")
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


def judge_resume(before: np.ndarray, after: np.ndarray, epoch: int,
                 restarts: Optional[list] = None,
                 again: Optional[np.ndarray] = None,
                 fill: Optional[np.ndarray] = None,
                 fill_by: str = FILL_BY, partial: bool = False,
                 cause: str = RESTART_CAUSE, drops: int = 0) -> dict:
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
    `drops`: the most samples the loader's drop_last leaves out of an epoch (less than one
    global batch, as an uninterrupted epoch is judged: analysis/reasons.py's explain_missing);
    an epoch whose only gap is that many or fewer, with nothing repeated, resumed exactly
    (litdata drops them by its own drop_last in every epoch, resumed or not: docs/resume.md),
    and its skipped samples carry `"reason": "drop-last"`.

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
    dropped = not partial and not len(repeated) and 0 < len(skipped) <= drops
    ok = not len(repeated) and (partial or not len(skipped) or dropped)
    detail = "" if ok else (
        f"{len(repeated)} sample(s) delivered again after "
        f"{'a restart' if len(restarts) > 1 else 'the restart'}"
        + (" so far" if partial else f" and {len(skipped)} never")
        + f": the resumed run did not continue where it stopped ({cause})")
    said = [r for r in restarts if r.get("from_start") or r.get("changed") or (
        r.get("saved_on") and r.get("resumed_on") and r["saved_on"] != r["resumed_on"])]
    if not ok and said:
        detail += "; " + "; ".join(restart_words(r) for r in said)
    return {"seen_before": int(before.sum()), "repeated": id_list(repeated),
            "skipped": None if partial else {**id_list(skipped),
                                             **({"reason": "drop-last"} if dropped else {})},
            "restarts": restarts,
            "verdict": {"verdict": "resume-exact", "epoch": epoch, "ok": ok, "detail": detail}}


def unknown_resume(epoch: int, restarts: list) -> dict:
    """A resume from a checkpoint that holds no state of the watch's (saved before the watch
    was added): the part before the stop is unknown; the rest is judged."""
    return {"seen_before": None, "repeated": None, "skipped": None, "unknown_before": True,
            "restarts": [dict(r) for r in restarts]}


def restart(epoch: int, step: Optional[int], saved_on: Optional[int],
            resumed_on: Optional[int], at_edge: bool = False) -> dict:
    """One restart of a chain, as the report keeps it: the epoch and the step (of the main
    process, in the epoch, over the whole chain) where the checkpoint was saved, on how many
    ranks it was saved and resumed; `at_edge`: saved after the epoch's last step (the run
    resumes with the next epoch). `seen_before` and `repeated` are filled as the epoch goes on
    (judge_resume); `skipped_batches`, by the resumed loader (skip_first_batches)."""
    out = {"epoch": epoch, "step": step, "saved_on": saved_on, "resumed_on": resumed_on,
           "seen_before": None, "repeated": None, "skipped_batches": None}
    if at_edge:
        out["at_edge"] = True
    return out


def id_list(ids: np.ndarray) -> dict:
    return {"count": int(len(ids)), "ids": ids[:100].tolist()}


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
