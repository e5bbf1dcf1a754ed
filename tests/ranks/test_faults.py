"""Reliability on real gloo ranks: a rank that raises, is killed, or stalls; Ctrl-C; busy
ports; ragged batches. Each case fails fast with one clear line and leaves no process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from support.launch import ROOT, launch_env
from support.launch import sharddemo as any_sharddemo
from support.processes import assert_nothing_left, survivors, tagged_env

from sharddemo.options import DEFAULT_TIMEOUT


def sharddemo(args, **kwargs):
    """The command with the real `accelerate launch` (faults are read from what the launcher
    says, and its processes are the ones to end): never the warm launcher's ranks."""
    return any_sharddemo(args, warm=False, **kwargs)


FACTORIES = str(ROOT / "tests" / "support" / "factories.py")


def one_error(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


# Seconds a rank may wait on a collective in the tests of a rank that raises or is killed: the
# whole command must end before one such wait could have passed (the others learn of the
# failure from the launcher, not by timing out).
FAULT_TIMEOUT = 30


@pytest.mark.parametrize("args,expected", [
    (["audit", f"{FACTORIES}:raise_mid_epoch"],
     "Error: rank 1: epoch 0 of the loader raised ValueError: corrupt sample"),
    (["compare", "--modes", "prepared,sampler"],
     "Error: rank 1: mode sampler, epoch 1: ValueError: injected fault"),
])
def test_a_rank_that_raises(args, expected):
    env, token = tagged_env("raise:1:sampler:1")
    start = time.monotonic()
    proc = sharddemo([*args, "--timeout", str(FAULT_TIMEOUT)], check=False, env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    line = one_error(proc)
    assert line.startswith(expected), line
    if args[0] == "compare":  # what completed before the failure
        assert "its epoch 0 completed (modes completed before it: prepared)" in line
    assert "rank 0 then lost the connection to the failed rank" in line or "rank 0" not in line
    assert elapsed < FAULT_TIMEOUT, f"took {elapsed:.1f}s"
    assert_nothing_left(token)


@pytest.mark.parametrize("args", [
    ["audit", f"{FACTORIES}:kill_mid_epoch"],
    ["compare", "--modes", "replicated"],
])
def test_a_rank_that_is_killed(args):
    env, token = tagged_env("kill:1:replicated:0")
    start = time.monotonic()
    proc = sharddemo([*args, "--timeout", str(FAULT_TIMEOUT)], check=False, env=env)
    assert proc.returncode == 1
    assert one_error(proc).startswith(
        "Error: rank 1 was killed by signal 9 (SIGKILL) and said nothing")
    assert time.monotonic() - start < FAULT_TIMEOUT
    assert_nothing_left(token)


@pytest.mark.parametrize("args", [
    # compare's ranks wait on the same collectives with the same timeout, and the signal
    # tests below stall compare's rank 1 the same way
    ["audit", f"{FACTORIES}:stall_mid_epoch", "--timeout", "4"],
])
def test_a_rank_that_stalls(args):
    env, token = tagged_env("stall:1:sampler:0")
    start = time.monotonic()
    proc = sharddemo(args, check=False, env=env)
    assert proc.returncode == 1
    # Rank 1's 5th fetch stalls (factories.Faulty). Its prepared loader (N = 60, batch 2,
    # no shuffle) deals it global batches 1, 3, 5: [2, 3], [6, 7], [10, 11]; accelerate's
    # DataLoaderShard fetches one batch ahead of what it yields, so it has yielded [2, 3]
    # (fetched with [6, 7], fetches 1-4) and stalls fetching [10, 11] before yielding
    # [6, 7]: the loop received 1 batch.
    line = one_error(proc)
    assert re.fullmatch(r"Error: rank 1 stopped making progress at audit epoch 0, step 1 "
                        r"\(\d+\.\d s before rank 0 gave up\): rank 0 gave up waiting for "
                        r"it at the process-group timeout \(--timeout\)", line), line
    # 13-14 s on an idle machine (start-up, the walk, the 4 s wait). Had --timeout not reached
    # the process group, rank 0 would have waited the default 60 s: a bound under that tells
    # the two apart and leaves start-up room on a busy machine (4 + 15 s left it 5 s).
    assert time.monotonic() - start < DEFAULT_TIMEOUT
    assert_nothing_left(token)


# --timeout of the watchdog tests below: the launch is stopped after 3 x 3 = 9 s without
# progress on any rank (docs/reliability.md), a rank still starting after 60 + 2 x 3 = 66 s.
WATCH_TIMEOUT = 3


def test_a_slow_loader_finishes_however_long_it_walks():
    """A loader that sleeps in every batch walks for longer than the watchdog's bound (and
    longer than any bound on the whole launch of that size), never that long in one step."""
    env, token = tagged_env()
    start = time.monotonic()
    proc = sharddemo(["audit", f"{FACTORIES}:slow_batches", "--epochs", "1",
                      "--timeout", str(WATCH_TIMEOUT)], check=False, env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert "FAIL" not in proc.stdout and "no-missing-samples" in proc.stdout
    # 15 batches a rank of 2 fetches of 0.4 s (factories.slow_batches): the walk alone lasts
    # 12 s, more than the 9 s bound; each step 0.8 s, far within it.
    assert elapsed > 12
    assert_nothing_left(token)


def test_a_rank_that_stalls_mid_epoch_is_named_with_its_last_step():
    """Rank 1 stops after 5 batches (tests/support/faultplugin); rank 0 waits in the next collective,
    gives up at --timeout and says so: the line names rank 1 and where it stopped."""
    env, token = tagged_env("stall:1:sampler:0:5")
    start = time.monotonic()
    proc = sharddemo(["compare", "--modes", "sampler", "--dataset-size", "400",
                      "--batch-size", "4", "--epochs", "1", "--timeout", str(WATCH_TIMEOUT)],
                     check=False, env=env)
    assert proc.returncode == 1
    line = one_error(proc)
    assert re.fullmatch(r"Error: rank 1 stopped making progress at sampler epoch 0, step 5 "
                        r"\(\d+\.\d s before rank 0 gave up\): rank 0 gave up waiting for "
                        r"it at the process-group timeout \(--timeout\)", line), line
    # Without the ranks' own account the watchdog would have stopped it 9 s after the stall;
    # a launch left to the start-up bound alone would take over 66 s.
    assert time.monotonic() - start < 60
    assert_nothing_left(token)


def test_a_launch_where_no_rank_makes_progress_is_stopped_and_says_what_was_seen(tmp_path):
    """Every rank stops after 5 batches, outside any collective (tests/support/faultplugin): no peer
    waits, so only the parent's watchdog can end it, 9 s after the last progress; no report
    is written."""
    env, token = tagged_env("stall:all:sampler:0:5")
    start = time.monotonic()
    proc = sharddemo(["compare", "--modes", "sampler", "--dataset-size", "400",
                      "--batch-size", "4", "--epochs", "1", "--timeout", str(WATCH_TIMEOUT),
                      "--output", str(tmp_path / "report.json")], check=False, env=env)
    assert proc.returncode == 1
    line = one_error(proc)
    ranks = r"rank [01] last made progress at sampler epoch 0, step 5, \d+\.\d s before the stop"
    assert re.fullmatch(r"Error: no rank made progress for \d+ s \(over 9 s, the bound of 3 x "
                        rf"--timeout\) and the launch was stopped; {ranks}; {ranks} \(if one "
                        r"step or the start-up really takes that long, raise --timeout\)",
                        line), line
    assert "rank 0" in line and "rank 1" in line
    assert time.monotonic() - start < 60  # the start-up bound alone: over 66 s
    assert not list(tmp_path.iterdir())
    assert_nothing_left(token)


def test_audit_max_time_still_limits_the_whole_launch():
    """Your own limit on the whole launch (audit --max-time) is kept as given: 2 s, less than
    a launch takes to start here, ends it however its ranks progress."""
    env, token = tagged_env()
    proc = sharddemo(["audit", f"{FACTORIES}:slow_batches", "--max-time", "2"], check=False,
                     env=env)
    assert proc.returncode == 1
    assert one_error(proc).startswith("Error: the launch did not finish within its limit of "
                                      "2 s (--max-time) and was stopped; ")
    assert_nothing_left(token)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("command", ["compare", "audit"])
def test_a_signal_stops_every_process_and_writes_nothing(tmp_path, sig, command):
    """Ctrl-C, SIGTERM or SIGHUP to compare/audit: the launcher and every rank end (they run
    in sessions of their own, out of reach of a process-group kill) within 15 s, one line."""
    if command == "audit" and sig != signal.SIGTERM:
        pytest.skip("one signal is enough for audit: the same launch code")
    interrupt_running_command(tmp_path, sig, command)


def test_ctrl_c_stops_a_command_started_with_sigint_ignored(tmp_path):
    """A process started with SIGINT ignored (a shell without job control starting it in the
    background, some launchers) keeps it ignored unless it installs a handler: compare does,
    for the launch, and stops on SIGINT all the same."""
    interrupt_running_command(tmp_path, signal.SIGINT, "compare",
                              before=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def interrupt_running_command(tmp_path, sig, command, before=None):
    env, token = tagged_env("stall:1:sampler:0")
    out = tmp_path / "report.json"
    args = (["compare", "--modes", "sampler"] if command == "compare"
            else ["audit", f"{FACTORIES}:stall_mid_epoch"])
    proc = subprocess.Popen([sys.executable, "-m", "sharddemo", *args, "--output", str(out)],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=before)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until the ranks are up
        ranks = [p for p in survivors(token)
                 if {"run", "audit-rank"} & set(p.info["cmdline"] or [])]
        if len(ranks) >= 2:
            break
        time.sleep(0.2)
    time.sleep(2)
    proc.send_signal(sig)
    sent = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{command} did not stop within 15 s of {sig.name}")
    assert proc.returncode == 128 + sig, stderr
    assert time.monotonic() - sent < 15
    assert stderr.strip().splitlines() == [
        f"Error: interrupted by {sig.name}; all ranks were stopped and no report was written"]
    assert not out.exists() and not list(tmp_path.iterdir())
    assert_nothing_left(token)


def _alive(pid: int) -> bool:
    """The process runs (a zombie has ended: it only waits for its parent to read it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("command,killed", [("compare", "sharddemo"), ("audit", "launcher")])
def test_a_killed_parent_takes_every_rank_with_it(command, killed):
    """SIGKILL (a CI job's hard timeout, the OOM killer) to sharddemo alone leaves it no time
    to end anything, and the ranks run in sessions of their own: the launcher and the ranks
    must notice themselves. Every process the launch started (sharddemo's descendants, found
    while the ranks walk) ends within 10 s (measured: 0.1 s). `launcher`: the launcher killed
    while sharddemo is stopped (SIGSTOP), so that only the ranks themselves can end the ranks.
    Without it, a killed run's 3 ranks were seen still walking 12 minutes later."""
    env, token = tagged_env()
    # Walks far longer than the test: 2 x 10^7 samples gathered batch by batch, or an audit
    # whose rank 1 stalls (tests/support/factories.py: stall_mid_epoch) under a process-group timeout
    # of 600 s.
    args = (["compare", "--source", "iterable", "--modes", "replicated,prepared",
             "--dataset-size", "20000000", "--batch-size", "8", "--gather", "batch"]
            if command == "compare" else ["audit", f"{FACTORIES}:stall_mid_epoch"])
    proc = subprocess.Popen([sys.executable, "-m", "sharddemo", *args, "--timeout", "600"],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 90
        ranks: list = []
        while time.monotonic() < deadline and len(ranks) < 2:
            time.sleep(0.2)
            # the launcher is sharddemo's child; the ranks are the launcher's
            ranks = [p for p in parent.children(recursive=True)
                     if p.ppid() != proc.pid and "sharddemo" in p.cmdline()]
        assert len(ranks) == 2, "the ranks did not start within 90 s"
        time.sleep(3)  # past the ranks' start, into the walk
        family = parent.children(recursive=True)
        launcher = [p for p in family if p.ppid() == proc.pid]
        assert len(family) >= 3 and len(launcher) == 1, family
        if killed == "sharddemo":
            proc.kill()
            proc.wait()
        else:
            proc.send_signal(signal.SIGSTOP)
            launcher[0].kill()
        start = time.monotonic()
        while any(_alive(p.pid) for p in family) and time.monotonic() - start < 10:
            time.sleep(0.1)
        left = [p.pid for p in family if _alive(p.pid)]
        assert not left, f"still running 10 s after the {killed} was killed: {left}"
    finally:
        proc.kill()
        proc.wait()
        for p in survivors(token):
            p.kill()
    assert_nothing_left(token)


def test_a_launcher_whose_parent_died_before_it_could_ask_stops_at_once():
    """The race the parent-death signal leaves: the parent died between the fork and the
    child's prctl, so the kernel has no parent to watch. The launcher (before it is exec'd)
    and a rank (as it starts) each find that the sharddemo that started them is gone, and exit
    1 without running: here the pid of a process that has ended."""
    from sharddemo.lifeline import launcher_preexec

    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    gone = ended.pid
    code = "print('ran')"
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=launcher_preexec(gone))
    assert (ran.returncode, ran.stdout) == (1, "")
    ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          preexec_fn=launcher_preexec(os.getpid()))
    assert (ours.returncode, ours.stdout) == (0, "ran\n")
    rank = [sys.executable, "-m", "sharddemo", "--help"]
    for ancestor, expected in ((gone, 1), (os.getpid(), 0)):
        env = dict(launch_env(), SHARDDEMO_PARENT_PID=str(ancestor))
        proc = subprocess.run(rank, capture_output=True, text=True, env=env, cwd=ROOT)
        assert proc.returncode == expected, proc.stderr
        assert ("Usage:" in proc.stdout) == (expected == 0)


def test_a_port_taken_before_the_launcher_binds_it_is_retried_once(tmp_path, monkeypatch):
    """free_port() picks a port; another job can take it before torchrun binds it. The first
    launch here is a stand-in that fails as torchrun does then; the retry is the real one."""
    from sharddemo.commands.compare import compare_run
    from sharddemo.options import RunOptions

    fake = tmp_path / "python"
    marker = tmp_path / "first-done"
    fake.write_text(f"""#!/bin/sh
if [ ! -e {marker} ]; then
  touch {marker}
  echo "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. port: 12345, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use" >&2
  exit 1
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))  # the launcher run_launch starts
    monkeypatch.chdir(ROOT)
    report = compare_run(RunOptions(epochs=1, modes=("sampler",)).validate())
    assert marker.exists() and report["modes"]["sampler"]["epochs"][0]["seen"] == 8


def test_busy_default_port_is_not_used():
    with socket.socket() as other_job:
        other_job.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            other_job.bind(("127.0.0.1", 29500))
        except OSError:
            pytest.skip("port 29500 is taken by something else already")
        other_job.listen(1)
        proc = sharddemo(["compare", "--modes", "sampler", "--epochs", "1"])
        assert "seen 8 = 1x the dataset" in proc.stdout


def test_an_explicit_port_is_used(tmp_path):
    from sharddemo.launch import free_port

    port = free_port()
    proc = sharddemo(["compare", "--modes", "sampler", "--epochs", "1", "--main-process-port",
                      str(port)])
    assert f"--main_process_port {port}" in proc.stdout


def test_ragged_batch_shapes_neither_hang_nor_corrupt():
    import json

    proc = sharddemo(["audit", f"{FACTORIES}:ragged_shapes", "--format", "json"], check=False)
    report = json.loads(proc.stdout)
    e = report["modes"]["audit"]["epochs"][0]
    sizes = [[len(b) for b in r["batches"]] for r in e["ranks"]]
    assert sizes == [[3] * 10, [2] * 10]  # the same step count, different shapes
    assert e["gather"] == "batch" and e["ragged_steps"] == list(range(10))
    # accelerator.gather, padded and trimmed, returned exactly what the ranks held, step by step
    assert e["gathered"] == [i for s in range(10) for r in e["ranks"] for i in r["batches"][s]]
    assert e["seen"] == 50


def test_more_ranks_than_samples_with_drop_last_says_so():
    proc = sharddemo(["compare", "--dataset-size", "1", "--num-processes", "3", "--drop-last",
                      "--epochs", "1", "--modes", "sampler,prepared"])
    assert proc.stdout.count("Every rank received nothing") == 2


def test_more_ranks_than_samples_is_explained():
    proc = sharddemo(["compare", "--dataset-size", "2", "--num-processes", "3", "--epochs", "1",
                      "--modes", "sampler"])
    assert "there are more ranks (3) than samples (2)" in proc.stdout
    assert "DistributedSampler padding" in proc.stdout
