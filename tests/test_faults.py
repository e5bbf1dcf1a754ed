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
import uuid

import psutil
import pytest
from conftest import ROOT, launch_env, sharddemo

from sharddemo.options import DEFAULT_TIMEOUT

FACTORIES = str(ROOT / "tests" / "factories.py")


FAULT_PLUGIN = str(ROOT / "tests" / "faultplugin")


def tagged_env(fault: str | None = None) -> tuple[dict, str]:
    """An environment with a unique token, to find every process the run started, and, with
    `fault` (HOW:RANK:MODE:EPOCH), the test-only fault plugin (tests/faultplugin)."""
    token = uuid.uuid4().hex
    env = launch_env()
    env["SHARDDEMO_TEST_TOKEN"] = token
    if fault:
        env["SHARDDEMO_TEST_FAULT"] = fault
        env["PYTHONPATH"] = os.pathsep.join(p for p in (FAULT_PLUGIN, env.get("PYTHONPATH")) if p)
    return env, token


def survivors(token: str) -> list:
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get("SHARDDEMO_TEST_TOKEN") == token and proc.pid != os.getpid():
                left.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return left


def assert_nothing_left(token: str) -> None:
    deadline = time.monotonic() + 5
    while survivors(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = survivors(token)
    assert not left, f"processes left running: {[p.info['cmdline'] for p in left]}"


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
    """Rank 1 stops after 5 batches (tests/faultplugin); rank 0 waits in the next collective,
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
    """Every rank stops after 5 batches, outside any collective (tests/faultplugin): no peer
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


def _progress_file(folder, rank, phase, when, step=0, where=""):
    """A progress report as docs/reliability.md lays it out: seq, step (u64), when (f64),
    phase (u8: 0 starting, 1 walking, 2 finishing) from byte 0; `where` from byte 32, its
    length first; 128 bytes."""
    import struct

    head = struct.pack("<QQdB", 1, step, when, phase).ljust(32, b"\0")
    text = where.encode()
    (folder / f"rank-{rank}.progress").write_bytes((head + bytes([len(text)]) + text)
                                                    .ljust(128, b"\0"))


def test_the_watchdog_bounds_a_starting_rank_and_a_walking_one(tmp_path):
    from sharddemo.launch import Watchdog

    # --timeout 2: walking 3 x 2 = 6 s, starting 60 + 2 x 2 = 64 s, times in seconds of the
    # monotonic clock the ranks write (here made up: the launch began at 100).
    dog = Watchdog(str(tmp_path), 2.0, expected=2, now=100.0)
    dog.poll(now=150.0)
    assert dog.overdue(now=164.0) is None
    assert dog.overdue(now=165.0) == (
        "no rank made progress for 65 s (over 64 s, the bound for a rank starting or "
        "finishing: 60 s + 2 x --timeout) and the launch was stopped; 2 rank(s) had not started (65 s "
        "after the launch began) (if one step or the start-up really takes that long, raise "
        "--timeout)")
    _progress_file(tmp_path, 0, 1, 200.0, step=7, where="sampler epoch 1")
    _progress_file(tmp_path, 1, 0, 190.0)
    dog.poll(now=201.0)
    # rank 1 is still starting: 190 + 64 = 254 covers rank 0's 200 + 6
    assert dog.overdue(now=254.0) is None
    assert dog.overdue(now=255.0) == (
        "no rank made progress for 55 s (over 64 s, the bound for a rank starting or "
        "finishing: 60 s + 2 x --timeout) and the launch was stopped; rank 0 last made progress at "
        "sampler epoch 1, step 7, 55.0 s before the stop; rank 1 was still starting (no "
        "batch yet), its last sign of life 65.0 s before the stop (if one step or the "
        "start-up really takes that long, raise --timeout)")
    _progress_file(tmp_path, 1, 1, 202.0, step=1, where="sampler epoch 1")
    dog.poll(now=203.0)
    assert dog.overdue(now=208.0) is None  # rank 1's first batch: 202 + 6
    assert dog.overdue(now=208.5).startswith(
        "no rank made progress for 6 s (over 6 s, the bound of 3 x --timeout) and the launch "
        "was stopped; rank 1 last made progress at sampler epoch 1, step 1, 6.5 s before the "
        "stop; rank 0 last made progress at sampler epoch 1, step 7, 8.5 s before the stop")
    # rank 0 walked every epoch and writes its trace: the start-up bound again, 210 + 64
    _progress_file(tmp_path, 0, 2, 210.0, where="the trace and teardown")
    _progress_file(tmp_path, 1, 1, 209.0, step=9, where="sampler epoch 1")
    dog.poll(now=211.0)
    assert dog.overdue(now=274.0) is None
    assert dog.overdue(now=275.0).startswith(
        "no rank made progress for 65 s (over 64 s, the bound for a rank starting or "
        "finishing: 60 s + 2 x --timeout) and the launch was stopped; rank 0 had walked every "
        "epoch and was writing its trace, 65.0 s before the stop; rank 1 last made progress at "
        "sampler epoch 1, step 9, 66.0 s before the stop")


def test_a_rank_still_making_progress_is_not_said_to_have_stopped():
    from sharddemo.launch import explain_failure

    waited = {0: {"kind": "timeout", "message": "DistBackendError after 4.0 s ..."}}
    working = {1: ({"phase": "walking", "where": "sampler epoch 0", "step": 40}, 0.3)}
    message, _ = explain_failure(waited, {0, 1}, "", 1, False, seen=working, timeout=4.0)
    assert message == ("rank 1 was still making progress (sampler epoch 0, step 40, 0.3 s "
                       "before rank 0 gave up) but did not reach the collective in time: rank "
                       "0 gave up waiting for it at the process-group timeout (--timeout); the "
                       "work between two collectives must take less than --timeout: raise it")
    stopped = {1: ({"phase": "walking", "where": "sampler epoch 0", "step": 5}, 4.2)}
    message, _ = explain_failure(waited, {0, 1}, "", 1, False, seen=stopped, timeout=4.0)
    assert message == ("rank 1 stopped making progress at sampler epoch 0, step 5 (4.2 s "
                       "before rank 0 gave up): rank 0 gave up waiting for it at the "
                       "process-group timeout (--timeout)")


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
    Issue 52's run: its 3 ranks still walking 12 minutes after sharddemo was killed."""
    env, token = tagged_env()
    # Walks far longer than the test: 2 x 10^7 samples gathered batch by batch, or an audit
    # whose rank 1 stalls (tests/factories.py: stall_mid_epoch) under a process-group timeout
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


def test_a_killed_rank_on_a_second_machine_is_named_by_its_global_rank():
    from sharddemo.launch import explain_failure

    # Machine 1 of 2 (ranks 2, 3): rank 3 was SIGKILLed (torchrun names it by local rank 1);
    # rank 2 failed soon after in its next collective and said so in its status file.
    failed = {2: {"kind": "peer", "message": "mode sampler, epoch 0: DistBackendError ..."}}
    stderr = "E1202 ... failed (exitcode: -9) local_rank: 1 (pid: 5) of binary: python\n"
    message, usage = explain_failure(failed, {2, 3}, stderr, 1, False, first_rank=2)
    assert not usage
    assert message == ("rank 3 was killed by signal 9 (SIGKILL) and said nothing; "
                       "rank 2 then lost the connection to the failed rank")


def test_failures_are_classified_by_what_the_ranks_say_not_by_words():
    from sharddemo.launch import explain_failure

    # A rank's own error that happens to say "Timeout" is its own error, not a stall.
    own = {1: {"kind": "error", "message": "ValueError: Timeout while reading shard 3"},
           0: {"kind": "peer", "message": "RuntimeError: Connection closed"}}
    message, usage = explain_failure(own, {0, 1}, "", 1, False)
    assert message == ("rank 1: ValueError: Timeout while reading shard 3; "
                       "rank 0 then lost the connection to the failed rank")
    # A rank that measured the whole timeout in its collective: its silent peer stalled.
    stalled = {0: {"kind": "timeout", "message": "DistBackendError after 4.0 s ..."}}
    message, _ = explain_failure(stalled, {0, 1}, "", 1, False)
    assert message == ("rank 1 stopped answering: rank 0 gave up waiting for it at the "
                       "process-group timeout (--timeout)")
    usage = {0: {"kind": "usage", "message": "bad"}, 1: {"kind": "usage", "message": "bad"}}
    assert explain_failure(usage, {0, 1}, "", 2, False) == ("rank 0, 1: bad", True)
    # Every rank failed at once in a collective and none was lost: the collective's own error
    # (gloo refusing a dtype, as the count path's 16-bit sums once did), not a lost peer.
    said = "epoch 0: RuntimeError after 0.0 s in a collective: Invalid scalar type"
    at_once = {r: {"kind": "peer", "message": said} for r in range(3)}
    message, _ = explain_failure(at_once, {0, 1, 2}, "", 1, False)
    assert message == ("every rank failed in the same collective, none before it: "
                       f"rank 0, 1, 2: {said}")
    # ...but with one rank silent, the others lost it
    message, _ = explain_failure({0: at_once[0], 1: at_once[1]}, {0, 1, 2}, "", 1, False)
    assert message == "rank 0, 1 lost the connection to a peer that failed without a message"


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


def test_a_native_abort_is_named_in_the_one_line():
    """A rank killed by SIGABRT leaves no status file; the launch's stderr (torchrun's report
    and the rank's own) is searched for what the native library said. Literal: gloo's message
    for a collective of unequal sizes."""
    from sharddemo.launch import explain_failure

    stderr = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
              "  what():  [enforce fail at ../third_party/gloo/gloo/transport/tcp/pair.cc:446] "
              "op.preamble.length <= op.nbytes. 8 vs 4\n"
              "Fatal Python error: Aborted\n"
              "E1203 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
              "(exitcode: -6) local_rank: 1 (pid: 4242) of binary: python\n")
    message, usage = explain_failure({}, {0, 1}, stderr, 1, debug=False)
    assert not usage
    assert message.startswith("rank 1 was killed by signal 6 (SIGABRT) and said nothing (a "
                              "native library said: what():  [enforce fail at ")
    assert "op.preamble.length <= op.nbytes. 8 vs 4)" in message


def test_a_signal_is_read_from_torchruns_table_too():
    """When the surviving rank exits first, torchrun's "failed" line names it (exit 1), and the
    killed rank is only in the closing table (torchrun 2.13's format, copied from a run);
    a process that torchrun closed itself (SIGTERM) is not a cause."""
    from sharddemo.launch import killed_by_signal

    stderr = ("E1203 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 3901) of binary: x\n"
              "Failures:\n[1]:\n  time      : 2026-12-03_06:17:44\n  host      : localhost\n"
              "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 3902)  (SIGKILL)\n"
              "Root Cause (first observed failure):\n[0]:\n"
              "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 3901) \n")
    assert killed_by_signal(stderr) == {1: 9}
    closed = ("W1203 api.py:1028] Sending process 3928 closing signal SIGTERM\n"
              "  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 3928)  (SIGTERM)\n")
    assert killed_by_signal(closed) == {}
