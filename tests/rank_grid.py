"""Run by tests/test_real_ranks.py under `accelerate launch`: one process group walks every
mode over a grid of (N, B, shuffle), so a single launch checks many cases on real ranks.

    accelerate launch --config_file accelerate_configs/cpu2.yaml tests/rank_grid.py OUT.json
"""

import json
import sys

from sharddemo.sources import ToyDataset
from sharddemo.options import BASIC_MODES, RunOptions
from sharddemo.trace import check_world, make_accelerator, trace_mode

GRID = [(8, 4), (10, 3), (9, 4), (1, 4), (2, 4), (6, 4), (10, 2)]


def main(out_path: str) -> None:
    accelerator = make_accelerator("cpu", timeout=30)
    check_world(accelerator.num_processes)
    results = []
    for n, b in GRID:
        for shuffle in (True, False):
            opts = RunOptions(dataset_size=n, batch_size=b, epochs=2, seed=3, shuffle=shuffle)
            for mode in BASIC_MODES:
                trace = trace_mode(accelerator, mode, ToyDataset(n), opts)
                if accelerator.is_main_process:
                    results.append({"n": n, "b": b, "shuffle": shuffle, "mode": mode,
                                    "world": accelerator.num_processes,
                                    "backend": accelerator.state.backend, "trace": trace})
    # The same cases with ids gathered once per epoch: must agree with the per-batch gathers.
    for n, b in GRID:
        opts = RunOptions(dataset_size=n, batch_size=b, epochs=2, seed=3, gather="epoch")
        for mode in BASIC_MODES:
            trace = trace_mode(accelerator, mode, ToyDataset(n), opts)
            if accelerator.is_main_process:
                results.append({"n": n, "b": b, "shuffle": True, "mode": mode, "gather": "epoch",
                                "world": accelerator.num_processes,
                                "backend": accelerator.state.backend, "trace": trace})
    if accelerator.is_main_process:
        with open(out_path, "w") as handle:
            json.dump(results, handle)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
