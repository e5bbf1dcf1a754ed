"""A loader that raises inside a library (accelerate, torch) on every rank is the mode's
finding, not a failed run; on some ranks only, the launch still ends with every rank stopped.

The expected exceptions come from the libraries themselves: accelerate's prepared dispatched
loader walked on real ranks (tests/scripts/library_raise_ranks.py), and, for the sweep, as rank
0 of W ranks in one process (tests/scripts/accelerate_fake_rank.py); torch's default_collate
called here."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
from support.oracle import torch_collate_error
from support.launch import FACTORIES, ROOT, SCHEMA, accelerate_launch, audit, launch_env, sharddemo
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sharddemo.analysis import build_report
from sharddemo.plot import plot_report
from sharddemo.render import render_markdown, render_table

DISPATCH_CAUSE = "accelerate's dispatcher cannot dispatch an epoch with no full global batch"


def one_line(text: str) -> str:
    """An exception's message as the report quotes it: on one line."""
    return " ".join(text.split())


# -- the sweep: accelerate as rank 0 of W ranks, one process per world size -------------------

class FakeRank:
    """tests/scripts/accelerate_fake_rank.py, started once: one JSON case in, one JSON answer out."""

    def __init__(self, world: int, proc: subprocess.Popen) -> None:
        self.world, self.proc = world, proc

    def ask(self, case: dict) -> dict:
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the fake rank ended at {case}"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.write("\n")  # an empty line: it exits
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail("the fake rank did not exit at the end of its input")


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def fake_rank(request):
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "scripts" / "accelerate_fake_rank.py"),
                             str(request.param)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=launch_env(), cwd=ROOT)
    rank = FakeRank(request.param, proc)
    yield rank
    rank.close()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(n=8, b=6, drop_last=True, dispatch=True, split=False)  # the reported command
@example(n=5, b=6, drop_last=True, dispatch=True, split=True)
@given(n=st.integers(1, 64), b=st.integers(1, 16), drop_last=st.booleans(),
       dispatch=st.booleans(), split=st.booleans())
def test_every_combination_where_accelerate_raises_is_a_finding_with_its_cause(
        fake_rank, n, b, drop_last, dispatch, split):
    """Wherever accelerate's prepared loader raises (rank 0's pass decides it for every rank
    under dispatch_batches), sharddemo takes it for a library's exception (a finding, not a
    failed run: errors.library_error is not None), quotes the library's own words on one line,
    and explains it with the case's own numbers."""
    w = fake_rank.world
    if split and b % w:
        return  # accelerate refuses split_batches there when it prepares the loader
    got = fake_rank.ask({"n": n, "b": b, "drop_last": drop_last, "dispatch": dispatch,
                         "split": split})
    if "type" not in got:
        return
    assert got["line"] is not None, got  # raised inside a library: the mode's finding
    assert got["frame"].startswith("accelerate."), got
    assert got["line"].startswith(f"{got['type']}: {one_line(got['message'])}"), got
    assert DISPATCH_CAUSE in got["line"], f"an accelerate error without a known cause: {got}"
    # the arithmetic, in the case's numbers (split: the global batch is --batch-size itself)
    how = (f"N = {n} < the global batch {b} (split_batches)" if split
           else f"N = {n} < {w} ranks x {b}")
    assert how in got["line"], got


def test_the_sweeps_own_examples_raise_inside_accelerate(fake_rank):
    """The sweep above passes over a case where accelerate does not raise: its two examples
    must raise (FACTS, "accelerate 1.16.0 raises where an epoch is empty": dispatch_batches,
    drop_last and fewer samples than one global batch; 8 < W x 6, and 5 < the split global
    batch 6), so the sweep cannot pass without checking anything."""
    for case in ({"n": 8, "b": 6, "drop_last": True, "dispatch": True, "split": False},
                 {"n": 5, "b": 6, "drop_last": True, "dispatch": True, "split": True}):
        if case["split"] and case["b"] % fake_rank.world:
            continue  # (accelerate refuses split_batches there before any pass)
        got = fake_rank.ask(case)
        assert "type" in got and got["line"] is not None, (case, got)
        assert DISPATCH_CAUSE in got["line"], got


