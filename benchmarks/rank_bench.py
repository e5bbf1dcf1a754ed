"""Rank-side measurements, run under `accelerate launch` by benchmarks/run.py.

    accelerate launch --config_file accelerate_configs/cpu2.yaml benchmarks/rank_bench.py WHAT OUT.json

WHAT is `overhead` (the tracing against the same loop without it), `sharding` (epoch time of
each mode with a fixed real cost per sample), `gather` (collective latency) or `bare` (the
sampler loader alone: its epoch time and peak memory per rank). Every figure is
timed on the main rank between barriers, repeated, and the median kept.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

import torch

from sharddemo.rank.sources import ToyDataset
from sharddemo.rank.loaders import build_mode_loader
from sharddemo.options import RunOptions
from sharddemo.rank.sources import batch_values
from sharddemo.rank.session import make_accelerator
from sharddemo.rank.tagging import tag_batches
from sharddemo.rank.walk import choose_gather, walk_epoch


def trace_epoch(accelerator, plan, epoch: int, strategy: str, n=None):
    """One traced epoch through sharddemo's public walk, as the tool runs it (`n`: the
    dataset's length, which the tool passes and the count path needs)."""
    return walk_epoch(accelerator, plan.loader, lambda batch, tag: batch_values(batch),
                      epoch=epoch, strategy=strategy, n=n)


def timed(accelerator, fn) -> float:
    """Wall seconds on the main rank between barriers (timed_cpu without its CPU figure)."""
    return timed_cpu(accelerator, fn)[0]


def timed_cpu(accelerator, fn) -> tuple[float, float]:
    """(wall seconds on the main rank between barriers, CPU seconds of all ranks together).
    CPU time leaves out the waits a busy 2-core machine adds to the wall time (the other
    rank, other processes), so it is the steadier measure of what the work itself costs."""
    # A full collection first, on every rank: the interpreter holds about 250,000 objects
    # here (torch, accelerate, datasets), so a collection that the loader's allocations set off
    # takes tens of ms and would land on one loop or the other at random; collected before
    # every timing, the two loops start from the same heap.
    gc.collect()
    accelerator.wait_for_everyone()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - cpu
    accelerator.wait_for_everyone()
    wall = time.perf_counter() - start
    total = accelerator.gather(torch.tensor([cpu], dtype=torch.float64)).sum().item()
    return wall, total


def bare_epoch(accelerator, plan) -> None:
    """The loop a training script runs, with nothing recorded."""
    for batch in plan.loader:
        batch.to(accelerator.device)


def overhead(accelerator, n: int, b: int, repeats: int) -> dict:
    from sharddemo.rank.counting.counters import FLUSH_IDS

    out: dict = {"flush_ids": FLUSH_IDS}
    for mode in ("prepared", "sampler"):
        opts = RunOptions(dataset_size=n, batch_size=b, epochs=1)
        plan = build_mode_loader(mode, accelerator, ToyDataset(n), opts)
        # as compare's trace_mode does; with no workers it tags nothing (rank.tagging.tag_batches), so
        # the bare and the traced loop walk the very same loader
        assert not tag_batches(plan.loader, record_indices=False)
        # chosen once per mode, before its epochs, as compare does (trace.trace_mode)
        how = choose_gather(accelerator, plan.loader, "auto", n)
        out.setdefault("gather", {})[mode] = how
        bare, traced = [], []
        run_bare = lambda: bare.append(
            timed_cpu(accelerator, lambda: bare_epoch(accelerator, plan)))
        run_traced = lambda: traced.append(
            timed_cpu(accelerator, lambda: trace_epoch(accelerator, plan, 0, how, n)))
        run_bare()  # warm-up: first epochs pay for allocations both would pay
        run_traced()
        bare.clear(), traced.clear()
        for i in range(repeats):  # ABBA order, so drift and position hit both alike
            for fn in ((run_bare, run_traced) if i % 2 == 0 else (run_traced, run_bare)):
                fn()
        wall_b, wall_t = [w for w, _ in bare], [w for w, _ in traced]
        cpu_b, cpu_t = [c for _, c in bare], [c for _, c in traced]
        pairs = sorted(t / b for t, b in zip(wall_t, wall_b))
        out[mode] = {"bare_s": statistics.median(wall_b), "traced_s": statistics.median(wall_t),
                     "ratio": statistics.median(wall_t) / statistics.median(wall_b),
                     # the middle half of the pair-by-pair ratios: how far one pair strays
                     "pairs_iqr": [pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]],
                     "bare_cpu_s": statistics.median(cpu_b),
                     "traced_cpu_s": statistics.median(cpu_t),
                     "cpu_ratio": statistics.median(cpu_t) / statistics.median(cpu_b),
                     # every timing, so that run.py can pool several launches
                     "bare_walls": wall_b, "traced_walls": wall_t,
                     "bare_cpus": cpu_b, "traced_cpus": cpu_t}
    return out


