"""Issue 42 in `audit --resume-at`: chains of stops and restarts, a changed world size, saves at
an epoch's edge.

Two layers. In one process (hypothesis): chains of a seeded prepared loader that this file
walks itself as a training loop does (accelerate's `prepare_data_loader` for each rank,
`skip_first_batches` after each restart, a fresh loader in each launch), handed to the
comparison (sharddemo.analysis.resume.compare_chain); every expected value is worked out here
from the ids those library loaders gave, never from sharddemo's code. On real gloo ranks: a few
chains through `sharddemo audit --resume-at`, with the ids checked against the same library
loaders built in this process, or against literals worked out by hand."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest import ROOT, sharddemo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FACTORIES = str(ROOT / "tests" / "factories.py")
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


# ---------------------------------------------------------------------------------------------
# The loop, written here against accelerate alone.

def library_loader(n: int, b: int, world: int, rank: int):
    """One rank's loader as every launch builds it: set_seed(0), a shuffled DataLoader of ids
    0..n-1, prepared for `world` ranks with the rng sync an Accelerator uses."""
    import torch
    from accelerate.data_loader import prepare_data_loader
    from accelerate.utils import set_seed
    from oracle import ACCELERATOR_RNG_TYPES, ensure_accelerator_state
    from torch.utils.data import DataLoader, TensorDataset

    ensure_accelerator_state()
    set_seed(0)
    return prepare_data_loader(DataLoader(TensorDataset(torch.arange(n)), batch_size=b,
                                          shuffle=True), num_processes=world, process_index=rank,
                               put_on_device=False, rng_types=list(ACCELERATOR_RNG_TYPES))


def ids_of(batches) -> list[list[int]]:
    return [batch[0].tolist() for batch in batches]


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


def uninterrupted(n, b, world, epochs):
    out = {}
    for rank in range(world):
        loader = library_loader(n, b, world, rank)
        for epoch in range(epochs):
            out.setdefault(epoch, []).append(ids_of(loader))
    return out


def trace(world, epochs, stop):
    return {"world_size": world, "stop": stop,
            "epochs": [{"epoch": e, "ranks": [{"rank": r, "batches": b}
                                               for r, b in enumerate(ranks)]}
                       for e, ranks in sorted(epochs.items())]}


def dealt(ranks) -> list[int]:
    """An epoch's ids in the order accelerate dealt them: global batch k went to rank k mod W."""
    return [i for k in range(max(len(b) for b in ranks)) for batches in ranks
            if k < len(batches) for i in batches[k]]


def flat(ranks) -> list[int]:
    return [i for batches in ranks for batch in batches for i in batch]


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

