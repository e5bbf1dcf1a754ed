"""The loader alone, for benchmarks/run.py (`huge`): a factory's loader walked one epoch on
each rank with nothing recorded; each rank writes its walk time and peak memory.

    accelerate launch --config_file accelerate_configs/cpu2.yaml benchmarks/walk_bare.py FILE.py:FACTORY OUT

OUT.rank<r>.json: {"walk_s", "peak_mb", "batches"} (peak: ru_maxrss, as the audit's own
peak_rss_mb reads it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import sys
import time


def main() -> None:
    target, out = sys.argv[1], sys.argv[2]
    path, name = target.rsplit(":", 1)
    spec = importlib.util.spec_from_file_location("bench_factory", os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec.loader.exec_module(module)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    loader = getattr(module, name)(accelerator)
    start, batches = time.perf_counter(), 0
    for _ in loader:
        batches += 1
    walk = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(f"{out}.rank{accelerator.process_index}.json", "w") as handle:
        json.dump({"walk_s": walk, "peak_mb": round(peak, 1), "batches": batches}, handle)
    accelerator.end_training()


if __name__ == "__main__":
    main()
