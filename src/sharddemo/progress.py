"""The progress report a rank keeps for the parent: its format, which both sides read.

Each rank launched by `sharddemo compare` / `audit` keeps one file of SIZE bytes in the status
folder (STATUS_ENV), `rank-R.progress`, mapped into its memory (rank.heartbeat writes it);
the parent's watchdog (launch.Watchdog) reads it with `read_report`. The bytes:

    0   seq     u64   counts the reports: a new value is new progress
    8   step    u64   the batches this rank has received in the current epoch
    16  when    f64   time.monotonic() of the report (CLOCK_MONOTONIC: the machine's own
                      clock, the same in the parent, which runs on the same machine)
    24  phase   u8    0 starting (the Accelerator, the loader, its first batch: nothing
                      received yet), 1 walking (from the first batch on), 2 finishing
                      (every epoch walked: the trace is written)
    32  where   u8 length, then that many bytes of UTF-8: the loader and epoch
                  (`sampler epoch 0`)

This module imports nothing of sharddemo's and no torch, so that the parent and the rank
side both read it.
"""

from __future__ import annotations

import struct
from typing import Optional

SIZE = 128
HEAD = struct.Struct("<QQdB")  # seq, step, when, phase
WHERE_AT = 32
PHASES = ("starting", "walking", "finishing")


def read_report(data: bytes) -> Optional[dict]:
    """Read a progress file's bytes: {"seq", "step", "when", "phase", "where"}.

    None for a file not written whole, or one torn by a write it was read across (the caller
    reads again)."""
    if len(data) < SIZE:
        return None
    seq, step, when, phase = HEAD.unpack_from(data, 0)
    if phase >= len(PHASES):
        return None
    length = data[WHERE_AT]
    where = data[WHERE_AT + 1:WHERE_AT + 1 + length].decode("utf-8", "replace")
    return {"seq": seq, "step": step, "when": when, "phase": PHASES[phase],
            "where": where or "start-up"}
