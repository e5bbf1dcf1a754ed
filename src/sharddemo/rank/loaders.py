"""One function per mode: (accelerator, dataset, options) -> the DataLoader a script would build.

Each builder does exactly what a user's script would do, nothing more, so what the trace records
is what torch and accelerate really hand each rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from sharddemo.options import RunOptions


@dataclass
class LoaderPlan:
    loader: Any
    # A DistributedSampler whose epoch the loop must set at the top of each epoch (None: nothing to set).
    sampler: Optional[DistributedSampler] = None
    # True when accelerator.prepare wrapped the loader (gather_for_metrics then knows the padding).
    prepared: bool = False
    # What a pitfall mode sets up on purpose and no loader object shows: `ranks-disagree` for
    # `unseeded` (every process seeds itself differently). None for the honest modes.
    hint: Optional[str] = None
    # A loader that may refuse to start by design (WebDataset's default nodesplitter on
    # several ranks): its first batch is asked for on every rank before the walk, and a raise
    # is recorded as the mode's result (trace.probe_loader) rather than failing the run.
    probe: bool = False


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
    loader = plain_loader(dataset, opts)
    with dataloader_config(accelerator, **prepare_settings(opts)):
        prepared = accelerator.prepare(loader)
    return LoaderPlan(prepared, prepared=True)


def prepare_settings(opts: RunOptions) -> dict:
    """Return the DataLoaderConfiguration fields the options set.

    What `Accelerator(dataloader_config=DataLoaderConfiguration(...))` would say in a user's
    script."""
    return {"even_batches": opts.even_batches, "split_batches": opts.split_batches,
            "dispatch_batches": opts.dispatch_batches}


def build_sampler(accelerator, dataset: Dataset, opts: RunOptions,
                  split: Optional[tuple[int, int]] = None) -> LoaderPlan:
    """`sampler`: an explicit DistributedSampler, not prepared.

    Two processes, N=10, no shuffle: each rank takes ceil(10/2)=5 indices, rank r the
    indices r, r+2, r+4, ...: rank 0 [0,2,4,6,8], rank 1 [1,3,5,7,9]. With N=9 the sampler
    pads to 10 by repeating the first index of the epoch's order, so one sample is seen twice.
    `split`: (num_replicas, rank), on a mesh its data-parallel groups' (rank.mesh); default
    the world's (every rank its own part: `world-sampler` on a mesh).
    """
    replicas, rank = split or (accelerator.num_processes, accelerator.process_index)
    sampler = DistributedSampler(
        dataset,
        num_replicas=replicas,
        rank=rank,
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
    return LoaderPlan(plain_loader(dataset, opts))


def plain_loader(dataset, opts: RunOptions) -> DataLoader:
    """Build `DataLoader(dataset, batch_size, shuffle=True)`, as a user writes it.

    Streams have no order to shuffle: a DataLoader refuses shuffle=True for an IterableDataset.
    """
    shuffle = opts.shuffle and not isinstance(dataset, IterableDataset)
    return DataLoader(
        dataset,
        batch_size=opts.batch_size,
        shuffle=shuffle,
        drop_last=opts.drop_last,
        num_workers=opts.num_workers,
        generator=_generator(opts.seed) if shuffle else None,
    )


def build_double_split(accelerator, dataset: Dataset, opts: RunOptions,
                       split: Optional[tuple[int, int]] = None) -> LoaderPlan:
    """`double-split` (pitfall): a loader that already has a DistributedSampler, prepared too.

    The sampler gives each rank its half; accelerate then deals that half's batches
    round-robin across the ranks again. Two processes, N=10, B=2, no shuffle: rank 0's sampler
    yields [0,2,4,6,8] -> batches [0,2] [4,6] [8]; accelerate keeps batches 0 and 2 on rank 0
    and fills the round from the start: [[0,2],[8,0]]; rank 1 gets [[3,5],[7,3]]... Samples
    1, 4, 6 and 9 are never seen by anyone.
    """
    plan = build_sampler(accelerator, dataset, opts, split)
    with dataloader_config(accelerator, **prepare_settings(opts)):
        prepared = accelerator.prepare(plan.loader)
    return LoaderPlan(prepared, sampler=plan.sampler, prepared=True)


@contextlib.contextmanager
def dataloader_config(accelerator, **changes):
    """Prepare one loader with these DataLoaderConfiguration settings, then restore them.

    The Accelerator's own settings come back after. Every mode (and every test scenario) can
    share one Accelerator, so one process start serves them all."""
    old = accelerator.dataloader_config
    accelerator.dataloader_config = dataclasses.replace(old, **changes)
    try:
        yield
    finally:
        accelerator.dataloader_config = old


def build_unseeded(accelerator, dataset: Dataset, opts: RunOptions) -> LoaderPlan:
    """`unseeded` (pitfall): use_seedable_sampler=True and no seed.

    accelerate's SeedableRandomSampler then seeds each epoch from the process's own initial
    torch seed, which differs from process to process unless `set_seed` (or `data_seed`) made
    them equal. So every rank shuffles differently, takes its slice of ITS permutation, and the
    slices overlap: some samples are seen twice, others never. (Here each process starts
    from seed + rank, so that the demonstration is reproducible.)
    """
    torch.manual_seed(opts.seed + accelerator.process_index)
    loader = DataLoader(dataset, batch_size=opts.batch_size, shuffle=True,
                        drop_last=opts.drop_last, num_workers=opts.num_workers)
    with dataloader_config(accelerator, use_seedable_sampler=True, **prepare_settings(opts)):
        prepared = accelerator.prepare(loader)
    return LoaderPlan(prepared, prepared=True, hint="ranks-disagree")


def build_split(accelerator, dataset, opts: RunOptions) -> LoaderPlan:
    """`split`: datasets.distributed.split_dataset_by_node, then a plain loader, not prepared.

    Map-style: contiguous shards, sizes differing by at most one and no padding, so with
    N % W != 0 the ranks can take different numbers of steps (a DDP hang). Streams: whole
    shard files per rank when the shard count divides by W, else every W-th example.
    """
    from datasets.distributed import split_dataset_by_node

    shard = split_dataset_by_node(dataset, rank=accelerator.process_index,
                                  world_size=accelerator.num_processes)
    return LoaderPlan(plain_loader(shard, opts))


def _wds_sample(sample: dict) -> dict:
    """Return a decoded WebDataset sample's id and key.

    What a batch of the webdataset source carries: sources.batch_values reads `id`."""
    return {"id": sample["id.cls"], "__key__": sample["__key__"]}


def _wds_loader(dataset, opts: RunOptions) -> DataLoader:
    """The pipeline decoded, batched by the DataLoader as a user's loop batches it."""
    return plain_loader(dataset.decode().map(_wds_sample), opts)


