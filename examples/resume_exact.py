"""A loader that resumes exactly: seeded before it is built, resumed with skip_first_batches.

    sharddemo audit examples/resume_exact.py:make_loader --resume-at 0:3     # PASS resume-exact

`set_seed` makes every launch draw the same permutation, so the restarted run replays the
epoch's order and `accelerator.skip_first_batches(loader, 3)` lands where the first run stopped.
"""

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

N = 40


def make_loader(accelerator):
    set_seed(0)
    dataset = TensorDataset(torch.arange(N))
    return accelerator.prepare(DataLoader(dataset, batch_size=4, shuffle=True))
