"""Fault injection for the reliability tests, kept out of the shipped code.

Put this folder on PYTHONPATH and set SHARDDEMO_TEST_FAULT=HOW:RANK:MODE:EPOCH: Python imports
this module at start-up in every process of the launch; in a rank it wraps sharddemo's walk so
that, when that mode's epoch starts on that rank, the rank raises (HOW=raise), dies by SIGKILL
(kill) or hangs outside any collective (stall). Without the variable it does nothing.
"""

import os

SPEC = os.environ.get("SHARDDEMO_TEST_FAULT")

if SPEC and "RANK" in os.environ:
    import signal
    import time

    import sharddemo.rank.walk as _walk
    import sharddemo.rank.run as _trace

    how, want_rank, want_mode, want_epoch = SPEC.split(":")
    _current = {"mode": None}
    _trace_mode, _walk_epoch = _trace.trace_mode, _walk.walk_epoch

    def trace_mode(accelerator, mode, *args, **kwargs):
        _current["mode"] = mode
        return _trace_mode(accelerator, mode, *args, **kwargs)

    def walk_epoch(accelerator, loader, read_ids, *, epoch, **kwargs):
        if (accelerator.process_index, _current["mode"], epoch) == (
                int(want_rank), want_mode, int(want_epoch)):
            if how == "raise":
                raise ValueError(f"injected fault (SHARDDEMO_TEST_FAULT={SPEC})")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "stall":
                time.sleep(3600)
        return _walk_epoch(accelerator, loader, read_ids, epoch=epoch, **kwargs)

    # (the one epoch loop, rank.walk.EpochWalker, calls rank.walk.walk_epoch)
    _trace.trace_mode, _walk.walk_epoch = trace_mode, walk_epoch
