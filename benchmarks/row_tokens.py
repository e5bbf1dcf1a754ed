"""Each row's tokens of a mask, the ways torch can count them (watching/tokens.py's row_tokens).

    python benchmarks/row_tokens.py [--repeats 7]

64 batches of a 64 x 128 mask (4,096 rows: what the watch sums at once), 0/1 with a random
length a row, as int8 and as int64 (a tokenizer's attention_mask), on one CPU thread. Every way
is checked against the rows' nonzero counts first; a mask of segment numbers (1, 2, 3) is
counted too, where a plain sum is wrong. Prints the median of `--repeats` runs of 50 calls, in
ms a call; the figures go into docs/benchmarks.md by hand ("Tokens")."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sharddemo.watching.tokens import row_sums

WAYS = {
    "(mask != 0).sum(1)": lambda m: (m != 0).sum(1),
    "count_nonzero(mask, dim=1)": lambda m: torch.count_nonzero(m, dim=1),
    "mask.bool().view(uint8).sum(1, int32)":
        lambda m: m.bool().view(torch.uint8).sum(1, dtype=torch.int32),
    "mask.sum(1) (0/1 only)": lambda m: m.sum(1),
    # (what the meter does since 2026-12-06, 06:50 UTC: the bools' bytes as int64 words,
    # summed byte lane by byte lane, then each row's lanes: watching/tokens.py's row_sums)
    "row_sums(mask.bool()) (int64 words)": lambda m: row_sums(m.bool()),
}


def timed(way, mask, calls: int = 50) -> float:
    way(mask)
    start = time.perf_counter()
    for _ in range(calls):
        way(mask)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 129, (4096, 1), generator=g)
    ones = torch.arange(128) < lengths
    segments = ones.to(torch.int64) * torch.randint(1, 4, (4096, 128), generator=g)
    truth = ones.sum(1)
    for dtype in (torch.int8, torch.int64):
        mask = ones.to(dtype)
        print(f"{dtype}, 4,096 rows of 128:")
        for name, way in WAYS.items():
            exact = bool((way(mask) == truth).all())
            on_segments = bool((way(segments.to(dtype)) == truth).all())
            runs = [timed(way, mask) for _ in range(args.repeats)]
            print(f"  {name:40s} {statistics.median(runs):6.3f} ms (min {min(runs):.3f}); "
                  f"exact: {exact}, on segment numbers: {on_segments}")


if __name__ == "__main__":
    main()