@pytest.mark.parametrize("args,message", [
    (["--resume-at", "0:7,0:3"], "the stops are out of order (0:3 comes before 0:7"),
    (["--resume-at", "1:0,0:last"], "the stops are out of order"),
    (["--resume-at", "0:3,0:7", "--resume-num-processes", "3"],
     "gives 1 world size(s) for 2 restart(s)"),
    (["--resume-at", "0:3", "--resume-num-processes", "3,2"],
     "gives 2 world size(s) for 1 restart(s)"),
    (["--resume-at", "0:3", "--resume-num-processes", "0"], "at least 1"),
    (["--resume-at", "0:3,0:first"], "'0:first' is not EPOCH:STEP"),
    (["--resume-at", "0:3,2:last"], "2:last stops in epoch 2, beyond --epochs 2"),
])
def test_a_chain_that_cannot_run_is_one_error_line_before_any_rank(args, message):
    proc = sharddemo(["audit", f"{FACTORIES}:seeded_80", *args], check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines
    assert "--resume" in lines[0]


# ---------------------------------------------------------------------------------------------
# Real ranks (2 and 3 gloo ranks; N = 80, batch 4: 10 steps per rank on 2 ranks, by hand).

def resume_audit(target, *args, nproc=2, env=None):
    import jsonschema

    proc = sharddemo(["audit", f"{FACTORIES}:{target}", "--num-processes", str(nproc),
                      "--format", "json", *args], check=False, env=env)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    return proc, report


def logged_launches(folder) -> list[list[list[int]]]:
    """[launch][rank] -> the ids each rank's dataset was asked for (factories.Logged), the
    launches in the order they started."""
    launches: dict[str, dict[int, tuple]] = {}
    for path in folder.iterdir():
        start, launcher, rank = path.stem.split("-")
        ids = [int(line) for line in path.read_text().split()]
        launches.setdefault(launcher, {})[int(rank)] = (int(start), ids)
    ordered = sorted(launches.values(), key=lambda ranks: min(s for s, _ in ranks.values()))
    return [[ranks[r][1] for r in sorted(ranks)] for ranks in ordered]


def test_an_unseeded_chain_of_two_restarts_counts_every_sample_each_restart_repeated(tmp_path):
    """Issue 42, wrong 1: 0:3 then 0:7 in one epoch, no seed. Launches, in order: the stop at
    0:3, the uninterrupted run, the restart that stops at 0:7, the last restart. The ids each
    loop received are its dataset's requests (a prepared loader asks for one batch ahead, so a
    stopped launch's requests past its stop were never received: only the first STEP x 4 count)."""
    env = {"SHARDDEMO_TEST_LOG_DIR": str(tmp_path)}
    import os

    env = {**os.environ, **env}
    proc, report = resume_audit("unseeded_logged_80", "--resume-at", "0:3,0:7", env=env)
    resume = report["modes"]["audit"]["resume"]
    stop, reference, middle, last = logged_launches(tmp_path)
    # per rank (by hand): 3 steps x 4 before 0:3, 4 x 4 from step 3 to 7, 3 x 4 after 7, then
    # epoch 1 whole (10 x 4)
    parts = [[ids[:12] for ids in stop], [ids[:16] for ids in middle],
             [ids[:12] for ids in last]]
    epoch0 = Counter(i for launch in parts for ids in launch for i in ids)
    epoch1 = Counter(i for ids in last for i in ids[12:52])
    ref0 = Counter(i for ids in reference for i in ids[:40])
    ref1 = Counter(i for ids in reference for i in ids[40:80])
    assert ref0 == ref1 == Counter(range(80))  # the uninterrupted run: every id once an epoch
    e0, e1 = resume["epochs"]
    assert e0["seen"] == sum(epoch0.values()) == 80
    assert e0["repeated"]["ids"] == sorted((epoch0 - ref0).elements())
    assert e0["skipped"]["ids"] == sorted((ref0 - epoch0).elements())
    assert e1["repeated"]["ids"] == sorted((epoch1 - ref1).elements()) == []
    assert [e["received"] for e in e0["launches"]] == [24, 32, 24]
    first, second = resume["restarts"]
    before1 = Counter(i for ids in parts[0] for i in ids)
    assert first["repeated"]["ids"] == sorted((Counter(i for ids in parts[1] for i in ids)
                                               & before1).elements())
    before2 = before1 + Counter(i for ids in parts[1] for i in ids)
    assert second["repeated"]["ids"] == sorted((Counter(i for ids in parts[2] for i in ids)
                                                & before2).elements())
    assert (first["received_before"], first["received_after"]) == ([12, 12], [16, 16])
    assert (second["received_before"], second["received_after"]) == ([16, 16], [12, 12])
    assert first["skipped"] is None and not resume["deterministic"]  # no common order
    assert resume["world_sizes"] == [2, 2, 2] and proc.returncode == 1
    assert "restart 1 after 0:3" in resume["explanation"]
    assert "restart 2 after 0:7" in resume["explanation"]


def test_resumed_on_3_ranks_the_new_sizes_fill_is_fill_and_the_next_epoch_passes():
    """Issue 42, wrong 2: a 2-rank checkpoint (0:3) resumed on 3 ranks. Expected from
    accelerate's own loaders in this process: the first 3 batches of each of 2 ranks, then
    skip_first_batches(loader, 3) of each of 3 ranks, then epoch 1 of the same loaders."""
    from accelerate.data_loader import skip_first_batches

    proc, report = resume_audit("seeded_80", "--resume-at", "0:3", "--resume-num-processes",
                                "3")
    resume = report["modes"]["audit"]["resume"]
    before = [ids_of(library_loader(80, 4, 2, r))[:3] for r in range(2)]
    after, epoch1 = [], []
    for r in range(3):
        loader = library_loader(80, 4, 3, r)
        after.append(ids_of(skip_first_batches(loader, 3)))
        epoch1.append(ids_of(loader))
    ref2, ref3 = uninterrupted(80, 4, 2, 2), uninterrupted(80, 4, 3, 2)
    got = Counter(flat(before) + flat(after))
    base = Counter(flat(ref2[0]))
    fill3 = Counter(flat(ref3[0])) - base  # the 3-rank loader's own even_batches fill
    assert sum(fill3.values()) == 4  # by hand: 20 batches dealt to 3 ranks, 7 each, 1 filled
    e0, e1 = resume["epochs"]
    assert e0["repeated"]["ids"] == sorted((got - base).elements())  # 4, all fill
    assert e0["skipped"]["ids"] == sorted((base - got).elements())  # 12
    assert e0["fill"] == {"world_size": 3, "repeated": sum((fill3 & (got - base)).values()),
                          "skipped": 0}
    assert not e0["resume_exact"]
    # epoch 1, wholly on 3 ranks: what the 3-rank loaders dealt, its fill explained as fill
    assert [r["batches"] for r in e1["ranks"]] == epoch1 == ref3[1]
    assert e1["repeated"]["count"] == 4 and e1["fill"]["repeated"] == 4
    assert e1["resume_exact"] and e1["order_equal"] is True
    (restart,) = resume["restarts"]
    # skip_first_batches counts batches of the new size: 3 x 3 x 4 = 36 slots for 24 received
    assert "3 x 3 rank(s) x 4 = 36 sample slot(s), where the run had received 24" \
        in restart["reason"]
    assert restart["skipped"]["ids"] == e0["skipped"]["ids"]
    assert resume["world_sizes"] == [2, 3]


def test_a_save_after_the_epochs_last_step_resumes_at_the_next_epoch():
    """Issue 42, wrong 3: saved inside the loop after epoch 0's last step (0:last, step 10 on
    2 ranks by hand), resumed as accelerate's examples do: the next epoch, skip 0. Nothing of
    epoch 0 comes again and epoch 1 is not skipped; a fresh loader's first pass is epoch 0's
    order again (accelerate's own loader, built again in this process), which the report says."""
    proc, report = resume_audit("seeded_80", "--resume-at", "0:last")
    resume = report["modes"]["audit"]["resume"]
    (restart,) = resume["restarts"]
    assert (restart["epoch"], restart["step"], restart["last"]) == (0, 10, True)
    assert restart["resumed_at"] == {"epoch": 1, "step": 0}
    e0, e1, e2 = resume["epochs"]
    assert e0["resume_exact"] and e0["seen"] == 80
    fresh = [ids_of(library_loader(80, 4, 2, r)) for r in range(2)]
    ref = uninterrupted(80, 4, 2, 2)
    assert [r["batches"] for r in e1["ranks"]] == fresh != ref[1]
    assert e1["seen"] == 80 and e1["whole"] is None
    assert e1["repeated"]["count"] == e1["skipped"]["count"] == 0
    assert e1["order_equal"] is False
    assert "counts its epochs from 0" in resume["explanation"]


@pytest.mark.parametrize("sizes,message", [
    # seeded_40 on 2 ranks: 10 batches of 4, 5 steps per rank (by hand)
    ("2,2", "0:99: an epoch of this loader has 5 steps per rank on 2 rank(s)"),
    # resumed on 3 ranks: accelerate's even_batches deals ceil(10 / 3) = 4 steps per rank
    ("3,3", "0:99: an epoch of this loader has 4 steps per rank on 3 rank(s)"),
])
def test_a_later_stop_past_its_epochs_end_is_one_error_line_before_any_restart(
        tmp_path, sizes, message):
    """A stop after the first, past the end of its epoch on the world size of the launch that
    reaches it: known once the first launch and the uninterrupted runs have walked (the epoch's
    steps on each size), said then, before any restart's ranks start: the factory is called by
    the first launch and the uninterrupted runs alone (one line per rank per launch, its
    world size), and no report is written."""
    from conftest import launch_env

    env = launch_env()
    env["SHARDDEMO_TEST_COUNTER_DIR"] = str(tmp_path)
    out = tmp_path / "report.json"
    proc = sharddemo(["audit", f"{FACTORIES}:counts_its_launches_40", "--resume-at", "0:2,0:99",
                      "--resume-num-processes", sizes, "--format", "json", "--output", str(out)],
                     check=False, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines
    calls = sorted((tmp_path / "launches").read_text().split())
    # the stopping launch and the uninterrupted run on 2 ranks, and on 3 where a restart is
    expected = ["2"] * 4 + (["3"] * 3 if sizes == "3,3" else [])
    assert calls == expected and not out.exists()


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
    from sharddemo.commands.resume import check_later_stops
    from sharddemo.errors import UsageError
    from sharddemo.options import ResumePlan

    sizes = "3,2" if 3 in steps else None  # (the restart after the first stop on 3 ranks)
    plan = ResumePlan.parse(stops, strategy, 2, sizes)
    epochs = {size: [{"epoch": e, "ranks": [{"steps": n}] * size} for e in (0, 1)]
              for size, n in steps.items()}
    if ok:
        check_later_stops(plan, epochs, 2)
    else:
        with pytest.raises(UsageError, match="an epoch of this loader has"):
            check_later_stops(plan, epochs, 2)
