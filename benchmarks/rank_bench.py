"""Rank-side measurements, run under `accelerate launch` by benchmarks/run.py.

    accelerate launch --config_file accelerate_configs/cpu2.yaml benchmarks/rank_bench.py WHAT OUT.json

WHAT is `overhead` (the tracing against the same loop without it), `sharding` (epoch time of
each mode with a fixed real cost per sample) or `gather` (collective latency). Every figure is
timed on the main rank between barriers, repeated, and the median kept.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from sharddemo.datasets import ToyDataset
from sharddemo.loaders import build_loader
from sharddemo.options import RunOptions
from sharddemo.trace import make_accelerator, trace_epoch


def timed(accelerator, fn) -> float:
    accelerator.wait_for_everyone()
    start = time.perf_counter()
    fn()
    accelerator.wait_for_everyone()
    return time.perf_counter() - start


def bare_epoch(accelerator, plan) -> None:
    """The loop a training script runs, with nothing recorded."""
    for batch in plan.loader:
        batch.to(accelerator.device)


def overhead(accelerator, n: int, b: int, repeats: int) -> dict:
    out = {}
    for mode in ("prepared", "sampler"):
        opts = RunOptions(dataset_size=n, batch_size=b, epochs=1)
        plan = build_loader(mode, accelerator, ToyDataset(n), opts)
        bare, traced = [], []
        run_bare = lambda: bare.append(timed(accelerator, lambda: bare_epoch(accelerator, plan)))
        run_traced = lambda: traced.append(
            timed(accelerator, lambda: trace_epoch(accelerator, plan, 0, "auto")))
        run_bare()  # warm-up: first epochs pay for allocations both would pay
        run_traced()
        bare.clear(), traced.clear()
        for i in range(repeats):  # ABBA order, so drift and position hit both alike
            for fn in ((run_bare, run_traced) if i % 2 == 0 else (run_traced, run_bare)):
                fn()
        out[mode] = {"bare_s": statistics.median(bare), "traced_s": statistics.median(traced),
                     "ratio": statistics.median(traced) / statistics.median(bare)}
    return out


class CostlyDataset(ToyDataset):
    """The toy dataset with a fixed, real cost per sample: a small matrix product."""

    def __init__(self, length: int, size: int = 48) -> None:
        super().__init__(length)
        self.matrix = torch.randn(size, size)

    def __getitem__(self, index: int) -> int:
        value = super().__getitem__(index)
        (self.matrix @ self.matrix).sum()  # the per-sample work
        return value


def sharding(accelerator, n: int, b: int, repeats: int) -> dict:
    out = {}
    for mode in ("replicated", "sampler", "prepared"):
        opts = RunOptions(dataset_size=n, batch_size=b, epochs=1)
        plan = build_loader(mode, accelerator, CostlyDataset(n), opts)
        times = [timed(accelerator, lambda: bare_epoch(accelerator, plan)) for _ in range(repeats)]
        out[mode] = {"epoch_s": statistics.median(times)}
    for mode in ("sampler", "prepared"):
        out[mode]["speedup_vs_replicated"] = out["replicated"]["epoch_s"] / out[mode]["epoch_s"]
    return out


def gather(accelerator, repeats: int) -> dict:
    import torch.distributed as dist

    world = accelerator.num_processes
    out = {}
    for nbytes in (8, 1024, 65536, 1 << 20):
        x = torch.ones(nbytes // 8, dtype=torch.int64, device=accelerator.device)
        buf = [torch.empty_like(x) for _ in range(world)]
        calls = max(20, min(1000, (1 << 24) // max(nbytes, 1) // 16))
        acc_t, raw_t = [], []
        for _ in range(repeats):
            acc_t.append(timed(accelerator, lambda: [accelerator.gather(x) for _ in range(calls)]) / calls)
            raw_t.append(timed(accelerator, lambda: [dist.all_gather(buf, x) for _ in range(calls)]) / calls)
        out[str(nbytes)] = {"accelerate_us": statistics.median(acc_t) * 1e6,
                            "raw_us": statistics.median(raw_t) * 1e6,
                            "ratio": statistics.median(acc_t) / statistics.median(raw_t)}
    # One epoch of ids (N = 1e6, B = 512, 2 ranks): gathered every batch, or once at the end.
    n, b = 1_000_000, 512
    opts = RunOptions(dataset_size=n, batch_size=b, epochs=1)
    plan = build_loader("sampler", accelerator, ToyDataset(n), opts)
    every = statistics.median(timed(accelerator, lambda: trace_epoch(accelerator, plan, 0, "batch"))
                              for _ in range(repeats))
    once = statistics.median(timed(accelerator, lambda: trace_epoch(accelerator, plan, 0, "epoch"))
                             for _ in range(repeats))
    out["epoch_1e6"] = {"every_batch_s": every, "once_per_epoch_s": once, "ratio": every / once}
    return out


def main() -> None:
    what, out_path = sys.argv[1], sys.argv[2]
    args = [int(a) for a in sys.argv[3:]]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    accelerator = make_accelerator(device, timeout=300)
    if what == "overhead":
        result = overhead(accelerator, *args)
    elif what == "sharding":
        result = sharding(accelerator, *args)
    elif what == "gather":
        result = gather(accelerator, *args)
    else:
        raise SystemExit(f"unknown measurement {what!r}")
    if accelerator.is_main_process:
        result["world_size"] = accelerator.num_processes
        result["backend"] = accelerator.state.backend
        with open(out_path, "w") as handle:
            json.dump(result, handle)
    accelerator.end_training()


if __name__ == "__main__":
    main()
