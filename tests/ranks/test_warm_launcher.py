"""The warm launcher (tests/support/warm.py) against the real `accelerate launch` and
`torchrun`: each rank of a warm launch sees what a rank of the real launch sees (its launch
variables, its accelerate state, a working gloo group, its own seeds, its argv, path and
working folder), and a rank's failure fails the launch as the real launchers' does; a
`sharddemo` command run warm reports what it reports with the real launcher, and its ranks end
with it."""

from __future__ import annotations

import json
import os
import subprocess
import time

import psutil
import pytest
from support.launch import FACTORIES, ROOT, SCRIPTS, accelerate_launch, launch_env, sharddemo, \
    torchrun

PROBE = str(SCRIPTS / "launch_probe.py")


def probes(out, nproc):
    return [json.loads((out / f"probe{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_warm_rank_sees_what_an_accelerate_launched_rank_sees(tmp_path, nproc):
    seen = {}
    for warm in (True, False):
        out = tmp_path / str(warm)
        out.mkdir()
        accelerate_launch([PROBE, str(out)], nproc=nproc, warm=warm)
        seen[warm] = probes(out, nproc)
    for r in range(nproc):
        warm, real = seen[True][r], seen[False][r]
        assert warm["env"] == real["env"], r
        assert warm["state"] == real["state"]  # (the device too: accelerate's, as it names it)
        assert real["state"][:3] == ["DistributedType.MULTI_CPU", nproc, r]
        assert real["state"][4] == "gloo"
        assert warm["gathered"] == real["gathered"] == list(range(nproc))
        assert warm["argv"] == [str(tmp_path / "True")] and real["argv"] == [str(tmp_path / "False")]
        assert warm["main"] == real["main"] == "__main__"
        assert warm["path0"] == real["path0"] == str(SCRIPTS)
        assert warm["cwd"] == real["cwd"] == str(ROOT)
    # every process draws its own seeds (torch 2.13 seeds each process at random; Python's and
    # numpy's from the OS): no two ranks of either launch, nor the two launches, share one
    for k in range(3):
        draws = [p["draws"][k] for launch in seen.values() for p in launch]
        assert len(set(draws)) == len(draws), k


def test_a_warm_torchrun_rank_sees_what_a_torchrun_rank_sees(tmp_path):
    seen = {}
    for warm in (True, False):
        out = tmp_path / str(warm)
        out.mkdir()
        torchrun([PROBE, out], nproc=2, warm=warm)
        seen[warm] = probes(out, 2)
    for r in range(2):
        assert seen[True][r]["env"] == seen[False][r]["env"]
        assert seen[True][r]["state"] == seen[False][r]["state"]


@pytest.mark.parametrize("warm", [True, False])
def test_a_rank_that_exits_with_an_error_fails_the_launch(tmp_path, warm):
    """Rank 1 exits 3 after the group's last collective: the launch exits 1 (torchrun's agent:
    a failed rank fails the launch), and rank 0's work is there."""
    proc = accelerate_launch([PROBE, str(tmp_path), "--exit-on", "1:3"], warm=warm, check=False)
    assert proc.returncode == 1
    assert len(probes(tmp_path, 2)) == 2


def without_timings(report: dict) -> dict:
    """A report less what differs between any two launches: how long each part took."""
    return {k: v for k, v in report.items() if k != "timings"}


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_warm_command_reports_what_the_real_command_reports(nproc):
    """`sharddemo compare` whose `accelerate launch` forks its ranks from the warm server
    (support/warm_cli.py) gives the report the real launcher's ranks give, byte for byte but
    for the timings: the ranks' ids, world size, backend, device and placement."""
    args = ["compare", "--format", "json", "--num-processes", str(nproc), "--modes",
            "sampler,replicated,prepared", "--epochs", "2", "--dataset-size", "10"]
    warm = json.loads(sharddemo(args, warm=True).stdout)
    real = json.loads(sharddemo(args, warm=False).stdout)
    assert real["world_size"] == nproc and real["backend"] == "gloo"
    assert without_timings(warm) == without_timings(real)


def test_a_warm_commands_ranks_end_with_it():
    """SIGKILL to a warm `sharddemo audit` (its client, the stand-in for `accelerate launch`,
    dies with it: the command's own parent-death signal) ends the ranks the server forked for
    it, as the launcher's death ends a real launch's ranks."""
    from support.warm import server, warm_command

    srv = psutil.Process(server().pid)
    before = {p.pid for p in srv.children()}
    proc = subprocess.Popen(warm_command(["audit", f"{FACTORIES}:stall_mid_epoch", "--timeout",
                                          "600"]),
                            cwd=ROOT, env=launch_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        forked: list = []
        while time.monotonic() < deadline and len(forked) < 3:  # (the store and 2 ranks)
            time.sleep(0.2)
            forked = [p for p in srv.children() if p.pid not in before]
        assert len(forked) == 3, "the warm launch did not start within 60 s"
        time.sleep(2)  # (into the walk: rank 1 stalls there)
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs(forked, timeout=10)
        assert not alive, f"still running 10 s after the command was killed: {alive}"
    finally:
        proc.kill()
        proc.wait()


def test_a_warm_rank_that_stays_in_its_script_runs_again_on_the_real_launcher(
        tmp_path, tmp_path_factory, monkeypatch):
    """Rank 1 stays in its script after the group's end, the first time only (as a rank hung
    in a DDP model's teardown does): the server ends the warm launch once rank 0's script has
    ended STRAGGLER_S before, says so in a warning, and the launch runs again on the real
    launcher on its folder as it was before the warm one (each rank's file holds one line: the
    real run's, not the warm run's too)."""
    import support.warm as warm

    monkeypatch.setattr(warm, "STRAGGLER_S", 3)
    out = tmp_path / "out"
    out.mkdir()
    # (the marker outside the launch's folder, and named relative to the checkout, so that
    # the snapshot of its folders neither sees nor restores it: the real run finds it)
    marker = tmp_path_factory.mktemp("marker") / "hung-once"
    script = str(SCRIPTS / "straggler_loop.py")
    started = time.monotonic()
    with pytest.warns(UserWarning, match="warm launch hung in a rank's end; run again"):
        proc = torchrun([script, str(out), os.path.relpath(marker, ROOT)], timeout=120)
    assert proc.returncode == 0
    assert "torchrun (warm)" not in proc.args  # (the real torchrun's)
    assert marker.exists()
    assert [(out / f"rank{r}.txt").read_text() for r in (0, 1)] == ["ran\n", "ran\n"]
    assert time.monotonic() - started < 90  # (ended by the rule, not by the 120 s timeout)
