"""The resume audit's comparison: what the resume repeated and skipped, and the verdict.

The stopped, the resumed and the uninterrupted run's records in, the report's `resume` object
out (which ids the resume repeated and skipped, per epoch, whether each rank's order is the
uninterrupted one, and the verdict). Pure Python."""

from __future__ import annotations

from collections import Counter
from typing import cast

from sharddemo.options import ResumePlan, demo_scenarios

# Above this many ids, `repeated` and `skipped` list the first ones and count all.
ID_LIST_CAP = 1000


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _capped(counter: Counter) -> dict:
    ids = sorted(i for i, c in counter.items() for _ in range(c))
    return {"count": len(ids), "ids": ids[:ID_LIST_CAP], "capped": len(ids) > ID_LIST_CAP}


def _batches(record: dict) -> list[list[list[int]]]:
    return [r["batches"] for r in record["ranks"]]


def _ids(ranks: list[list[list[int]]]) -> Counter:
    return Counter(i for batches in ranks for i in _flat(batches))


def _global_order(ranks: list[list[list[int]]]) -> list[int]:
    """Return the epoch's ids in the order its batches were dealt.

    The j-th batch of every rank in rank order, then the (j+1)-th (accelerate deals global batch
    j*W + r to rank r). Used only to say at which restart a sample the chain never received was
    lost."""
    out: list[int] = []
    for j in range(max((len(b) for b in ranks), default=0)):
        for batches in ranks:
            if j < len(batches):
                out += batches[j]
    return out


def resume_point(stop: dict) -> tuple[int, int]:
    """Return where the next launch goes on from a launch's resolved stop.

    After an epoch's last step, the next epoch's step 0 (as accelerate's examples resume); else
    the stop itself."""
    return (stop["epoch"] + 1, 0) if stop["last"] else (stop["epoch"], stop["step"])


def compare_chain(plan: ResumePlan, references: dict, base_world: int,
                  launches: list[dict]) -> dict:
    """The `resume` object of the report for a chain of stops and restarts.

    `references`: {world size: the uninterrupted run's epoch records on that many ranks};
    `base_world`: the world size the run started on (its uninterrupted run is the one the
    chain is judged against). `launches`: each launch's trace in chain order, its `epochs`
    (records with their epoch) and `stop` (where it saved, resolved by the ranks: epoch, step,
    last; None for the last launch). Per epoch, over every launch that walked it: the ids
    repeated and skipped (multisets), the part of them that is the even_batches fill of the
    world size that finished the epoch (its own uninterrupted run holds it), whether each
    rank's order is the uninterrupted one, and the verdict. Per restart: where it stopped and
    resumed, on how many ranks, what each rank had received before and received after, the
    ids it delivered again and (for a loader that deals the same order in every launch) the
    ids lost there, and why in words."""
    sizes = [t["world_size"] for t in launches]
    parts = [{rec["epoch"]: _batches(rec) for rec in t["epochs"]} for t in launches]
    refs = {w: {rec["epoch"]: _batches(rec) for rec in recs} for w, recs in references.items()}
    base = refs[base_world]
    first = plan.stops[0]
    # Deterministic across launches: the first launch saw exactly what the uninterrupted run
    # on its world size saw up to its stop (earlier epochs, and the stop epoch's first steps).
    ref0 = refs.get(sizes[0], base)
    deterministic = all(
        e in ref0 and got == [r[:len(g)] for r, g in zip(ref0[e], got)]
        for e, got in parts[0].items())
    last_epoch = max(parts[-1]) if parts[-1] else first.epoch
    epochs, lost = [], {}
    for epoch in range(first.epoch, last_epoch + 1):
        walked = [j for j in range(len(launches)) if epoch in parts[j]]
        finisher = sizes[walked[-1]] if walked else base_world
        got_ranks: list = []
        for j in walked:
            if got_ranks and len(parts[j][epoch]) == len(got_ranks):
                got_ranks = [b + g for b, g in zip(got_ranks, parts[j][epoch])]
            else:
                got_ranks = got_ranks + parts[j][epoch]
        one_world = len({sizes[j] for j in walked}) == 1
        ref_ids = _ids(base.get(epoch, []))
        got_ids: Counter[int] = Counter()
        for j in walked:
            got_ids += _ids(parts[j][epoch])
        repeated, skipped = got_ids - ref_ids, ref_ids - got_ids
        fill_repeated: Counter[int] = Counter()
        fill_skipped: Counter[int] = Counter()
        if finisher != base_world and epoch in refs.get(finisher, {}):
            own = _ids(refs[finisher][epoch])
            fill_repeated, fill_skipped = (own - ref_ids) & repeated, (ref_ids - own) & skipped
        order = None
        if deterministic and one_world and walked and epoch in refs.get(finisher, {}):
            order = [_flat(b) for b in got_ranks] == [_flat(b) for b in refs[finisher][epoch]]
        wrong_rep, wrong_skip = repeated - fill_repeated, skipped - fill_skipped
        # lost: never received in the epoch at all (a sample received fewer times than the
        # uninterrupted run's fill gives it is not lost)
        lost[epoch] = Counter({i: 1 for i in wrong_skip if not got_ids[i]})
        exact = not wrong_rep and not wrong_skip and order is not False
        seen, ref_seen = sum(got_ids.values()), sum(ref_ids.values())
        whole = ("skipped" if ref_seen and not seen
                 else "repeated" if ref_seen and not (ref_ids - repeated) else None)
        small = seen <= 10 * ID_LIST_CAP
        epochs.append({
            "epoch": epoch, "repeated": _capped(repeated), "skipped": _capped(skipped),
            "fill": {"world_size": finisher, "repeated": sum(fill_repeated.values()),
                     "skipped": sum(fill_skipped.values())} if finisher != base_world else None,
            "order_equal": order, "resume_exact": exact, "whole": whole,
            "seen": seen, "reference_seen": ref_seen,
            "launches": [{"launch": j, "world_size": sizes[j],
                          "received": sum(_ids(parts[j][epoch]).values())} for j in walked],
            # what the resumed run's ranks received (earlier launches first), small runs
            "ranks": [{"rank": r, "batches": b} for r, b in enumerate(got_ranks)]
            if small and one_world else None})
    restarts = _restarts(plan, launches, sizes, parts, refs, base_world, deterministic, lost)
    stop0 = launches[0]["stop"]
    return {"at": {"epoch": stop0["epoch"], "step": stop0["step"], "last": stop0["last"]},
            "strategy": plan.strategy, "world_sizes": sizes,
            "deterministic": deterministic, "restarts": restarts, "epochs": epochs,
            "resume_exact": all(e["resume_exact"] for e in epochs),
            "stopped": {"steps_per_rank": [len(b) for b in parts[0].get(stop0["epoch"], [])]}}