# -- real ranks: accelerate's loader and sharddemo's walk of the same mode --------------------

@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"raises{request.param}") / "raises.json"
    accelerate_launch(["tests/scripts/library_raise_ranks.py", str(out)], nproc=request.param,
                      timeout=240)
    data = json.loads(out.read_text())
    assert data["world"] == request.param and data["backend"] == "gloo"
    return data


def library_raised(result: dict) -> bool:
    return any("type" in outcome for outcome in result["library"])


def test_every_rank_raises_what_accelerate_raises_and_the_trace_carries_it(ranks):
    w = ranks["world"]
    raising = [r for r in ranks["results"] if library_raised(r)]
    assert raising, "the grid holds the reported case (8 < W x 6 with drop_last and dispatch)"
    for result in ranks["results"]:
        case, library, trace = result["case"], result["library"], result["trace"]
        if not library_raised(result):
            # walked as usual, and each rank received the batches accelerate's loader gives
            assert "raised" not in trace and len(trace["epochs"]) == 2, case
            got = [[len(b) for b in r["batches"]] for r in trace["epochs"][0]["ranks"]]
            assert got == [o["sizes"] for o in library], case
            continue
        assert all("type" in o for o in library), f"accelerate raised on some ranks only: {case}"
        raised = trace["raised"]
        assert [r["rank"] for r in raised] == list(range(w)), case
        for entry, outcome in zip(raised, library):
            assert entry["error"].startswith(f"{outcome['type']}: "
                                             f"{one_line(outcome['message'])}"), case
            assert (entry["epoch"], entry["step"]) == (0, 0), case
        assert trace["epochs"] == [], case
        # the report: the mode's finding, a broken promise naming it
        per_rank = case["b"] // w if case["split"] else case["b"]
        report = build_report({"world_size": w, "backend": "gloo", "dataset_size": case["n"],
                               "batch_size": case["b"], "global_batch": per_rank * w,
                               "epochs": 2, "seed": 42, "options": {},
                               "modes": {"prepared": trace}})
        jsonschema.validate(report, SCHEMA)
        mode = report["modes"]["prepared"]
        assert mode["broken_promises"] and mode["broken_promises"][0].startswith(
            "prepared epoch 0: the loader raised inside accelerate on every rank"), case
        assert DISPATCH_CAUSE in mode["conclusion"], case


def the_reported_case(ranks) -> dict:
    """What accelerate's own loader raised on each rank at N = 8, B = 6, drop_last, dispatch."""
    for result in ranks["results"]:
        if result["case"] == {"n": 8, "b": 6, "drop_last": True, "dispatch": True,
                              "split": False}:
            return result
    raise AssertionError("the reported case is not in the grid")


def test_compare_reports_the_raise_as_the_modes_finding(ranks, tmp_path):
    """The reported command (8 samples, batch 6, drop_last, dispatch; at W = 2 and 3), with a second mode: both are reported; --check
    exits 1 naming the mode; JSON, table, markdown and --plot show it."""
    w = ranks["world"]
    library = the_reported_case(ranks)["library"]
    png = tmp_path / "raised.png"
    proc = sharddemo(["compare", "--source", "toy", "--modes", "prepared,sampler",
                      "--num-processes", str(w), "--dataset-size", "8", "--batch-size", "6",
                      "--drop-last", "--dispatch-batches", "--format", "json", "--check",
                      "--plot", str(png)], check=False)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(
        "Error: broken promise(s): prepared epoch 0: the loader raised inside accelerate on "
        "every rank"), proc.stderr
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    mode = report["modes"]["prepared"]
    assert [r["rank"] for r in mode["raised"]] == list(range(w))
    for entry, outcome in zip(mode["raised"], library):
        assert entry["error"].startswith(f"{outcome['type']}: {one_line(outcome['message'])}")
        # the cause in words, with the arithmetic, and what to do
        assert (f"{DISPATCH_CAUSE}: N = 8 < {w} ranks x 6 with drop_last; use at least "
                f"{w * 6} samples, drop_last=False, or dispatch_batches=False") in entry["error"]
    assert len(report["modes"]["sampler"]["epochs"]) == 2  # the other mode is still walked
    table, markdown = render_table(report), render_markdown(report)
    assert f"  => {mode['conclusion']}" in table and f"**{mode['conclusion']}**" in markdown
    assert "  !! prepared epoch 0: the loader raised" in table
    assert "- broken: prepared epoch 0: the loader raised" in markdown
    assert png.stat().st_size > 0


