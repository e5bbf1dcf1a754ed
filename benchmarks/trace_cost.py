"""What the count path's walk itself costs, in one process (world size 1, no collective waits).

    python benchmarks/trace_cost.py OUT.json [SOURCE [N B REPEATS]]

SOURCE `batches` (default): the same batches of ids, made in advance, so only the walk's own
time differs. SOURCE `loader`: what rank 0 of 2 walks in `compare --modes sampler` (torch's
DistributedSampler, seed 42, and a DataLoader over the toy dataset), a real loader in one
process; benchmarks/run.py runs it alone and as two processes at once, to set the cost of two
processes sharing the machine apart from the trace's.

The bare loop is `for batch in batches: batch.to(device)`; the traced one is `walk_epoch` as
`compare` calls it on the count path (its reader: the toy values and their shift), end of
epoch included. Alternated, medians of CPU time kept (the wall time too).
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

import torch

from sharddemo.rank.sources import ToyDataset, batch_values
from sharddemo.rank.session import make_accelerator
from sharddemo.rank.walk import walk_epoch


def main() -> None:
    out_path = sys.argv[1]
    source = sys.argv[2] if len(sys.argv) > 2 else "batches"
    n, b, repeats = [int(a) for a in sys.argv[3:6]] if len(sys.argv) > 5 else (10**6, 512, 31)
    accelerator = make_accelerator("cpu", timeout=60)
    if source == "batches":
        generator = torch.Generator().manual_seed(0)
        batches = list((torch.randperm(n, generator=generator) + 1).split(b))  # values: id + 1
        samples = n
    elif source == "loader":
        from torch.utils.data import DataLoader, DistributedSampler

        dataset = ToyDataset(n)
        sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=42)
        batches = DataLoader(dataset, batch_size=b, sampler=sampler)
        samples = len(sampler)
    else:
        raise SystemExit(f"unknown source {source!r}: batches or loader")

    def bare() -> None:
        for batch in batches:
            batch.to(accelerator.device)

    def traced() -> None:
        walk_epoch(accelerator, batches, lambda batch, tag: batch_values(batch), epoch=0,
                   strategy="count", n=n)

    times: dict = {"bare": [], "traced": [], "bare_cpu": [], "traced_cpu": []}
    bare(), traced()  # warm-up
    for i in range(repeats):
        order = (("bare", bare), ("traced", traced))
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            gc.collect()  # the same heap for both loops (rank_bench.timed_cpu)
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name + "_cpu"].append(time.process_time() - cpu)
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    steps = len(batches)
    extra = med["traced_cpu"] - med["bare_cpu"]
    result = {"source": source, "n": n, "batch_size": b, "batches": steps, "repeats": repeats,
              "bare_s": med["bare"], "traced_s": med["traced"],
              "bare_cpu_s": med["bare_cpu"], "traced_cpu_s": med["traced_cpu"],
              "ratio": med["traced"] / med["bare"],
              "cpu_ratio": med["traced_cpu"] / med["bare_cpu"],
              "per_batch_us": extra / steps * 1e6, "per_sample_ns": extra / samples * 1e9}
    with open(out_path, "w") as handle:
        json.dump(result, handle)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
