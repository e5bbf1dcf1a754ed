"""A launch whose rank 1 stays in its script after the group's end, the first time it runs
(tests/ranks/test_warm_launcher.py: the warm launcher's straggler rule).

    torchrun --nproc_per_node 2 tests/scripts/straggler_loop.py OUT MARKER

Each rank appends a line to OUT/rank{r}.txt; rank 1 then, where MARKER does not exist yet,
makes it and sleeps (as a rank hung in its teardown does: its peer done, itself not)."""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist


def main() -> None:
    out, marker = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(out, f"rank{rank}.txt"), "a") as handle:
        handle.write("ran\n")
    dist.barrier()
    dist.destroy_process_group()
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(600)


if __name__ == "__main__":
    main()