def _restarts(plan: ResumePlan, launches: list[dict], sizes: list[int], parts: list[dict],
              refs: dict, base_world: int, deterministic: bool,
              lost_by_epoch: dict[int, Counter]) -> list:
    """Return each restart of the chain: where launch i saved and launch i+1 went on.

    Used by compare_chain. `lost_by_epoch`: the ids each epoch never received, its fill taken
    out."""
    out: list[dict] = []
    starts: dict[int, list] = {}  # epoch -> [(restart, first position launch i+1 received)]
    positions: dict[int, dict] = {}
    for i in range(len(launches) - 1):
        stop = launches[i]["stop"]
        epoch, step = resume_point(stop)
        before_ranks = parts[i].get(epoch, [])
        after_ranks = parts[i + 1].get(epoch, [])
        before: Counter[int] = Counter()
        for j in range(i + 1):
            before += _ids(parts[j].get(epoch, []))
        repeated = before & _ids(after_ranks)
        fill: Counter[int] = Counter()
        if sizes[i + 1] != base_world and epoch in refs.get(sizes[i + 1], {}):
            fill = (_ids(refs[sizes[i + 1]][epoch]) - _ids(refs[base_world].get(epoch, []))) \
                & repeated
        if epoch in refs[base_world]:
            order = positions.setdefault(epoch, {})
            if not order:
                for k, i_d in enumerate(_global_order(refs[base_world][epoch])):
                    order.setdefault(i_d, k)
            dealt = _global_order(after_ranks)
            batch = next((len(b[0]) for b in after_ranks + before_ranks if b), 0)
            # where the launch went on in the epoch's order: its first sample; a launch that
            # dealt nothing went on past its STEP x ranks x batch first slots
            start = order.get(dealt[0], 0) if dealt else (
                step * sizes[i + 1] * batch if batch else float("inf"))
            # the launch dealt the uninterrupted run's order from `start` on (up to the fill)
            reference = _global_order(refs[base_world][epoch])
            span = min(len(dealt), len(order) - start) if dealt else 0
            # A launch that resumed in this epoch walks it as its loader's first pass: only in
            # epoch 0 is that the uninterrupted run's pass too (later, a fresh loader may replay
            # epoch 0's order, and a short slice of it can match by chance).
            # And the uninterrupted run on the launch's world size deals the same order (a
            # loader on one process may draw another permutation than on several).
            own = refs.get(sizes[i + 1], {}).get(epoch)
            same = deterministic and epoch == 0 and own is not None and \
                _global_order(own)[:len(order)] == reference[:len(order)] and (
                    not dealt or dealt[:cast(int, span)]
                    == reference[cast(int, start):cast(int, start + span)])
            starts.setdefault(epoch, []).append((len(out), start, same))
        batch = next((len(b[0]) for b in after_ranks + before_ranks if b), 0)
        out.append({
            "restart": i + 1, "epoch": stop["epoch"], "step": stop["step"], "last": stop["last"],
            "steps_in_epoch": stop.get("steps"),
            "resumed_at": {"epoch": epoch, "step": step},
            "ranks_before": sizes[i], "ranks_after": sizes[i + 1],
            "received_before": [sum(len(x) for x in b) for b in before_ranks],
            "received_after": [sum(len(x) for x in b) for b in after_ranks],
            "repeated": _capped(repeated), "fill": sum(fill.values()),
            "skipped": _capped(Counter()),
            "reason": _restart_reason(plan.strategy, stop, epoch, step, sizes[i], sizes[i + 1],
                                      batch, sum(before.values()), sum(repeated.values()),
                                      deterministic)})
    # A sample the whole chain never received (beyond the fill) was lost at a restart of its
    # epoch: the only one, where the epoch had one; else the first that went on past its place
    # in the uninterrupted order, where every launch of the epoch dealt that order (epoch 0,
    # a deterministic loader); else it cannot be told (None: each launch drew its own order,
    # or a fresh loader may have replayed another epoch's).
    for epoch, lost in lost_by_epoch.items():
        here = starts.get(epoch, [])
        if len(here) > 1 and not all(same for _, _, same in here):
            for r, _, _ in here:
                out[r]["skipped"] = None
            continue
        found: dict[int, Counter] = {}
        for i_d, count in lost.items():
            at = next((r for r, start, _ in here if start > positions[epoch].get(i_d, 0)),
                      here[-1][0] if here else None)
            if at is not None:
                found.setdefault(at, Counter())[i_d] += count
        for r, ids in found.items():
            out[r]["skipped"] = _capped(ids)
    return out