def test_audit_reports_the_raise_as_the_loaders_finding(ranks):
    w = ranks["world"]
    library = the_reported_case(ranks)["library"]
    proc = audit(f"{FACTORIES}:dispatch_empty_epoch", nproc=w)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == ["Error: verdict(s) failed: loader-runs-every-epoch (epoch 0)"], proc.stderr
    mode = json.loads(proc.stdout)["modes"]["audit"]
    assert mode["epochs"] == [] and [r["rank"] for r in mode["raised"]] == list(range(w))
    for entry, outcome in zip(mode["raised"], library):
        assert entry["error"].startswith(f"{outcome['type']}: {one_line(outcome['message'])}")
        assert f"N = 8 < {w} ranks x 6 with drop_last" in entry["error"]
    [verdict] = mode["verdicts"]
    assert verdict["verdict"] == "loader-runs-every-epoch" and not verdict["ok"]
    assert DISPATCH_CAUSE in verdict["detail"] and DISPATCH_CAUSE in mode["conclusion"]


# -- torch raising mid-epoch: on every rank (a finding), on one rank (a failed run) -----------


@pytest.mark.parametrize("gather", ["batch", "epoch"])
def test_torch_raising_mid_epoch_on_every_rank_is_quoted_with_its_frame(gather, tmp_path):
    exc, frame = torch_collate_error()
    assert frame.startswith("torch.")
    proc = audit(f"{FACTORIES}:collate_fails_everywhere", "--gather", gather, "--expect",
                 "replicated")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == "Error: verdict(s) failed: loader-runs-every-epoch (epoch 1)"
    mode = json.loads(proc.stdout)["modes"]["audit"]
    # epoch 0 completed and is reported; epoch 1 raised at its step 1 (fetches 9 and 10)
    assert [e["epoch"] for e in mode["epochs"]] == [0]
    assert all(v["ok"] for v in mode["verdicts"] if v["epoch"] == 0)
    for entry in mode["raised"]:
        assert (entry["epoch"], entry["step"], entry["frame"]) == (1, 1, frame)
        # no known cause: the library's words on one line, and the frame it came from
        assert entry["error"] == f"RuntimeError: {one_line(str(exc))} (raised in {frame})"
    assert mode["conclusion"].startswith("The loader raised inside torch on every rank at "
                                         "epoch 1, step 1, where the walk stopped")
    # the table, markdown and plot show the epoch before it and the raise
    report = json.loads(proc.stdout)
    table = render_table(report)
    assert "  epoch 0" in table and f"  => {mode['conclusion']}" in table
    assert f"**{mode['conclusion']}**" in render_markdown(report)
    drawn = plot_report(report, str(tmp_path / "raised.png"))
    assert [e["epoch"] for e in drawn["audit"]] == [0]


def test_torch_raising_on_one_rank_still_stops_every_rank():
    exc, _ = torch_collate_error()
    proc = sharddemo(["audit", f"{FACTORIES}:collate_fails_on_rank_1", "--num-processes", "2"],
                     check=False)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0] == (f"Error: rank 1: epoch 1 of the loader raised RuntimeError: "
                        f"{one_line(str(exc))}"), lines[0]
    # rank 0 stopped too (walk.settle told it; PeerRaised), so the launch ended, and the line
    # leaves it out: it only stopped because rank 1 raised
