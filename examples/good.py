"""A correct factory: a plain DataLoader passed through accelerator.prepare.

    sharddemo audit examples/good.py:make_loader
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

N = 1000


def make_loader(accelerator, n: int = N):
    data = torch.Generator().manual_seed(0)  # the same data on every rank, as files read are
    dataset = TensorDataset(torch.randn(n, 4, generator=data),
                            torch.randint(0, 2, (n,), generator=data))
    loader = DataLoader(dataset, batch_size=16, shuffle=True)
    return accelerator.prepare(loader)
