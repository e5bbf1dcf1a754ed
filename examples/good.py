"""A correct factory: a plain DataLoader passed through accelerator.prepare.

    sharddemo audit examples/good.py:make_loader
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

N = 1000


def make_loader(accelerator, n: int = N):
    dataset = TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
    loader = DataLoader(dataset, batch_size=16, shuffle=True)
    return accelerator.prepare(loader)
