"""How ids reach the main process (--gather), and what the count path holds: the arithmetic
the parent needs before any rank starts (rank.walk.choose_gather and rank.counting decide the
same on the ranks)."""

from __future__ import annotations

from typing import Optional

GATHER_STRATEGIES = ("auto", "batch", "epoch", "count")
# `auto` takes the count path (rank/counting.py) from this many samples on. Here, torch-free, so the
# command line can decide before any rank starts.
COUNT_FROM = 1_000_000
# `auto` below COUNT_FROM: up to this many steps per rank and epoch, every batch is gathered as
# it comes. Beyond it, ids stay on the rank and are gathered once at the end of the epoch: a
# small gather costs more than a whole step of a toy loader (docs/benchmarks.md, "Figures
# behind design choices"). (rank.walk.choose_gather decides; the parent estimates the report's
# size with it: reportsize.)
PER_BATCH_GATHER_LIMIT = 100


def counted(gather: str, n: Optional[int]) -> bool:
    """Whether a walk of n samples takes the count path (rank.walk.choose_gather decides the same on
    the ranks)."""
    return n is not None and (gather == "count" or (gather == "auto" and n >= COUNT_FROM))


def code_width(world: int) -> tuple[int, int]:
    """(shift, bytes) of the count path's per-sample code for `world` ranks: a code is 0, 1 or
    1 + shift, and the sum of `world` codes must fit, with the ranks that received a sample
    below `shift`: 16 in one byte up to 15 ranks, 256 in two up to 255, else 65536 in four.
    (counting.code_layout gives the numpy dtype; here no numpy, for the CLI's own checks.)"""
    if world <= 15:
        return 16, 1
    if world <= 255:
        return 256, 2
    return 65536, 4


# From this many samples the count path keeps 2 bits a sample (rank.counting.BitCounts), not a
# byte: at 10^9, 250 MB a rank instead of 1 GB.
BITS_FROM = 1 << 26


def counter_bytes(n: int, world: int = 1) -> int:
    """What the count path holds per rank for an epoch of a dataset of n samples: its uint8
    counter and, where the code is wider than a byte, the code beside it (up to 15 ranks the
    counter is its own code); from BITS_FROM samples its two bitmaps (the code is made and
    sent a chunk at a time)."""
    if n >= BITS_FROM:
        return -(-int(n) // 4)
    width = code_width(world)[1]
    return int(n) * (1 + (width if width > 1 else 0))
