"""The shapes of the plain data the sides hand each other, as types for mypy.

The trace (docs/trace.schema.json), its modes, one epoch record (the id path's
rank.recorder.epoch_record and the count path's rank.counting summary), an epoch's coverage
(analysis.views.coverage, or the count path's `coverage`) and the loader description
(rank.describe.describe_loader). TypedDicts: at run time they are the same plain dicts, read
from JSON or made on the ranks; `total=False` where a key may be absent (older traces, the
other path's record, a loader that does not say).
"""

from __future__ import annotations

from typing import Any, Optional, TypedDict


class Draws(TypedDict, total=False):
    """How the loader draws its samples where it draws with or without replacement."""

    sampler: str
    replacement: bool
    count: Optional[int]
    repeated_indices: bool
    cycle: bool  # a stream that cycles its data, a window a pass (litdata's ParallelStreamingDataset)


class LoaderDescription(TypedDict, total=False):
    """What a loader is made of, read from its objects (rank.describe.describe_loader)."""

    prepared: bool
    distributed_sampler: bool
    batch_sampler_shard: bool
    iterable_shard: bool
    dispatcher: bool
    even_batches: Optional[bool]
    split_batches: Optional[bool]
    drop_last: bool
    seedable_sampler: bool
    sampler_padding: int
    split_over: Optional[int]  # the ranks its sampler or shard splits over
    classes: list[str]
    num_workers: int
    iterable_dataset: bool
    dataset_shards: Optional[int]
    domain: Optional[int]
    draws: Optional[Draws]
    shuffled: Optional[bool]
    stream: str  # the library a stream comes from, where the watch knows it: "datasets"
    shard_batch_size: int
    batch_sampler_class: str
    ray_data: dict[str, Any]  # watching.raydata: a Ray Data iterator's split


class ForMetrics(TypedDict):
    """What gather_for_metrics returned over a counted epoch (rank.counting.for_metrics)."""

    count: int
    exact: bool


class Coverage(TypedDict, total=False):
    """Which ids an epoch delivered how often, over all ranks (analysis.views.coverage).

    The count path's adds ranks_per_sample, repeated_within_a_rank, on_several_ranks and
    for_metrics (rank.counting); its `missing` is capped."""

    seen: int
    unique: int
    missing: list[int]
    missing_count: int
    out_of_range: list[int]
    duplicates: list[tuple[int, int]]  # (id, copies); lists of two when read from JSON
    duplicate_count: int
    most_copies: int
    most_copies_exact: bool
    ranks_per_sample: list[int]
    repeated_within_a_rank: int
    on_several_ranks: int
    for_metrics: Optional[ForMetrics]


class IdsRank(TypedDict, total=False):
    """One rank's epoch on the id path: every batch, and the DataLoader worker of each."""

    rank: int
    batches: list[list[int]]
    workers: list[int]  # -1: the main process, -2: not known


class CountedRank(TypedDict, total=False):
    """One rank's epoch on the count path (rank.counting.wire.unpack_detail)."""

    rank: int
    steps: int
    samples: int
    sizes: list[list[int]]  # run-length batch sizes: [size, times]
    workers: dict[Any, list[int]]  # worker -> [batches, samples]; str keys when read from JSON
    head: list[list[int]]
    tail: list[list[int]]
    head_workers: list[int]
    tail_workers: list[int]
    repeats: list[list[int]]
    repeats_total: int
    distinct: int
    out_of_range: list[int]
    out_of_range_total: int
    order_hash: str
    ascending: bool
    remainder: Optional[int]


class EpochRecord(TypedDict, total=False):
    """One epoch of one loader as the ranks recorded it (sharddemo.record).

    `gather` "batch" or "epoch": the id path (ranks of IdsRank, gathered_for_metrics,
    remainder); "count": the count path (ranks of CountedRank, coverage)."""

    epoch: int
    gather: str
    ranks: list[Any]  # IdsRank or CountedRank, as `gather` says
    gathered_for_metrics: Optional[list[int]]
    remainder: Optional[list[Optional[int]]]
    coverage: Coverage


class TraceMode(TypedDict, total=False):
    """One mode (one loader) of a trace: its epochs and how the loader was made."""

    description: str
    prepared: bool
    loader: Optional[LoaderDescription]
    fingerprint: Any
    epochs: list[EpochRecord]
    raised: list[dict[str, Any]]
    raises_by_design: bool
    hint: Optional[str]
    sizes: dict[str, Any]
    role: str
    settings: Any
    note: str
    streams: Any
    set_epoch_called: bool
    grad_accum: int


class Trace(TypedDict, total=False):
    """What the ranks wrote (docs/trace.schema.json): the run's header and its modes."""

    schema: str
    world_size: int
    backend: str
    distributed_type: Optional[str]
    device: Optional[str]
    source: str
    dataset_size: int
    batch_size: int
    batch_size_seen: bool
    global_batch: int
    epochs: int
    seed: int
    options: dict[str, Any]
    arithmetic: Any
    placement: Optional[list[dict[str, Any]]]
    fingerprint: Any
    modes: dict[str, TraceMode]
    timings: Any
    phase: str
    results: Any
    steps: Any
    launch: Any
    stop: Any
    # the device mesh of --mesh (rank.mesh.RankMesh.trace)
    mesh: Any
    # True on a trace whose ranks are a mesh's data-parallel groups (analysis.mesh.groups_trace,
    # the watch's trace on a mesh): the words say "data-parallel groups", not "ranks"
    groups: bool
