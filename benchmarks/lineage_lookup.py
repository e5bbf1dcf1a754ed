"""What `sharddemo lineage` costs on a large run (docs/benchmarks.md, "lineage").

    python benchmarks/lineage_lookup.py                     # 10^8 samples, 8 ranks, batch 512
    python benchmarks/lineage_lookup.py --record            # and into docs/benchmarks.md

A synthetic lineage of N samples: one epoch of a permutation of 0..N-1, dealt to W ranks in
batches of B, written with the format's own encoder (sharddemo.lineage_format.encode_many, a chunk of
256 batches at a time, as the watch's writer calls it) straight from numpy: no training loop,
no torch, so that 10^8 samples can be made on 2 cores. Then, each in a fresh process (`sharddemo lineage`, as a user runs it,
the Python start included) and with the files in the page cache: a lookup by step (every rank
at that step) and a lookup by id (every rank's file searched), several of each; the median and
the slowest. The folder is removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from sharddemo.lineage import write_run_file
from sharddemo.lineage_format import BATCH, encode_many, file_header, rank_file

CHUNK = 256  # batches a chunk: the writer's FLUSH_BATCHES


def make(folder: str, n: int, world: int, batch: int, seed: int = 0) -> dict:
    start = time.perf_counter()
    order = np.random.default_rng(seed).permutation(n).astype(np.uint32)
    per_rank = n // world
    for rank in range(world):
        mine = order[rank * per_rank:(rank + 1) * per_rank]
        sizes = np.diff(np.append(np.arange(0, len(mine), batch), len(mine)))
        with open(rank_file(folder, rank), "wb") as handle:
            handle.write(file_header(rank))
            for first in range(0, len(sizes), CHUNK):
                part = sizes[first:first + CHUNK]
                at = first * batch
                handle.write(encode_many([BATCH] * len(part), [0] * len(part),
                                         range(first, first + len(part)), part,
                                         mine[at:at + int(part.sum())]))
    write_run_file(folder, {"run_id": "benchmark000", "started": "-", "world_size": world,
                            "dataset_size": n, "loader": "train"})
    size = sum(os.path.getsize(rank_file(folder, r)) for r in range(world))
    return {"write_s": time.perf_counter() - start, "bytes": size,
            "bytes_per_sample": size / (per_rank * world), "steps_per_rank": -(-per_rank // batch),
            "order": order}


def timed(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sharddemo", "lineage", *args], check=True,
                   capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10**8)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lookups", type=int, default=5)
    parser.add_argument("--keep")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="lineage-bench-")
    os.makedirs(folder, exist_ok=True)
    try:
        made = make(folder, args.n, args.world, args.batch)
        order = made.pop("order")
        rng = np.random.default_rng(1)
        steps = rng.integers(0, made["steps_per_rank"], args.lookups).tolist()
        ids = rng.integers(0, args.n, args.lookups).tolist()
        timed([folder, "--step", "0"])  # the files into the page cache, once
        by_step = [timed([folder, "--step", str(k), "--format", "json"]) for k in steps]
        by_id = [timed([folder, "--id", str(i), "--format", "json"]) for i in ids]
        # one answer checked against the permutation it was made from
        out = subprocess.run([sys.executable, "-m", "sharddemo", "lineage", folder, "--id",
                              str(int(order[12345])), "--format", "json"],
                             check=True, capture_output=True, text=True).stdout
        hit = json.loads(out)["received"]
        per_rank = args.n // args.world
        assert hit == [{"epoch": 0, "step": (12345 % per_rank) // args.batch,
                        "rank": 12345 // per_rank}], hit
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "sharddemo", "--help"], check=True,
                       capture_output=True)
        python_start = time.perf_counter() - start
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    figures = {"n": args.n, "world": args.world, "batch": args.batch,
               "write_s": made["write_s"], "bytes_per_sample": made["bytes_per_sample"],
               "gb": made["bytes"] / 1e9, "steps_per_rank": made["steps_per_rank"],
               "step_s": statistics.median(by_step), "step_max_s": max(by_step),
               "id_s": statistics.median(by_id), "id_max_s": max(by_id),
               "help_s": python_start, "lookups": args.lookups}
    print(json.dumps(figures, indent=1))
    if args.record:
        import datetime
        import platform

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from render_doc import record_result

        figures.update(date=datetime.date.today().isoformat(),
                       machine=f"{os.cpu_count()} cores, {platform.machine()}",
                       target="by step < 1 s, by id < 10 s", repeats=args.lookups)
        record_result("lineage", figures)


if __name__ == "__main__":
    main()
