"""A seeded prepared loader walked as a training loop walks it, written against accelerate
alone (set_seed(0), a shuffled DataLoader of ids 0..n-1, prepare_data_loader for each rank):
the expected values of the `audit --resume-at` chain tests, in one process and on real ranks."""

from __future__ import annotations


def library_loader(n: int, b: int, world: int, rank: int):
    """One rank's loader as every launch builds it: set_seed(0), a shuffled DataLoader of ids
    0..n-1, prepared for `world` ranks with the rng sync an Accelerator uses."""
    import torch
    from accelerate.data_loader import prepare_data_loader
    from accelerate.utils import set_seed
    from support.oracle import ACCELERATOR_RNG_TYPES, ensure_accelerator_state
    from torch.utils.data import DataLoader, TensorDataset

    ensure_accelerator_state()
    set_seed(0)
    return prepare_data_loader(DataLoader(TensorDataset(torch.arange(n)), batch_size=b,
                                          shuffle=True), num_processes=world, process_index=rank,
                               put_on_device=False, rng_types=list(ACCELERATOR_RNG_TYPES))


def ids_of(batches) -> list[list[int]]:
    return [batch[0].tolist() for batch in batches]


def uninterrupted(n, b, world, epochs):
    out = {}
    for rank in range(world):
        loader = library_loader(n, b, world, rank)
        for epoch in range(epochs):
            out.setdefault(epoch, []).append(ids_of(loader))
    return out


def flat(ranks) -> list[int]:
    return [i for batches in ranks for batch in batches for i in batch]
