"""One function per mode: (accelerator, dataset, options) -> the DataLoader a script would build.

Each builder does exactly what a user's script would do, nothing more, so what the trace records
is what torch and accelerate really hand each rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from sharddemo.options import RunOptions


@dataclass
class LoaderPlan:
    loader: Any
    # A DistributedSampler whose epoch the loop must set at the top of each epoch (None: nothing to set).
    sampler: Optional[DistributedSampler] = None
    # True when accelerator.prepare wrapped the loader (gather_for_metrics then knows the padding).
    prepared: bool = False
    # True when every rank's batch at a given step has the same shape, so a plain per-batch
    # gather is safe; False makes the trace pad each batch across ranks first.
    even_shapes: bool = True


def _generator(seed: int) -> torch.Generator:
    # A DataLoader's own generator: every rank builds the same one from the same seed.
    return torch.Generator().manual_seed(seed)


def build_prepared(accelerator, dataset: Dataset, opts: RunOptions) -> LoaderPlan:
    """`prepared`: a plain loader passed through `accelerator.prepare`.

    Two processes, N=10, B=3, no shuffle: the batch sampler yields the global batches
    [0,1,2] [3,4,5] [6,7,8] [9]; accelerate deals them round-robin, so rank 0 gets
    batches 0 and 2 and rank 1 batches 1 and 3. With `even_batches` (the default) the short
    last round is filled from the start of the epoch: rank 0 [[0,1,2],[6,7,8]],
    rank 1 [[3,4,5],[9,0,1]]. `gather` then returns 12 ids, `gather_for_metrics` 10.
    """
    loader = DataLoader(
        dataset,
        batch_size=opts.batch_size,
        shuffle=opts.shuffle,
        drop_last=opts.drop_last,
        num_workers=opts.num_workers,
        generator=_generator(opts.seed) if opts.shuffle else None,
    )
    return LoaderPlan(accelerator.prepare(loader), prepared=True)


def build_sampler(accelerator, dataset: Dataset, opts: RunOptions) -> LoaderPlan:
    """`sampler`: an explicit DistributedSampler, not prepared.

    Two processes, N=10, no shuffle: each rank takes ceil(10/2)=5 indices, rank r the
    indices r, r+2, r+4, ...: rank 0 [0,2,4,6,8], rank 1 [1,3,5,7,9]. With N=9 the sampler
    pads to 10 by repeating the first index of the epoch's order, so one sample is seen twice.
    """
    sampler = DistributedSampler(
        dataset,
        num_replicas=accelerator.num_processes,
        rank=accelerator.process_index,
        shuffle=opts.shuffle,
        seed=opts.seed,
        drop_last=opts.drop_last,
    )
    loader = DataLoader(
        dataset,
        batch_size=opts.batch_size,
        sampler=sampler,
        drop_last=opts.drop_last,
        num_workers=opts.num_workers,
    )
    return LoaderPlan(loader, sampler=sampler if opts.set_epoch else None)


def build_replicated(accelerator, dataset: Dataset, opts: RunOptions) -> LoaderPlan:
    """`replicated`: a plain loader, not prepared, no sampler.

    Every rank iterates all N samples: two processes see 2N samples per epoch between them.
    With the same seed on every rank (as `set_seed` gives) they even walk the same order.
    """
    loader = DataLoader(
        dataset,
        batch_size=opts.batch_size,
        shuffle=opts.shuffle,
        drop_last=opts.drop_last,
        num_workers=opts.num_workers,
        generator=_generator(opts.seed) if opts.shuffle else None,
    )
    return LoaderPlan(loader)


BUILDERS: dict[str, Callable[..., LoaderPlan]] = {
    "prepared": build_prepared,
    "sampler": build_sampler,
    "replicated": build_replicated,
}


def build_loader(mode: str, accelerator, dataset: Dataset, opts: RunOptions) -> LoaderPlan:
    return BUILDERS[mode](accelerator, dataset, opts)
