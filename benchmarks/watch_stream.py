"""A stream of N samples watched to its end (issue 40): the same loop bare and with
`sharddemo.watch`, 2 gloo ranks, one epoch each.

    python benchmarks/watch_stream.py --n 10000000 --pairs 2
    python benchmarks/watch_stream.py --n 100000000 --pairs 1 --record

The stream: an IterableDataset split per rank at the source (rank r of W takes the blocks b
with b % W == r), no length, no workers, yielding batches (DataLoader batch_size=None) of
BATCH samples as a tokenised pretraining stream does: `{"id": ids, "input_ids": tokens}`,
each sample a sequence of SEQ token ids (int32, drawn by a generator seeded by the block, so
that making a batch costs what a cheap real stream costs: about half a microsecond a sample
here). BATCH = 8192 samples a rank (16,384 a step on 2 ranks, 2 M tokens of 128: a pretraining
batch of the size large runs use), the largest that keeps a rank's batch in a few MB.

Each launch walks one epoch with the loop `for batch in loader: batch["input_ids"].to(device)`
(nothing else: no model, so that the watch's share is as large as it can be), bare or with
`watch(loader, accelerator, id_field="id", dataset_size=N, report=None)` (windows at their
default; `WATCH_CHECK_EVERY` in the environment gives check_every). glibc's mmap threshold is fixed at 1 MB for both (see launch). Bare and watched are
separate launches, alternated pair by pair, so that each
launch's peak resident memory (ru_maxrss, every rank) is its own. Per launch: each rank's wall
and CPU time of the epoch (process_time: the rank's threads, gloo's included), its peak RSS and
its RSS before the walk. Printed: every pair, then the medians; the ratio watched/bare in CPU
time of the ranks (the steadier figure on a shared machine) and in wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "accelerate_configs", "cpu2.yaml")
BATCH, SEQ, VOCAB = 8192, 128, 32000


def rss_mb() -> float:
    """This process's resident memory now (MB), from /proc."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rank_main(watched: bool, n: int, out: str) -> None:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, IterableDataset

    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes

    class Tokens(IterableDataset):
        def __iter__(self):
            for block, start in enumerate(range(rank * BATCH, n, world * BATCH)):
                ids = torch.arange(start, min(start + BATCH, n))
                draw = torch.Generator().manual_seed(block * world + rank)
                yield {"id": ids, "input_ids": torch.randint(
                    VOCAB, (ids.numel(), SEQ), generator=draw, dtype=torch.int32)}

    loader = DataLoader(Tokens(), batch_size=None)
    if watched:
        from sharddemo import watch

        every = os.environ.get("WATCH_CHECK_EVERY", "auto")  # (as watch_overhead.py)
        loader = watch(loader, accelerator, id_field="id", dataset_size=n, report=None,
                       check_every=every if every == "auto" else int(every))
    device = accelerator.device
    accelerator.wait_for_everyone()
    before = rss_mb()
    start, cpu = time.perf_counter(), time.process_time()
    steps = 0
    for batch in loader:
        batch["input_ids"].to(device)
        steps += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB -> MB (Linux)
    import torch.distributed as dist

    rows = [None] * world
    dist.all_gather_object(rows, {"rank": rank, "wall_s": wall, "cpu_s": cpu, "steps": steps,
                                  "rss_before_mb": before, "peak_rss_mb": peak})
    if accelerator.is_main_process:
        with open(out, "w") as handle:
            json.dump(rows, handle)
    accelerator.end_training()


def launch(watched: bool, n: int) -> list[dict]:
    from sharddemo.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG,
               "--num_processes", "2", "--main_process_port", str(free_port()), __file__,
               "--rank", "1" if watched else "0", str(n), out]
        # glibc's mmap threshold fixed (both launches alike): left to move, it rises to the
        # 4 MB of a freed token batch, later batches come from the heap, and whichever
        # small objects sit above them keep its top from shrinking: +200 MB of peak on one
        # rank and not the other at 10^7 here, from where things landed, not from what
        # either loop holds
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(1 << 20))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if not os.path.exists(out):
            raise SystemExit(f"launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(out) as handle:
            return json.load(handle)


def main() -> None:
    if sys.argv[1:2] == ["--rank"]:
        watched, n, out = sys.argv[2:5]
        rank_main(watched == "1", int(n), out)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10**7)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--record", action="store_true",
                        help="write the figures into benchmarks/results.json (watch_stream)")
    args = parser.parse_args()
    pairs = []
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        got = {watched: launch(watched, args.n) for watched in order}
        bare, seen = got[False], got[True]
        row = {"bare_cpu_s": sum(r["cpu_s"] for r in bare),
               "watched_cpu_s": sum(r["cpu_s"] for r in seen),
               "bare_wall_s": max(r["wall_s"] for r in bare),
               "watched_wall_s": max(r["wall_s"] for r in seen),
               "bare_peak_mb": [round(r["peak_rss_mb"], 1) for r in bare],
               "watched_peak_mb": [round(r["peak_rss_mb"], 1) for r in seen],
               "watched_before_mb": [round(r["rss_before_mb"], 1) for r in seen],
               "steps": [r["steps"] for r in seen]}
        row["cpu_ratio"] = row["watched_cpu_s"] / row["bare_cpu_s"]
        row["wall_ratio"] = row["watched_wall_s"] / row["bare_wall_s"]
        pairs.append(row)
        print(json.dumps(row), flush=True)
    figures = {"n": args.n, "batch": BATCH, "seq": SEQ, "pairs": args.pairs,
               "cpu_ratio": statistics.median(p["cpu_ratio"] for p in pairs),
               "wall_ratio": statistics.median(p["wall_ratio"] for p in pairs),
               "bare_cpu_s": statistics.median(p["bare_cpu_s"] for p in pairs),
               "watched_cpu_s": statistics.median(p["watched_cpu_s"] for p in pairs),
               "peak_over_bare_mb": statistics.median(
                   max(w - b for w, b in zip(p["watched_peak_mb"], p["bare_peak_mb"]))
                   for p in pairs)}
    print(json.dumps(figures, indent=1))
    if args.record:
        import datetime
        import platform

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from render_doc import record_result

        figures.update(rows=pairs, date=datetime.date.today().isoformat(),
                       machine=f"{os.cpu_count()} cores, {platform.machine()}",
                       target="<= 1.15x the bare loop; memory within the count path's")
        record_result("watch_stream", figures)


if __name__ == "__main__":
    main()
