"""Fault injection for the reliability tests, kept out of the shipped code.

Put this folder on PYTHONPATH and set SHARDDEMO_TEST_FAULT=HOW:RANK:MODE:EPOCH[:STEP]: Python
imports this module at start-up in every process of the launch; in a rank it wraps sharddemo's
walk so that, when that mode's epoch starts on that rank (RANK `all`: on every rank), the rank
raises (HOW=raise), dies by SIGKILL (kill) or hangs outside any collective (stall). With STEP
(stall only) the rank hangs mid-epoch instead: after it has received STEP batches of that
epoch, as it reads the next. Without the variable it does nothing.
"""

import os

SPEC = os.environ.get("SHARDDEMO_TEST_FAULT")

if SPEC and "RANK" in os.environ:
    import signal
    import time

    import sharddemo.rank.walk as _walk
    import sharddemo.rank.run as _trace

    how, want_rank, want_mode, want_epoch, *rest = SPEC.split(":")
    after = int(rest[0]) if rest else None
    _current = {"mode": None}
    _trace_mode, _walk_epoch = _trace.trace_mode, _walk.walk_epoch

    def trace_mode(accelerator, mode, *args, **kwargs):
        _current["mode"] = mode
        return _trace_mode(accelerator, mode, *args, **kwargs)

    def stall_after(read_ids, steps):
        """`read_ids` that hangs as it reads batch steps + 1 (the walk reads every batch)."""
        read = [0]

        def reader(batch, tag):
            read[0] += 1
            if read[0] > steps:
                time.sleep(3600)
            return read_ids(batch, tag)

        return reader

    def walk_epoch(accelerator, loader, read_ids, *, epoch, **kwargs):
        rank = accelerator.process_index
        if (want_rank in ("all", str(rank)) and (_current["mode"], epoch) == (
                want_mode, int(want_epoch))):
            if how == "raise":
                raise ValueError(f"injected fault (SHARDDEMO_TEST_FAULT={SPEC})")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "stall" and after is None:
                time.sleep(3600)
            if how == "stall":
                read_ids = stall_after(read_ids, after)
        return _walk_epoch(accelerator, loader, read_ids, epoch=epoch, **kwargs)

    # (the one epoch loop, rank.walk.EpochWalker, calls rank.walk.walk_epoch)
    _trace.trace_mode, _walk.walk_epoch = trace_mode, walk_epoch
