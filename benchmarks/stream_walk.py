"""The streams walked bare and walked by sharddemo: `hf-stream` and `iterable`, W ranks, N
samples, batches of 4096, the loaders `compare` builds for each mode.

    python benchmarks/stream_walk.py [--record] [--sizes 100000,1000000] [--worlds 2,3]
                                     [--sources hf-stream,iterable] [--modes replicated,prepared]
                                     [--pairs 2]
    python benchmarks/stream_walk.py --record --rows A.jsonl B.jsonl   # points run apart

Each (source, W, N) is one `accelerate launch` of this file on W CPU ranks (gloo). Every rank
builds the mode's loader as `compare` does (the source, set_seed, rank.loaders.build_mode_loader,
rank.tagging.tag_batches; the gather strategy chosen once, outside the timing), then walks
one epoch at a time, alternated ABBA: bare (`for batch in loader: batch["id"].to(device)`, the
loop of a training script with nothing recorded) and by sharddemo's own epoch loop
(rank.walk.EpochWalker, as `compare` walks a mode). Timed on the main rank between barriers
after a full garbage collection (benchmarks/rank_bench.py's `timed_cpu`), with the CPU time
of every rank beside it. The first pair is a warm-up, not kept, where --pairs is above 1.

`--record` writes the figures into benchmarks/results.json (`stream_walk`) and
docs/benchmarks.md again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = 4096


def rank_main(source: str, n: int, modes: list[str], pairs: int, out: str) -> None:
    from accelerate.utils import set_seed

    sys.path.insert(0, HERE)
    from rank_bench import timed_cpu

    from sharddemo.options import RunOptions
    from sharddemo.rank.loaders import build_mode_loader
    from sharddemo.rank.session import make_accelerator
    from sharddemo.rank.sources import batch_values, build_source
    from sharddemo.rank.tagging import tag_batches
    from sharddemo.rank.walk import EpochWalker

    accelerator = make_accelerator("cpu", 600)
    opts = RunOptions(dataset_size=n, batch_size=BATCH, epochs=1, source=source,
                      shuffle=False, modes=tuple(modes)).validate()
    dataset = build_source(source, n, opts.shards)
    device = accelerator.device
    result: dict = {}
    for mode in modes:
        set_seed(opts.seed)
        plan = build_mode_loader(mode, accelerator, dataset, opts)
        tag_batches(plan.loader, record_indices=False)
        walker = EpochWalker(accelerator, plan.loader,
                             lambda batch, tag: batch_values(batch), n=n)

        def bare() -> None:
            for batch in plan.loader:
                (batch["id"] if isinstance(batch, dict) else batch).to(device)

        epoch = [0]

        def traced() -> None:
            walker.walk(epoch[0])
            epoch[0] += 1

        runs: dict[str, list] = {"bare": [], "traced": []}
        order = [("bare", bare), ("traced", traced)]
        for i in range(pairs):
            for name, fn in (order if i % 2 == 0 else order[::-1]):
                runs[name].append(timed_cpu(accelerator, fn))
        if pairs > 1:  # the first pair warms both up
            runs = {k: v[1:] for k, v in runs.items()}
        wall = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
        result[mode] = {"gather": walker.how, "bare_s": wall["bare"],
                        "traced_s": wall["traced"], "ratio": wall["traced"] / wall["bare"],
                        "bare_cpu_s": cpu["bare"], "traced_cpu_s": cpu["traced"],
                        "cpu_ratio": cpu["traced"] / cpu["bare"],
                        "bare_runs_s": [w for w, _ in runs["bare"]],
                        "traced_runs_s": [w for w, _ in runs["traced"]],
                        "per_sample_rank_us": wall["bare"] / n * 1e6}
    if accelerator.is_main_process:
        with open(out, "w") as handle:
            json.dump(result, handle)
    accelerator.end_training()


def launch_one(source: str, world: int, n: int, modes: list[str], pairs: int) -> dict:
    from sharddemo.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(ROOT, "accelerate_configs", "cpu2.yaml"), "--num_processes",
               str(world), "--main_process_port", str(free_port()), os.path.abspath(__file__),
               "--rank", source, str(n), ",".join(modes), str(pairs), out]
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
        with open(out) as handle:
            modes_out = json.load(handle)
    return {"source": source, "world": world, "n": n, "pairs": pairs,
            "command_s": time.perf_counter() - start, "modes": modes_out}


def main() -> None:
    if sys.argv[1:2] == ["--rank"]:
        source, n, modes, pairs, out = sys.argv[2:7]
        rank_main(source, int(n), modes.split(","), int(pairs), out)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--worlds", default="2,3")
    parser.add_argument("--sources", default="hf-stream,iterable")
    parser.add_argument("--modes", default="replicated,prepared")
    parser.add_argument("--pairs", type=int, default=2,
                        help="bare/traced pairs per point; above 1 the first is a warm-up, not kept")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--rows", nargs="*", default=None,
                        help="record the rows these files hold (one JSON row a line, as this "
                             "script prints them) instead of measuring: points run apart")
    args = parser.parse_args()
    rows = []
    for path in args.rows or []:
        with open(path) as handle:
            rows += [json.loads(line) for line in handle if line.strip()]
    for n in (int(s) for s in args.sizes.split(",")) if args.rows is None else ():
        for world in (int(w) for w in args.worlds.split(",")):
            for source in args.sources.split(","):
                row = launch_one(source, world, n, args.modes.split(","), args.pairs)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if not args.record:
        return
    sys.path.insert(0, HERE)
    from render_doc import record_result

    record_result("stream_walk", {
        "rows": rows, "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}",
        "repeats": " to ".join(str(p) for p in sorted({min(r["pairs"] for r in rows),
                                                         max(r["pairs"] for r in rows)})),
        "batch": BATCH,
        "target": "sharddemo's walk <= 1.15x the bare walk of the same loader (CPU time of "
                  "the ranks; wall beside)"})


if __name__ == "__main__":
    main()
