"""A buggy factory: a DistributedSampler whose epoch the training loop never sets, so every
epoch comes in the same order (audit walks the loader without calling set_epoch, as that
loop does; with --set-epoch it behaves like a loop that calls it, and passes).

    sharddemo audit examples/no_set_epoch.py:make_loader      # exit 1: order-changes-each-epoch fails
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
    return DataLoader(dataset, batch_size=16, sampler=sampler)