def _restart_reason(strategy: str, stop: dict, epoch: int, step: int, w0: int, w1: int,
                    batch: int, received: int, repeated: int, deterministic: bool) -> str:
    """Why one restart repeated or skipped what it did, in plain words."""
    if stop["last"]:
        where = f"saved after the last step ({stop['step']}) of epoch {stop['epoch']}"
    elif stop["step"] == 0:
        where = f"saved before the first step of epoch {stop['epoch']}"
    else:
        where = f"saved after step {stop['step']} of epoch {stop['epoch']}"
    text = f"{where} on {w0} rank(s); resumed on {w1} at epoch {epoch} step {step}"
    if stop["last"]:
        text += " (the next epoch, as accelerate's examples resume: skip_first_batches(loader, 0))"
    if strategy == "skip" and step:
        slots = step * w1 * batch
        text += (f"; skip_first_batches(loader, {step}) skipped {step} batch(es) per rank at the "
                 f"new size: {step} x {w1} rank(s) x {batch} = {slots} sample slot(s), where the "
                 f"run had received {received} of this epoch")
    elif strategy == "restart" and step:
        text += f"; the epoch started over from its first batch ({received} received before)"
    elif strategy == "stateful" and step:
        text += "; the loader's restored state went on by itself"
        if repeated:
            text += (f", and gave {repeated} sample(s) of this epoch again: the state it "
                     "restored was not where the run had stopped")
    if not deterministic:
        text += "; each launch drew its own order (no common seed)"
    return text


def compare_resume(plan: ResumePlan, reference: dict, stop: dict, resumed: dict) -> dict:
    """Compare one stop and one restart, from records in walk order (the resume demo's shape).

    `stop` holds epochs 0..EPOCH, `resumed` EPOCH and EPOCH+1, `reference` epochs 0..
    (compare_chain)."""
    at = plan.stops[0]

    def numbered(records: list, first: int) -> list:
        return [dict(r, epoch=first + k) for k, r in enumerate(records)]

    launches = [{"world_size": stop["world_size"], "epochs": numbered(stop["epochs"], 0),
                 "stop": {"epoch": at.epoch, "step": at.step, "last": False}},
                {"world_size": resumed["world_size"],
                 "epochs": numbered(resumed["epochs"], at.epoch), "stop": None}]
    return compare_chain(plan, {reference["world_size"]: numbered(reference["epochs"], 0)},
                         reference["world_size"], launches)


