"""Where sharddemo's epoch loop spends its time over the bare walk, rank by rank: the iterable
toy stream, one mode, N samples, batches of 4096, the id path (`gather` "epoch": the stream
has no length).

    python benchmarks/stream_walk_phases.py W MODE N PAIRS     # e.g. 2 replicated 100000 21

One `accelerate launch` on W CPU ranks. Every rank builds the mode's loader as `compare` does
(as benchmarks/stream_walk.py) and walks it bare and by rank.walk.EpochWalker, alternated
ABBA, each walk after a full garbage collection and a barrier; the first pair is a warm-up.
Each rank prints one JSON line of medians (ms, its own process's CPU time, gloo's threads
included, and wall time): the bare and traced walks, and inside the traced one the loop up to
the epoch's end (`loop`), the id path's heads (`heads`: the payload built, its runs and the
other batches' ids joined), the exchange that settles the epoch and carries the heads, and the
payload where it fits (`settle`), and the listing on the main rank with the ragged gather
where a payload did not fit (`finish`, of it `finish.ragged`); `faults_cpu` is the
minor page faults of one traced walk (a count, not ms). With N = 4096 (one batch a rank)
the traced walk's excess is the epoch's fixed cost.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def rank_main(mode: str, n: int, pairs: int) -> None:
    from accelerate.utils import set_seed

    from sharddemo.options import RunOptions
    from sharddemo.rank import recorder as recmod
    from sharddemo.rank import walk as walkmod
    from sharddemo.rank.loaders import build_mode_loader
    from sharddemo.rank.session import make_accelerator
    from sharddemo.rank.sources import batch_values, build_source
    from sharddemo.rank.tagging import tag_batches

    accelerator = make_accelerator("cpu", 600)
    opts = RunOptions(dataset_size=n, batch_size=4096, epochs=1, source="iterable",
                      shuffle=False, modes=(mode,)).validate()
    dataset = build_source("iterable", n, opts.shards)
    set_seed(opts.seed)
    plan = build_mode_loader(mode, accelerator, dataset, opts)
    tag_batches(plan.loader, record_indices=False)
    walker = walkmod.EpochWalker(accelerator, plan.loader,
                                 lambda batch, tag: batch_values(batch), n=n)
    phases: dict = {}

    def timed(owner, name, key):
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                got = phases.setdefault(key, [0.0, 0.0])
                got[0] += time.process_time() - cpu
                got[1] += time.perf_counter() - wall
        setattr(owner, name, wrapper)

    timed(walkmod, "settle", "settle")
    timed(recmod, "gather_ragged", "finish.ragged")
    timed(recmod.IdLog, "finish", "finish")
    walk, heads = walkmod.EpochWalker.walk, recmod.Recorder.heads

    def walk_timed(self, *args, **kwargs):
        phases["_start"] = (time.process_time(), time.perf_counter())
        return walk(self, *args, **kwargs)

    def heads_timed(self, *args, **kwargs):
        cpu, wall = phases["_start"]
        phases["loop"] = [time.process_time() - cpu, time.perf_counter() - wall]
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            return heads(self, *args, **kwargs)
        finally:
            phases["heads"] = [time.process_time() - cpu, time.perf_counter() - wall]

    walkmod.EpochWalker.walk, recmod.Recorder.heads = walk_timed, heads_timed

    def bare() -> None:
        for batch in plan.loader:
            batch.to(accelerator.device)

    epoch = [0]

    def traced() -> None:
        walker.walk(epoch[0])
        epoch[0] += 1

    runs: dict = {"bare": [], "traced": []}
    order = [("bare", bare), ("traced", traced)]
    for i in range(pairs):
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            gc.collect()
            accelerator.wait_for_everyone()
            phases.clear()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            cpu, wall = time.process_time(), time.perf_counter()
            fn()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            phases["faults"] = [resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, 0]
            if i > 0:
                runs[name].append((cpu, wall, dict(phases)))
    out: dict = {"rank": accelerator.process_index}
    for name, got in runs.items():
        out[f"{name}_cpu"] = statistics.median(c for c, _, _ in got) * 1e3
        out[f"{name}_wall"] = statistics.median(w for _, w, _ in got) * 1e3
    for key in [k for k in runs["traced"][0][2] if not k.startswith("_")]:
        scale = 1 if key == "faults" else 1e3
        out[f"{key}_cpu"] = statistics.median(p[key][0] for _, _, p in runs["traced"]) * scale
        if key != "faults":
            out[f"{key}_wall"] = statistics.median(p[key][1] for _, _, p in runs["traced"]) * 1e3
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}),
          flush=True)
    accelerator.end_training()


def main() -> None:
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    world, mode, n, pairs = sys.argv[1:5]
    from sharddemo.launch import free_port

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ROOT, "accelerate_configs", "cpu2.yaml"), "--num_processes", world,
           "--main_process_port", str(free_port()), os.path.abspath(__file__), "--rank", mode,
           n, pairs]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith('{"rank"'))
    print("\n".join(lines) if lines else proc.stderr[-3000:])


if __name__ == "__main__":
    main()
