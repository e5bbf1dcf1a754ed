"""A stream of sample ids as large training sets are read: no length, split by rank and by
DataLoader worker at the source, in tensor batches of 4096 (DataLoader batch_size=None). It
costs almost nothing to make, so what an audit of it costs is the audit's own.

    sharddemo audit examples/huge_stream.py:billion --id-field . --dataset-size 1000000000
    sharddemo audit examples/huge_stream.py:million --id-field . --dataset-size 1000000

Rank r of W, worker k of K takes the blocks b of 4096 ids with b % (W * K) == r * K + k: each
id once an epoch, over all ranks and workers. benchmarks/run.py (`huge`) audits it from 10^6
to 10^9 samples beside the same stream walked with nothing recorded.
"""

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

BLOCK = 4096
WORKERS = 2


class IdStream(IterableDataset):
    def __init__(self, n: int, rank: int, world: int) -> None:
        self.n, self.rank, self.world = n, rank, world

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        part, parts = self.rank * workers + worker, self.world * workers
        for start in range(part * BLOCK, self.n, parts * BLOCK):
            yield torch.arange(start, min(start + BLOCK, self.n))


def make(accelerator, n: int, workers: int = WORKERS) -> DataLoader:
    return DataLoader(IdStream(n, accelerator.process_index, accelerator.num_processes),
                      batch_size=None, num_workers=workers)


def million(accelerator):
    return make(accelerator, 10**6)


def ten_million(accelerator):
    return make(accelerator, 10**7)


def hundred_million(accelerator):
    return make(accelerator, 10**8)


def billion(accelerator):
    return make(accelerator, 10**9)


def just_past_bits(accelerator):
    """2^26 + 16,384 ids (16,388 whole blocks, as many for each of 2 or 4 ranks), made in each
    rank's own process (no workers), just past where the count path keeps 2 bits a sample
    (options.BITS_FROM)."""
    return make(accelerator, (1 << 26) + 4 * BLOCK, workers=0)
