"""examples/huge_stream.py's streams made in each rank's own process (no DataLoader workers),
for benchmarks/run.py (`huge`): the audit's cost without the loader's worker traffic."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import huge_stream  # noqa: E402


def hundred_million(accelerator):
    return huge_stream.make(accelerator, 10**8, workers=0)


def billion(accelerator):
    return huge_stream.make(accelerator, 10**9, workers=0)
