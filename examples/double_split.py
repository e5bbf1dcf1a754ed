"""A buggy factory: the loader already has a DistributedSampler, and it is prepared too, so
accelerate splits each rank's half again and some samples are never seen.

    sharddemo audit examples/double_split.py:make_loader      # exit 1: no-missing-samples fails
"""

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

N = 1000


def make_loader(accelerator):
    data = torch.Generator().manual_seed(0)  # the same data on every rank, as files read are
    dataset = TensorDataset(torch.randn(N, 4, generator=data),
                            torch.randint(0, 2, (N,), generator=data))
    sampler = DistributedSampler(dataset, num_replicas=accelerator.num_processes,
                                 rank=accelerator.process_index, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    return accelerator.prepare(loader)  # the bug: it is already sharded
