"""`audit --resume-at` chains of stops and restarts (a changed world size, saves at an epoch's
edge), in one process (hypothesis): chains of a seeded prepared loader walked as a training
loop does (tests/support/library_loops.py: accelerate's `prepare_data_loader` for each rank,
`skip_first_batches` after each restart, a fresh loader in each launch), handed to the
comparison (sharddemo.analysis.resume.compare_chain); every expected value is worked out here
from the ids those library loaders gave, never from sharddemo's code. On real gloo ranks:
tests/ranks/test_resume_chain.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from support.launch import ROOT
from support.library_loops import flat, ids_of, library_loader, uninterrupted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


# ---------------------------------------------------------------------------------------------
# The loop, written here against accelerate alone.


def loop_launch(n, b, world, start, stop, last_epoch):
    """One launch of the chain on every rank, as a loop that counts its steps runs it: from
    `start` (epoch, step, after_last) with `skip_first_batches(loader, step)`, to `stop`
    (epoch, step or "last") or through `last_epoch`. Returns ({epoch: per-rank batches},
    the resolved stop {epoch, step, last})."""
    from accelerate.data_loader import skip_first_batches

    epochs: dict[int, list] = {}
    resolved = None
    for rank in range(world):
        loader = library_loader(n, b, world, rank)
        epoch, step = start[0], start[1]
        if start[2]:
            epoch, step = epoch + 1, 0
        first = True
        while True:
            batches = ids_of(skip_first_batches(loader, step) if first and step else loader)
            if stop is not None and stop[0] == epoch:
                total = step + len(batches)
                at = total if stop[1] == "last" else stop[1]
                assert at <= total, (stop, total)  # the chain drawn below stays in the epoch
                epochs.setdefault(epoch, []).append(batches[:at - step])
                resolved = {"epoch": epoch, "step": at, "last": at == total}
                break
            epochs.setdefault(epoch, []).append(batches)
            if stop is None and epoch >= last_epoch:
                break
            epoch, step, first = epoch + 1, 0, False
    return epochs, resolved


def trace(world, epochs, stop):
    return {"world_size": world, "stop": stop,
            "epochs": [{"epoch": e, "ranks": [{"rank": r, "batches": b}
                                               for r, b in enumerate(ranks)]}
                       for e, ranks in sorted(epochs.items())]}


def dealt(ranks) -> list[int]:
    """An epoch's ids in the order accelerate dealt them: global batch k went to rank k mod W."""
    return [i for k in range(max(len(b) for b in ranks)) for batches in ranks
            if k < len(batches) for i in batches[k]]


