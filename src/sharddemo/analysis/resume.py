"""The resume audit's comparison: the stopped, the resumed and the uninterrupted run's
records in, the report's `resume` object out (which ids the resume repeated and skipped, per
epoch, whether each rank's order is the uninterrupted one, and the verdict). Pure Python."""

from __future__ import annotations

from collections import Counter

from sharddemo.options import ResumePlan, demo_scenarios

# Above this many ids, `repeated` and `skipped` list the first ones and count all.
ID_LIST_CAP = 1000


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _capped(counter: Counter) -> dict:
    ids = sorted(i for i, c in counter.items() for _ in range(c))
    return {"count": len(ids), "ids": ids[:ID_LIST_CAP], "capped": len(ids) > ID_LIST_CAP}


def compare_resume(plan: ResumePlan, reference: dict, stop: dict, resumed: dict) -> dict:
    """The `resume` object of the report: per epoch EPOCH and EPOCH+1, the ids repeated and
    skipped against the uninterrupted run, whether each rank's order is unchanged, and the
    verdict."""
    before = [r["batches"] for r in stop["epochs"][plan.epoch]["ranks"]]
    same_world = stop["world_size"] == resumed["world_size"]
    # Deterministic across launches: the stop launch saw exactly what the reference saw
    # before the stop (earlier epochs, and this epoch's first steps).
    deterministic = all(
        [r["batches"] for r in stop["epochs"][k]["ranks"]]
        == [r["batches"][:len(s["batches"])] for r, s in zip(reference["epochs"][k]["ranks"],
                                                               stop["epochs"][k]["ranks"])]
        for k in range(plan.epoch + 1))
    epochs = []
    for offset, epoch in enumerate((plan.epoch, plan.epoch + 1)):
        ref_ranks = [r["batches"] for r in reference["epochs"][epoch]["ranks"]]
        got_ranks = [r["batches"] for r in resumed["epochs"][offset]["ranks"]]
        if offset == 0:  # the stopped launch's part of the epoch, then the resumed part
            if same_world:
                got_ranks = [b + g for b, g in zip(before, got_ranks)]
            else:
                got_ranks = before + got_ranks
        ref_ids = Counter(i for batches in ref_ranks for i in _flat(batches))
        got_ids = Counter(i for batches in got_ranks for i in _flat(batches))
        repeated, skipped = got_ids - ref_ids, ref_ids - got_ids
        order = (None if not (same_world and deterministic)
                 else [_flat(b) for b in got_ranks] == [_flat(b) for b in ref_ranks])
        exact = not repeated and not skipped and order is not False
        small = sum(got_ids.values()) <= 10 * ID_LIST_CAP
        epochs.append({"epoch": epoch, "repeated": _capped(repeated), "skipped": _capped(skipped),
                       "order_equal": order, "resume_exact": exact,
                       "seen": sum(got_ids.values()), "reference_seen": sum(ref_ids.values()),
                       # what the resumed run's ranks received (stopped part first), small runs
                       "ranks": [{"rank": r, "batches": b} for r, b in enumerate(got_ranks)]
                       if small and same_world else None})
    return {"at": {"epoch": plan.epoch, "step": plan.step}, "strategy": plan.strategy,
            "world_sizes": [stop["world_size"], resumed["world_size"]],
            "deterministic": deterministic, "epochs": epochs,
            "resume_exact": all(e["resume_exact"] for e in epochs),
            "stopped": {"steps_per_rank": [len(b) for b in before]}}


def explain(resume: dict) -> str:
    """One paragraph in plain words."""
    at, strategy = resume["at"], resume["strategy"]
    w0, w1 = resume["world_sizes"]
    head = (f"Stopped after {at['step']} step(s) of epoch {at['epoch']} on {w0} rank(s), resumed "
            f"on {w1} with --resume-strategy {strategy}")
    parts = []
    for e in resume["epochs"]:
        rep, skip = e["repeated"]["count"], e["skipped"]["count"]
        if e["resume_exact"]:
            parts.append(f"epoch {e['epoch']}: exactly the uninterrupted run's samples"
                         + (" in its order" if e["order_equal"] else ""))
        else:
            text = f"epoch {e['epoch']}: {rep} sample(s) repeated, {skip} skipped"
            if e["order_equal"] is False:
                text += ", and the order differs from the uninterrupted run"
            parts.append(text)
    tail = ""
    if not resume["deterministic"]:
        tail = (" The loader gave a different order in each launch (no common seed), so orders "
                "are not compared and a resumed epoch is a new permutation.")
    elif w0 != w1:
        tail = (f" The world size changed ({w0} -> {w1}): the checkpoint's loader position is "
                "per rank, so the resumed ranks deal the epoch anew from a different split, and "
                "the loader's own padding differs too; per-rank orders are not compared.")
    if resume["deterministic"] and w0 == w1 and at["step"] == 0 and any(
            e["order_equal"] is False and not e["repeated"]["count"] for e in resume["epochs"]):
        tail += (" The resumed epochs hold the right samples in another order: a fresh loader "
                 "counts its epochs from 0 again, so it replays an earlier epoch's order (call "
                 "set_epoch with the real epoch, or resume the loader's state).")
    verdict = "resume-exact: yes" if resume["resume_exact"] else "resume-exact: NO"
    return f"{head}. " + "; ".join(parts) + f".{tail} {verdict}."


def demo_report(reference: dict, stop: dict, resumed: dict, stateful: bool = True) -> list[dict]:
    """Every scenario's `resume` object, with its workers (`stateful`: as the ranks ran them,
    options.demo_scenarios)."""
    rows = []
    for k, sc in enumerate(demo_scenarios(stop["steps"], stateful)):
        plan = ResumePlan(sc["epoch"], sc["step"], sc["strategy"])
        key = f"w{sc['workers']}-{'stateful' if sc['strategy'] == 'stateful' else 'plain'}"
        result = compare_resume(
            plan, {"world_size": reference["world_size"], "epochs": reference["results"][key]},
            {"world_size": stop["world_size"], "epochs": stop["results"][str(k)]},
            {"world_size": resumed["world_size"], "epochs": resumed["results"][str(k)]})
        result["workers"] = sc["workers"]
        result["explanation"] = explain(result)
        rows.append(result)
    return rows