def build_wds_split(accelerator, source, opts: RunOptions) -> LoaderPlan:
    """Build `split` over `--source webdataset`: WebDataset's documented split.

    `nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker`: rank r reads shards r,
    r+W, ...; its worker k every K-th of those. Each sample once per epoch where the shards
    divide over W ranks x K workers; else the ranks read unequal amounts."""
    import webdataset as wds

    return LoaderPlan(_wds_loader(wds.WebDataset(
        source.urls(), shardshuffle=False, nodesplitter=wds.split_by_node,
        workersplitter=wds.split_by_worker), opts))


def build_wds_default(accelerator, source, opts: RunOptions) -> LoaderPlan:
    """Build `no-nodesplitter`: `wds.WebDataset(urls)` with its default nodesplitter.

    That is single_node_only, which raises "you need to add an explicit nodesplitter" on more
    than one rank rather than let every rank read every shard. The raise is the point: the trace
    records it (LoaderPlan.probe)."""
    import webdataset as wds

    return LoaderPlan(_wds_loader(wds.WebDataset(source.urls(), shardshuffle=False), opts),
                      probe=True)


def _every_shard(src):
    return src


def build_wds_silenced(accelerator, source, opts: RunOptions) -> LoaderPlan:
    """Build `silenced` (pitfall): the nodesplitter's error silenced the wrong way.

    `nodesplitter=lambda src: src`: every rank reads every shard, so the ranks train on the same
    data."""
    import webdataset as wds

    return LoaderPlan(_wds_loader(wds.WebDataset(source.urls(), shardshuffle=False,
                                                 nodesplitter=_every_shard), opts))