@st.composite
def chains(draw):
    """N, B, the first world size, and a chain of 1-3 stops in epochs 0 and 1, each resumed on
    1-3 ranks; every stop lies within what its launch can walk (its length from the library)."""
    n, b = draw(st.integers(6, 40)), draw(st.integers(1, 4))
    w0 = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    stops, world, at = [], w0, (0, 0)
    for size in sizes:
        if at[0] > 1:
            break
        length = len(library_loader(n, b, world, 0))
        epoch = draw(st.integers(at[0], min(at[0] + 1, 1)))
        low = at[1] if epoch == at[0] else 0
        total = max(low, length)  # the epoch's steps as this launch counts them
        step = draw(st.one_of(st.just("last"), st.integers(low, total)))
        stops.append((epoch, step))
        end = total if step == "last" else step
        at = (epoch + 1, 0) if end == total else (epoch, end)
        world = size
    return n, b, w0, stops, sizes[:len(stops)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_a_chain_reports_what_the_library_loops_received(chain):
    from sharddemo.analysis.resume import compare_chain, explain
    from sharddemo.options import LAST, ResumePlan, ResumeStop

    n, b, w0, stops, sizes = chain
    worlds = [w0, *sizes]
    launches, parts, start = [], [], (0, 0, False)
    last_epoch = None
    for j, world in enumerate(worlds):
        stop = stops[j] if j < len(stops) else None
        if stop is None:
            last_epoch = start[0] + (2 if start[2] else 1)
        epochs, resolved = loop_launch(n, b, world, start, stop, last_epoch)
        parts.append(epochs)
        launches.append(trace(world, epochs, resolved))
        if resolved is not None:
            start = (resolved["epoch"], resolved["step"], resolved["last"])
    refs = {w: uninterrupted(n, b, w, last_epoch + 1) for w in set(worlds)}
    plan = ResumePlan(tuple(ResumeStop(e, LAST if s == "last" else s) for e, s in stops))
    result = compare_chain(plan, {w: trace(w, r, None)["epochs"] for w, r in refs.items()},
                           w0, launches)
    result["explanation"] = explain(result)
    import jsonschema

    jsonschema.validate(result, {**SCHEMA["$defs"]["resume"], "$defs": SCHEMA["$defs"]})
    from sharddemo.render import resume_lines

    lines = resume_lines(result)  # the table's and the markdown's lines: each restart, in order
    assert [line.split(":")[0] for line in lines if line.startswith("restart ")] == \
        [f"restart {k}" for k in range(1, len(stops) + 1)]
    assert result["world_sizes"] == worlds
    by_epoch = {e["epoch"]: e for e in result["epochs"]}
    for epoch in range(stops[0][0], last_epoch + 1):
        walked = [j for j in range(len(parts)) if epoch in parts[j]]
        got = Counter(i for j in walked for i in flat(parts[j][epoch]))
        base = Counter(flat(refs[w0][epoch]))
        e = by_epoch[epoch]
        # the totals over the whole chain: what the loops received against the uninterrupted
        # run on the first world size
        assert e["seen"] == sum(got.values()) and e["reference_seen"] == sum(base.values())
        assert e["repeated"]["ids"] == sorted((got - base).elements()), epoch
        assert e["skipped"]["ids"] == sorted((base - got).elements()), epoch
        # exact where, beyond what the uninterrupted run on the first world size received,
        # the loops received no more than the finishing world size's own even_batches fill
        # adds and no fewer than it leaves out (its uninterrupted run), in its order where one
        # world size walked the whole epoch
        finisher = worlds[walked[-1]]
        one = len({worlds[j] for j in walked}) == 1
        stitched = [sum((parts[j][epoch][r] for j in walked), []) for r in range(finisher)] \
            if one else None
        own = Counter(flat(refs[finisher][epoch]))
        same_samples = all(got[x] <= max(base[x], own[x]) and got[x] >= min(base[x], own[x])
                           for x in set(got) | set(base) | set(own))
        same_order = stitched == refs[finisher][epoch] if one else None
        assert e["order_equal"] == same_order, epoch
        assert e["resume_exact"] == (same_samples and same_order is not False), (epoch, e)
        if not got and base:
            assert e["whole"] == "skipped"
    for i, r in enumerate(result["restarts"]):
        stop = launches[i]["stop"]
        epoch, step = (stop["epoch"] + 1, 0) if stop["last"] else (stop["epoch"], stop["step"])
        assert (r["ranks_before"], r["ranks_after"]) == (worlds[i], worlds[i + 1])
        assert r["resumed_at"] == {"epoch": epoch, "step": step}
        before = Counter(x for j in range(i + 1) for x in flat(parts[j].get(epoch, [])))
        after = parts[i + 1].get(epoch, [])
        assert r["received_before"] == [len(flat([x])) for x in parts[i].get(epoch, [])]
        assert r["received_after"] == [len(flat([x])) for x in after]
        assert r["repeated"]["ids"] == sorted((before & Counter(flat(after))).elements())
    # A sample lost at a restart: one that restart's skip_first_batches jumped over (the first
    # `step` batches of each rank of the new launch's fresh loader), and that no launch of the
    # chain received in that epoch; it counts at the first restart that jumped over it. Where
    # an epoch had more than one restart, the report may leave them unattributed (None): after
    # epoch 0 (a launch that resumed there walks it as its loader's first pass), or where a
    # launch of that epoch dealt another order than the uninterrupted run's.
    lost_so_far: dict[int, set] = {}
    resumed_in = [None] + [r["resumed_at"]["epoch"] for r in result["restarts"]]
    for i, r in enumerate(result["restarts"]):
        epoch, step = r["resumed_at"]["epoch"], r["resumed_at"]["step"]
        world = worlds[i + 1]
        jumped = set()
        if step:
            for rank in range(world):
                fresh = ids_of(library_loader(n, b, world, rank))
                jumped |= {x for batch in fresh[:step] for x in batch}
        received = {x for j in range(len(parts)) for x in flat(parts[j].get(epoch, []))}
        lost = (jumped - received) - lost_so_far.setdefault(epoch, set())
        lost_so_far[epoch] |= lost
        if r["skipped"] is None:
            restarts_here = [x for x in result["restarts"] if x["resumed_at"]["epoch"] == epoch]
            # launch j walks epoch e as its loader's pass e - (the epoch it resumed in); its
            # order (accelerate deals global batch k to rank k mod W) against the uninterrupted
            # run's, before the fill
            other_pass = [j for j in range(1, len(parts)) if epoch in parts[j]
                          and dealt(uninterrupted(n, b, worlds[j], epoch - resumed_in[j] + 1)
                                    [epoch - resumed_in[j]])[:n] != dealt(refs[w0][epoch])[:n]]
            assert len(restarts_here) > 1 and (other_pass or epoch > 0), (i, r)
        else:
            assert r["skipped"]["ids"] == sorted(lost), (i, r)


# ---------------------------------------------------------------------------------------------
# Bad input: one Error line, exit 2, before any rank starts.


# ---------------------------------------------------------------------------------------------
# Real ranks (2 and 3 gloo ranks; N = 80, batch 4: 10 steps per rank on 2 ranks, by hand).


@pytest.mark.parametrize("strategy,stops,steps,ok", [
    # 5 steps per rank on 2 ranks; resumed at step 2 in the same epoch: skip and stateful go
    # on to 5, restart walks the whole epoch again from step 2 on, to 2 + 5 = 7 (by hand)
    ("skip", "0:2,0:5", {2: 5}, True),
    ("skip", "0:2,0:6", {2: 5}, False),
    ("restart", "0:2,0:7", {2: 5}, True),
    ("restart", "0:2,0:8", {2: 5}, False),
    # the second stop in the next epoch, reached by a launch on 3 ranks: 4 steps there
    ("skip", "0:2,1:4", {2: 5, 3: 4}, True),
    ("skip", "0:2,1:5", {2: 5, 3: 4}, False),
])
def test_later_stops_are_checked_on_the_size_that_reaches_them(strategy, stops, steps, ok):
    from sharddemo.commands.resume import validate_later_stops
    from sharddemo.errors import UsageError
    from sharddemo.options import ResumePlan

    sizes = "3,2" if 3 in steps else None  # (the restart after the first stop on 3 ranks)
    plan = ResumePlan.parse(stops, strategy, 2, sizes)
    epochs = {size: [{"epoch": e, "ranks": [{"steps": n}] * size} for e in (0, 1)]
              for size, n in steps.items()}
    if ok:
        validate_later_stops(plan, epochs, 2)
    else:
        with pytest.raises(UsageError, match="an epoch of this loader has"):
            validate_later_stops(plan, epochs, 2)
