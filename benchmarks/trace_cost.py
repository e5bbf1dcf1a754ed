"""What the count path's walk itself costs, without a loader's noise: the same batches of ids,
made in advance, walked bare and through sharddemo's walk, in one process (world size 1).

    python benchmarks/trace_cost.py OUT.json [N] [B] [REPEATS]

The bare loop is `for batch in batches: batch.to(device)`; the traced one is `walk_epoch` as
`compare` calls it on the count path, end of epoch included. Alternated, medians kept.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from sharddemo.sources import batch_ids
from sharddemo.trace import make_accelerator
from sharddemo.walk import walk_epoch


def main() -> None:
    out_path = sys.argv[1]
    n, b, repeats = [int(a) for a in sys.argv[2:5]] if len(sys.argv) > 4 else (10**6, 512, 31)
    accelerator = make_accelerator("cpu", timeout=60)
    generator = torch.Generator().manual_seed(0)
    batches = list((torch.randperm(n, generator=generator) + 1).split(b))  # toy values: id + 1

    def bare() -> None:
        for batch in batches:
            batch.to(accelerator.device)

    def traced() -> None:
        walk_epoch(accelerator, batches, lambda batch, tag: batch_ids(batch), epoch=0,
                   strategy="count", n=n)

    times: dict = {"bare": [], "traced": []}
    bare(), traced()  # warm-up
    for i in range(repeats):
        order = (("bare", bare), ("traced", traced))
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    extra = statistics.median(times["traced"]) - statistics.median(times["bare"])
    result = {"n": n, "batch_size": b, "batches": len(batches), "repeats": repeats,
              "bare_s": statistics.median(times["bare"]),
              "traced_s": statistics.median(times["traced"]),
              "per_batch_us": extra / len(batches) * 1e6, "per_sample_ns": extra / n * 1e9}
    with open(out_path, "w") as handle:
        json.dump(result, handle)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