class CostlyDataset(ToyDataset):
    """The toy dataset with a fixed, real cost per sample: a small matrix product."""

    def __init__(self, length: int, size: int = 64) -> None:
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
        plan = build_mode_loader(mode, accelerator, CostlyDataset(n), opts)
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
        flat = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
        calls = max(20, min(500, (1 << 24) // max(nbytes, 1) // 16))
        forms = {
            "accelerate": lambda: accelerator.gather(x),
            # the same result (one tensor of every rank's data) from the raw collectives
            "into_tensor": lambda: dist.all_gather_into_tensor(flat, x),
            "list_cat": lambda: (dist.all_gather(buf, x), torch.cat(buf)),
        }
        times = {k: [] for k in forms}
        for i in range(repeats):
            order = list(forms) if i % 2 == 0 else list(reversed(forms))
            for name in order:
                fn = forms[name]
                times[name].append(timed(accelerator, lambda: [fn() for _ in range(calls)]) / calls)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        # accelerate itself calls all_gather into a list then cat on gloo, and
        # all_gather_into_tensor on every other backend: its wrapper cost is against that form.
        same = med["list_cat"] if accelerator.state.backend == "gloo" else med["into_tensor"]
        out[str(nbytes)] = {"accelerate_us": med["accelerate"], "into_tensor_us": med["into_tensor"],
                            "list_cat_us": med["list_cat"], "raw_us": same,
                            "ratio": med["accelerate"] / same,
                            "ratio_vs_fastest": med["accelerate"] / min(med["into_tensor"],
                                                                        med["list_cat"])}
    # One epoch of ids (N = 1e6, B = 512, 2 ranks): gathered every batch, or once at the end.
    n, b = 1_000_000, 512
    opts = RunOptions(dataset_size=n, batch_size=b, epochs=1)
    plan = build_mode_loader("sampler", accelerator, ToyDataset(n), opts)
    every = statistics.median(timed(accelerator, lambda: trace_epoch(accelerator, plan, 0, "batch"))
                              for _ in range(repeats))
    once = statistics.median(timed(accelerator, lambda: trace_epoch(accelerator, plan, 0, "epoch"))
                             for _ in range(repeats))
    out["epoch_1e6"] = {"every_batch_s": every, "once_per_epoch_s": once, "ratio": every / once}
    return out


def bare(accelerator, n: int, b: int, mode: str = "sampler") -> dict:
    """The loader alone, as `compare --modes MODE` builds it, walked once with nothing
    recorded: its time and every rank's peak memory (the baseline of the scale figures)."""
    from sharddemo.rank.session import peak_rss_mb

    opts = RunOptions(dataset_size=n, batch_size=b, epochs=1)
    plan = build_mode_loader(mode, accelerator, ToyDataset(n), opts)
    seconds = timed(accelerator, lambda: bare_epoch(accelerator, plan))
    return {"epoch_s": seconds, "peak_rss_mb": peak_rss_mb(accelerator)}


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
    elif what == "bare":
        result = bare(accelerator, *args)
    elif what == "bare-prepared":
        result = bare(accelerator, *args, mode="prepared")
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