def explain(resume: dict) -> str:
    """One paragraph in plain words: each restart, then each epoch over the whole chain."""
    strategy, sizes = resume["strategy"], resume["world_sizes"]
    restarts = []
    for r in resume["restarts"]:
        at = f"{r['epoch']}:{'last' if r['last'] else r['step']}"
        rep = r["repeated"]["count"]
        fill = f" ({r['fill']} of them the {r['ranks_after']}-rank fill)" if r["fill"] else ""
        skip = (f"{r['skipped']['count']} skipped" if r["skipped"] is not None
                else "skipped not attributable")
        restarts.append(f"restart {r['restart']} after {at} on {r['ranks_before']} rank(s), "
                        f"resumed on {r['ranks_after']} at epoch {r['resumed_at']['epoch']} "
                        f"step {r['resumed_at']['step']}: {rep} repeated{fill}, {skip}")
    head = (f"Stopped and restarted {len(restarts)} time(s) with --resume-strategy {strategy}: "
            + "; ".join(restarts))
    parts = []
    for e in resume["epochs"]:
        rep, skip = e["repeated"]["count"], e["skipped"]["count"]
        fill = e.get("fill")
        note = ""
        if fill and (fill["repeated"] or fill["skipped"]):
            note = (f" ({fill['repeated']} of the repeated and {fill['skipped']} of the skipped "
                    f"are the {fill['world_size']}-rank loader's own even_batches fill, as its "
                    "uninterrupted run has it)")
        if e["resume_exact"]:
            parts.append(f"epoch {e['epoch']}: exactly the uninterrupted run's samples"
                         + (" in its order" if e["order_equal"] else "") + note)
        else:
            text = f"epoch {e['epoch']}: {rep} sample(s) repeated, {skip} skipped{note}"
            if e.get("whole") == "skipped":
                text += ", the whole epoch SKIPPED"
            elif e.get("whole") == "repeated":
                text += ", the whole epoch REPEATED"
            if e["order_equal"] is False:
                text += ", and the order differs from the uninterrupted run"
            parts.append(text)
    tail = ""
    if not resume["deterministic"]:
        tail = (" The loader gave a different order in each launch (no common seed), so orders "
                "are not compared and a resumed epoch is a new permutation.")
    elif len(set(sizes)) > 1:
        tail = (f" The world size changed ({' -> '.join(str(w) for w in sizes)}): the "
                "checkpoint's loader position is per rank, and skip_first_batches counts batches "
                "of the new size, so the resumed ranks deal the epoch on from another place; "
                "per-rank orders are compared only where one world size walked the whole epoch.")
    if resume["deterministic"] and any(
            r["resumed_at"]["step"] == 0 for r in resume["restarts"]) and any(
            e["order_equal"] is False and not e["repeated"]["count"] for e in resume["epochs"]):
        tail += (" The resumed epochs hold the right samples in another order: a fresh loader "
                 "counts its epochs from 0 again, so it replays an earlier epoch's order (call "
                 "set_epoch with the real epoch, or resume the loader's state).")
    verdict = "resume-exact: yes" if resume["resume_exact"] else "resume-exact: NO"
    return f"{head}. " + "; ".join(parts) + f".{tail} {verdict}."


def demo_report(reference: dict, stop: dict, resumed: dict, stateful: bool = True) -> list[dict]:
    """Return every scenario's `resume` object, with its workers.

    `stateful`: the workers as the ranks ran them (options.demo_scenarios)."""
    rows = []
    for k, sc in enumerate(demo_scenarios(stop["steps"], stateful)):
        plan = ResumePlan.at(sc["epoch"], sc["step"], sc["strategy"])
        key = f"w{sc['workers']}-{'stateful' if sc['strategy'] == 'stateful' else 'plain'}"
        result = compare_resume(
            plan, {"world_size": reference["world_size"], "epochs": reference["results"][key]},
            {"world_size": stop["world_size"], "epochs": stop["results"][str(k)]},
            {"world_size": resumed["world_size"], "epochs": resumed["results"][str(k)]})
        result["workers"] = sc["workers"]
        result["explanation"] = explain(result)
        rows.append(result)
    return rows
