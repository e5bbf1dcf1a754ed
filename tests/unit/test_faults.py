"""Reliability without ranks: the watchdog's bounds read from hand-made progress files, and a
failed launch's one line classified from what the ranks said (a killed rank, a native abort, a
signal). The same cases on real gloo ranks: tests/ranks/test_faults.py."""

from __future__ import annotations




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
