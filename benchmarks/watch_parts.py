"""Where the watch's time goes in `watch_overhead.py`'s training loop: each named function of
sharddemo timed (wall, `time.perf_counter`) where it runs, in the main rank, over the timed
epoch (docs/benchmarks.md, "The watch").

    python benchmarks/watch_parts.py --tokens \\
        sharddemo.watching.tokens:TokenMeter.settle \\
        sharddemo.watching.step_windows:StepWindows.at_batch

Each FUNCTION is `module:Class.method` or `module:function`. The launch is watch_overhead.py's
watched rank (2 gloo ranks, the MLP, 1,000 steps after a warm-up epoch), with WATCH_CHECK_EVERY
read as there. Printed: the launch's own figures, then per function its calls, its time an
epoch, per step and per call. Every timer costs about a microsecond a call on the caches a
training step has emptied, and a timed function's time includes the timers of those it calls:
compare a function with itself across changes, not the parts' sum with the whole.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def timer(path: str, stats: dict) -> None:
    """Wrap the function named by `path` so that its calls and wall time add up in stats."""
    module, _, name = path.partition(":")
    owner = importlib.import_module(module)
    *classes, attr = name.split(".")
    for part in classes:
        owner = getattr(owner, part)
    original = getattr(owner, attr)
    counted = stats.setdefault(path, [0, 0.0])
    clock = time.perf_counter

    @functools.wraps(original)  # (its name kept: watch_overhead.py's timer reads it)
    def timed(*args, **kwargs):
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            counted[1] += clock() - start
            counted[0] += 1

    setattr(owner, attr, timed)


def rank(out: str, tokens: bool, functions: list[str]) -> None:
    import accelerate

    import watch_overhead

    stats: dict = {}
    for path in functions:
        timer(path, stats)
    wait = accelerate.Accelerator.wait_for_everyone

    def reset(self):  # (each epoch starts with it: the last one, timed, counts alone)
        for counted in stats.values():
            counted[0], counted[1] = 0, 0.0
        return wait(self)

    accelerate.Accelerator.wait_for_everyone = reset
    watch_overhead.rank_main(True, out, tokens=tokens)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out) as handle:
            figures = json.load(handle)
        figures["parts"] = {path: {"calls": n, "s": s} for path, (n, s) in stats.items()}
        with open(out, "w") as handle:
            json.dump(figures, handle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("functions", nargs="+", metavar="FUNCTION")
    parser.add_argument("--tokens", action="store_true", help="as watch_overhead.py --tokens")
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_out:
        rank(args.rank_out, args.tokens, args.functions)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(ROOT, "accelerate_configs", "cpu2.yaml"), "--num_processes", "2",
               __file__, "--rank-out", out, *(["--tokens"] if args.tokens else []),
               *args.functions]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if not os.path.exists(out):
            sys.exit(f"the launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(out) as handle:
            figures = json.load(handle)
    steps = figures["steps"]
    print(f"step {figures['step_s'] * 1e3:.2f} ms; inside the watch "
          f"{figures['watch_s'] / figures['epoch_s']:.3%} of the epoch, "
          f"{figures['watch_s'] / steps * 1e6:.1f} us a step "
          f"({figures['watch_batches_s'] / steps * 1e6:.1f} its per-batch part), CPU "
          f"{figures['watch_cpu_s'] / figures['epoch_cpu_s']:.3%} of the rank's")
    for path, part in figures["parts"].items():
        print(f"{path}: {part['calls']} calls, {part['s'] * 1e3:.2f} ms an epoch, "
              f"{part['s'] / steps * 1e6:.2f} us a step, "
              f"{part['s'] / max(part['calls'], 1) * 1e6:.1f} us a call")


if __name__ == "__main__":
    main()
