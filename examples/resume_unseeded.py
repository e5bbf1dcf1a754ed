"""A loader that does NOT resume exactly: the same loader without a seed.

    sharddemo audit examples/resume_unseeded.py:make_loader --resume-at 0:3   # FAIL resume-exact

`accelerator.save_state` does not restore the order of an epoch already begun: the restarted
run draws a new permutation and skips its first 3 batches, so some samples of epoch 0 come
twice and as many never (about 8 of 40 each way on 2 ranks).
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

N = 40


def make_loader(accelerator):
    dataset = TensorDataset(torch.arange(N))
    return accelerator.prepare(DataLoader(dataset, batch_size=4, shuffle=True))
