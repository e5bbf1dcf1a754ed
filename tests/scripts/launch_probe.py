"""What a launched rank sees, for tests/ranks/test_warm_launcher.py: each rank writes its
launch variables, its accelerate state, its generators' first draws and where it runs to
OUT/probe{RANK}.json, after an all_gather over the process group; `--exit-on R:CODE` makes
rank R exit with CODE after that.

    accelerate launch --config_file accelerate_configs/cpu2.yaml tests/scripts/launch_probe.py OUT
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import numpy
import torch
import torch.distributed as dist
from accelerate import Accelerator

# what torchrun and accelerate's launcher put in a rank's environment (MASTER_PORT aside: each
# launch its own free port)
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "ROLE_RANK", "ROLE_NAME", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                    "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--exit-on", default=None)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    ranks = [None] * accelerator.num_processes
    dist.all_gather_object(ranks, accelerator.process_index)
    seen = {
        "env": {k: v for k, v in os.environ.items()
                if k in LAUNCH_VARIABLES or k.startswith("ACCELERATE_")},
        "state": [str(accelerator.distributed_type), accelerator.num_processes,
                  accelerator.process_index, str(accelerator.device), dist.get_backend()],
        "gathered": ranks,
        "draws": [torch.initial_seed(), random.random(), float(numpy.random.random())],
        "argv": sys.argv[1:], "path0": sys.path[0], "cwd": os.getcwd(),
        "main": __name__,
    }
    with open(os.path.join(args.out, f"probe{accelerator.process_index}.json"), "w") as f:
        json.dump(seen, f)
    accelerator.wait_for_everyone()
    if args.exit_on:
        rank, code = map(int, args.exit_on.split(":"))
        if accelerator.process_index == rank:
            sys.exit(code)
    accelerator.end_training()


if __name__ == "__main__":
    main()
