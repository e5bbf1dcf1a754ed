"""Simulated ranks in one process (STYLE.md's first test layer).

`SimAccelerator(world, rank)` stands in for a rank's Accelerator: its `prepare` is accelerate's
own `prepare_data_loader` told the world size and rank, so the loaders built by
sharddemo.loaders shard exactly as they would on that rank, without any process group.
"""

from __future__ import annotations

import torch
from accelerate.data_loader import prepare_data_loader


class SimAccelerator:
    def __init__(self, world: int, rank: int, **prepare_kwargs) -> None:
        self.num_processes = world
        self.process_index = rank
        self.is_main_process = rank == 0
        self.device = torch.device("cpu")
        self.prepare_kwargs = prepare_kwargs

    def prepare(self, loader):
        return prepare_data_loader(loader, num_processes=self.num_processes,
                                   process_index=self.process_index, put_on_device=False,
                                   rng_types=[], **self.prepare_kwargs)


def walk(plan, epochs: int) -> list[list[list[int]]]:
    """Every epoch's batches (as ids) of a LoaderPlan on one simulated rank."""
    from sharddemo.datasets import values_to_ids

    out = []
    for epoch in range(epochs):
        if plan.sampler is not None:
            plan.sampler.set_epoch(epoch)
        out.append([values_to_ids(b) for b in plan.loader])
    return out
