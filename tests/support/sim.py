"""Simulated ranks in one process (the first test layer: ranks looped over in one process).

`SimAccelerator(world, rank)` stands in for a rank's Accelerator: its `prepare` is accelerate's
own `prepare_data_loader` told the world size and rank, with the rng handling `Accelerator()`
uses (`rng_types=["generator"]`; see tests/support/oracle.py for why that is exact in one process), so
the loaders built by sharddemo.rank.loaders shard exactly as they would on that rank.
"""

from __future__ import annotations

import torch
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DataLoaderConfiguration
from support.oracle import ACCELERATOR_RNG_TYPES, ensure_accelerator_state


class SimAccelerator:
    def __init__(self, world: int, rank: int) -> None:
        self.num_processes = world
        self.process_index = rank
        self.is_main_process = rank == 0
        self.device = torch.device("cpu")
        self.dataloader_config = DataLoaderConfiguration()

    def prepare(self, loader):
        config = self.dataloader_config
        ensure_accelerator_state()
        if config.dispatch_batches:
            raise NotImplementedError("dispatch needs real ranks (rank 0 broadcasts)")
        return prepare_data_loader(loader, num_processes=self.num_processes,
                                   process_index=self.process_index, put_on_device=False,
                                   rng_types=list(ACCELERATOR_RNG_TYPES),
                                   split_batches=config.split_batches,
                                   even_batches=config.even_batches,
                                   use_seedable_sampler=config.use_seedable_sampler,
                                   dispatch_batches=config.dispatch_batches)


def walk(plan, epochs: int) -> list[list[list[int]]]:
    """Every epoch's batches (as ids) of a LoaderPlan on one simulated rank."""
    from sharddemo.rank.sources import batch_ids

    out = []
    for epoch in range(epochs):
        if plan.sampler is not None:
            plan.sampler.set_epoch(epoch)
        out.append([batch_ids(b).tolist() for b in plan.loader])
    return out