def build_wds_resampled(accelerator, source, opts: RunOptions) -> LoaderPlan:
    """Build `resampled`: `resampled=True` with `.with_epoch(n)`.

    Every worker draws shards with replacement, for n = ceil(N / (W x max(K, 1))) samples, so
    the ranks together draw about N a epoch. Repeats and gaps are its design (sampling with
    replacement), not a bug."""
    import webdataset as wds

    per_worker = -(-opts.dataset_size // (accelerator.num_processes * max(opts.num_workers, 1)))
    dataset = (wds.WebDataset(source.urls(), resampled=True, shardshuffle=False,
                              nodesplitter=wds.split_by_node, seed=opts.seed)
               .decode().map(_wds_sample).with_epoch(per_worker))
    return LoaderPlan(plain_loader(dataset, opts))


def uneven_count(world: int, num_workers: int) -> int:
    """Return the shard count `uneven-shards` writes: one more than W x max(K, 1).

    No split over the ranks and their workers can share that many out evenly."""
    return world * max(num_workers, 1) + 1


def build_wds_uneven(accelerator, source, opts: RunOptions) -> LoaderPlan:
    """Build `uneven-shards`: the documented split over shards that do not divide evenly.

    The same N samples written as W x max(K, 1) + 1 shards: rank 0 reads one shard more than the
    last rank, so (for shards of a batch or more) it takes more steps, and DDP would hang at the
    step the others run out."""
    import webdataset as wds

    urls = source.urls(uneven_count(accelerator.num_processes, opts.num_workers))
    return LoaderPlan(_wds_loader(wds.WebDataset(
        urls, shardshuffle=False, nodesplitter=wds.split_by_node,
        workersplitter=wds.split_by_worker), opts))


# --source webdataset: its own modes (options.WDS_MODES)
WDS_BUILDERS: dict[str, Callable[..., LoaderPlan]] = {
    "split": build_wds_split,
    "no-nodesplitter": build_wds_default,
    "silenced": build_wds_silenced,
    "resampled": build_wds_resampled,
    "uneven-shards": build_wds_uneven,
}


BUILDERS: dict[str, Callable[..., LoaderPlan]] = {
    "prepared": build_prepared,
    "sampler": build_sampler,
    "replicated": build_replicated,
    "double-split": build_double_split,
    "unseeded": build_unseeded,
    "split": build_split,
    # a mesh's pitfall: the sampler over every rank of the world (sampler's default split)
    "world-sampler": build_sampler,
}


def build_mode_loader(mode: str, accelerator, dataset: Dataset, opts: RunOptions,
                      mesh=None) -> LoaderPlan:
    """The DataLoader mode `mode` builds on this rank over `dataset`, as a script would
    (BUILDERS; WDS_BUILDERS over --source webdataset). On a mesh (`mesh`: rank.mesh.RankMesh,
    already the accelerator's device mesh, so prepare deals over it) the samplers of sampler
    and double-split split over the data-parallel groups."""
    if mesh is not None and mode in ("sampler", "double-split"):
        return BUILDERS[mode](accelerator, dataset, opts, mesh.data_split)
    builders = WDS_BUILDERS if opts.source == "webdataset" else BUILDERS
    return builders[mode](accelerator, dataset, opts)
