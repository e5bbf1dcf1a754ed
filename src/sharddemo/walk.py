"""Drive any loader on a rank exactly as a training loop does and record the ids it yields.

The public interface, used by `sharddemo run`/`compare` (script.py) and `audit` alike:

    record = walk_epoch(accelerator, loader, read_ids, epoch=0, strategy="auto")

On the main process `record` is the epoch as every rank saw it (plain data, see
`EpochRecord`); elsewhere it is None. Two ways to move the ids, chosen identically on every
rank from exchanged loader lengths:

- per batch (the reference's way, and what a training loop does): every step, each rank says
  whether it still has a batch and how long it is, then the batch goes through
  `accelerator.gather` (padded to the longest, trimmed back) and, for prepared loaders,
  through `accelerator.gather_for_metrics` as well. The ranks walk in lockstep until EVERY
  rank is exhausted, so a rank with fewer steps keeps answering with "no batch" instead of
  leaving its peers in a collective it never joins. Where a training loop would hang (one rank
  out of batches while another still steps) this is recorded, not suffered.
- per epoch (large runs): each rank keeps its ids and one ragged gather brings them over at
  the end; gloo's per-call cost would otherwise dominate a toy step.

Recording never changes what the loader yields: `read_ids` only reads a batch.
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import xxhash

from sharddemo.collect import collective, exchange_ints, gather_ragged, narrowest_dtype

# Up to this many steps per rank and epoch, every batch is gathered as it comes. Beyond it,
# ids stay on the rank and are gathered once at the end of the epoch: a small gather costs
# 0.3-1.5 ms on gloo here, more than a whole step of a toy loader (docs/benchmarks.md).
PER_BATCH_GATHER_LIMIT = 100

Progress = Callable[..., None]  # (step, total, samples, scope): see progress_reporter
# read_ids(batch, tag) -> the batch's 0-based ids: `batch` is the loader's own batch, `tag` what
# sharddemo attached to it (see tag_batches below; None when untagged). It may instead return
# (values, shift), the ids being values - shift (sources.batch_values: the toy sources hold
# id + 1); the walk then subtracts where it is cheapest (the count path: once per flush).
ReadIds = Callable[[Any, Optional[dict]], Any]
UNKNOWN_WORKER = -2


def unshift(values: torch.Tensor, shift: int) -> torch.Tensor:
    """The ids held as `values` = ids + shift (ReadIds): values - shift, or `values` itself
    (no copy) where the shift is 0."""
    return values - shift if shift else values


def _read(read_ids: ReadIds, batch, known: Optional[int] = None) -> tuple[torch.Tensor, int]:
    """(the batch's 0-based ids, the worker that made it)."""
    values, worker, shift = _read_values(read_ids, batch, known)
    return unshift(values, shift), worker


def _read_values(read_ids: ReadIds, batch,
                 known: Optional[int] = None) -> tuple[torch.Tensor, int, int]:
    """(values, the worker that made the batch, shift): its ids are values - shift. `known`:
    the worker of every batch where the loader says it (known_worker); else read from the
    batch's tag (a few microseconds a batch), UNKNOWN_WORKER without one."""
    inner, tag = unwrap(batch)
    got = read_ids(inner, tag)
    values, shift = got if type(got) is tuple else (got, 0)
    if known is not None:
        return values, known, shift
    worker = UNKNOWN_WORKER
    if tag is not None and len(tag["worker"]):
        worker = int(tag["worker"][0])
    return values, worker, shift


def known_worker(loader) -> Optional[int]:
    """MAIN_PROCESS where the loader's torch DataLoader has no worker processes: the process
    that iterates it makes every batch (with dispatch_batches, rank 0's main process makes
    them all), so no batch needs a tag to say so. None where workers make them (or the
    loader is not a DataLoader): each batch's tag says which."""
    workers = getattr(base_loader(loader), "num_workers", None)
    return MAIN_PROCESS if workers == 0 else None


@dataclass
class EpochRecord:
    """One epoch as every rank saw it, on the main process.

    `ranks[r]` is rank r's batches, each a list of ids, in the order it received them.
    `for_metrics` is what `accelerator.gather_for_metrics` returned, step after step, on a
    prepared loader walked per batch (None: not called, or not reachable because a rank ran
    out of batches first). `remainder[r]` is accelerate's `gradient_state.remainder` for rank
    r's prepared loader (None when not prepared): what gather_for_metrics keeps of the last
    step, read from accelerate rather than computed here.
    """

    epoch: int
    gather: str  # "batch" or "epoch"
    ranks: list[list[list[int]]]
    for_metrics: Optional[list[int]] = None
    remainder: list[Optional[int]] = field(default_factory=list)
    # workers[r][k]: the DataLoader worker that made rank r's batch k (-1: the main process,
    # -2: not known, the loader's batches could not be tagged).
    workers: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "gather": self.gather,
                "ranks": [{"rank": r, "batches": b, "workers": w}
                          for r, (b, w) in enumerate(zip(self.ranks, self.workers))],
                "gathered_for_metrics": self.for_metrics, "remainder": self.remainder}


def safe_len(loader) -> Optional[int]:
    try:
        return len(loader)
    except TypeError:
        return None


def is_prepared(loader) -> bool:
    """True for the loaders `accelerator.prepare` returns (they report to gradient_state)."""
    return hasattr(loader, "gradient_state") and hasattr(loader, "end_of_dataloader")


def choose_gather(accelerator, loader, strategy: str, n: Optional[int] = None) -> str:
    """`batch`, `epoch` or `count`, the same on every rank (for `auto` a collective: the
    lengths are exchanged). auto: counted from COUNT_FROM samples on, where every rank knows
    the same dataset length, however few the steps (a few huge batches of a large dataset
    gathered as they came would put every id on the main process, which the count path
    exists to avoid); else every batch up to PER_BATCH_GATHER_LIMIT steps per rank; else once
    per epoch. `count` without a known length falls back to `epoch`. Callers that walk one
    loader for several epochs choose once, before the first: every strategy reports an epoch
    right (only its cost and how much it lists differ), so a loader whose length changes
    between epochs is still reported right."""
    from sharddemo.options import COUNT_FROM

    if strategy == "batch" or strategy == "epoch":
        return strategy
    if strategy == "count":
        return "count" if n is not None else "epoch"
    length = safe_len(loader)
    rows = exchange_ints(accelerator, [-1 if length is None else length, -1 if n is None else n])
    if n is not None and n >= COUNT_FROM and all(row[1] == n for row in rows):
        return "count"
    lengths = [row[0] for row in rows]
    if all(k >= 0 for k in lengths) and max(lengths, default=0) <= PER_BATCH_GATHER_LIMIT:
        return "batch"
    return "epoch"


def walk_epoch(accelerator, loader, read_ids: ReadIds, *, epoch: int,
               strategy: str = "auto", progress: Optional[Progress] = None,
               max_steps: Optional[int] = None, n: Optional[int] = None):
    """Walk one epoch of `loader` on this rank. A collective: every rank calls it together.
    `max_steps`: stop after that many batches on this rank, as a run stopped mid-epoch does
    (the loader is left where it stopped). `n`: the dataset's length where known (ids are
    0..n-1), which the count path needs. Returns an EpochRecord, or for the count path a
    counted record (a dict, see counting.py), on the main process; None elsewhere."""
    how = choose_gather(accelerator, loader, strategy, n)
    known = known_worker(loader)
    if how == "count":
        from sharddemo.counting import walk_and_count

        return walk_and_count(accelerator, loader,
                              lambda batch: _read_values(read_ids, batch, known),
                              epoch=epoch, n=int(n), progress=progress, max_steps=max_steps,
                              safe_len=safe_len)
    if how == "batch":
        return _walk_per_batch(accelerator, loader, read_ids, epoch, progress, max_steps, known)
    return _walk_then_gather(accelerator, loader, read_ids, epoch, progress, max_steps, known)


_END = object()


def _walk_per_batch(accelerator, loader, read_ids, epoch: int, progress: Optional[Progress],
                    max_steps: Optional[int] = None,
                    known: Optional[int] = None) -> Optional[EpochRecord]:
    main = accelerator.is_main_process
    world = accelerator.num_processes
    prepared = is_prepared(loader)
    total = safe_len(loader)
    ranks: list[list[list[int]]] = [[] for _ in range(world)]
    workers: list[list[int]] = [[] for _ in range(world)]
    for_metrics: Optional[list[int]] = [] if prepared else None
    iterator = iter(loader)
    alive, step, received = True, 0, 0
    while True:
        if max_steps is not None and step >= max_steps:
            alive = False
        batch = next(iterator, _END) if alive else _END
        alive = batch is not _END
        ids, worker = (_read(read_ids, batch, known) if alive
                       else (torch.empty(0, dtype=torch.int64), UNKNOWN_WORKER))
        heads = exchange_ints(accelerator, [int(alive), ids.numel(), worker])
        has = [h[0] for h in heads]
        if not any(has):
            break
        received += sum(h[1] for h in heads)
        sizes = [h[1] for h in heads]
        parts = gather_ragged(accelerator, ids, sizes)  # accelerator.gather, padded + trimmed
        if main:
            for r in range(world):
                if has[r]:
                    ranks[r].append(parts[r].tolist())
                    workers[r].append(heads[r][2])
        if for_metrics is not None:
            if all(has):
                got = _gather_for_metrics(accelerator, ids, sizes)
                if main:
                    for_metrics.extend(got)
            else:
                # A training loop would hang here: this rank's gather_for_metrics (or its
                # backward's all-reduce) would wait for ranks that have left the loop.
                for_metrics = None
        step += 1
        if progress is not None and alive:
            progress(step, total, received, "all")
    remainders = _remainders(accelerator, loader) if prepared else [None] * world
    if not main:
        return None
    return EpochRecord(epoch, "batch", ranks, for_metrics, remainders, workers)


def _gather_for_metrics(accelerator, ids: torch.Tensor, sizes: list[int]) -> list[int]:
    """accelerate's own gather_for_metrics on this step's batch, called as a user would:
    tensors when every rank's batch has the same shape, objects (`use_gather_object`) when
    they differ, since a tensor gather of unequal shapes aborts on gloo."""
    if max(sizes) == 0:
        return []
    if len(set(sizes)) == 1:
        got = collective(accelerator.gather_for_metrics, ids.to(accelerator.device))
        return got.to("cpu").tolist()
    got = collective(accelerator.gather_for_metrics, ids.tolist(), use_gather_object=True)
    return [int(i) for i in got]


def _remainders(accelerator, loader) -> list[Optional[int]]:
    """Every rank's `remainder` (accelerate's count of real samples in the last global batch;
    -1 when it does not know). A collective."""
    mine = getattr(loader, "remainder", -1)
    mine = -1 if mine is None else int(mine)
    return [row[0] for row in exchange_ints(accelerator, [mine])]


def _walk_then_gather(accelerator, loader, read_ids, epoch: int, progress: Optional[Progress],
                      max_steps: Optional[int] = None,
                      known: Optional[int] = None) -> Optional[EpochRecord]:
    local: list[torch.Tensor] = []
    made_by: list[int] = []
    total = safe_len(loader)
    received = 0
    iterator = iter(loader)
    while max_steps is None or len(local) < max_steps:  # never fetch past a stop
        batch = next(iterator, _END)
        if batch is _END:
            break
        ids, worker = _read(read_ids, batch, known)
        local.append(ids)
        made_by.append(worker)
        received += ids.numel()
        if progress is not None:
            progress(len(local), total, received)
    prepared = is_prepared(loader)
    remainder = int(getattr(loader, "remainder", -1)) if prepared else -2
    ids = torch.cat(local) if local else torch.empty(0, dtype=torch.int64)
    top = int(ids.abs().max()) if ids.numel() else 0
    heads = exchange_ints(accelerator, [len(local), ids.numel(), top, remainder])
    # One tensor per rank: the batch sizes, the batches' workers, then the ids. int32 when
    # every id fits.
    dtype = narrowest_dtype(max(h[2] for h in heads))
    sizes = torch.tensor([b.numel() for b in local], dtype=torch.int64)
    packed = torch.cat([sizes, torch.tensor(made_by, dtype=torch.int64), ids]).to(dtype)
    parts = gather_ragged(accelerator, packed, [2 * h[0] + h[1] for h in heads])
    if not accelerator.is_main_process:
        return None
    ranks, workers = [], []
    for (n_batches, _, _, _), part in zip(heads, parts):
        part = part.to(torch.int64)
        cuts = part[:n_batches].tolist()
        workers.append(part[n_batches:2 * n_batches].tolist())
        flat = part[2 * n_batches:].tolist()
        batches, start = [], 0
        for size in cuts:
            batches.append(flat[start:start + size])
            start += size
        ranks.append(batches)
    remainders = [None if h[3] == -2 else h[3] for h in heads]
    return EpochRecord(epoch, "epoch", ranks, None, remainders, workers)


def progress_reporter(accelerator, label: str,
                      env_var: str = "SHARDDEMO_PROGRESS") -> Optional[Progress]:
    """On the main rank, when the launcher asked for it (`env_var` = 1): a line on stdout at
    most twice a second, `sharddemo-progress LABEL STEP TOTAL SAMPLES SCOPE`, turned into one
    bar there. SAMPLES counts what every rank received so far (SCOPE `all`, known where the
    walk exchanges each batch's size) or what the main rank received (`rank0`)."""
    if not accelerator.is_main_process or os.environ.get(env_var) != "1":
        return None
    last = [0.0]

    def report(step: int, total: Optional[int], samples: int = 0, scope: str = "rank0") -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5:
            last[0] = now
            sys.stdout.write(f"sharddemo-progress {label} {step} {total or '?'} {samples} "
                             f"{scope}\n")
            sys.stdout.flush()

    return report


def describe_loader(loader) -> dict:
    """What the loader is made of, read from its objects (no iteration): the classes along
    loader -> batch sampler -> sampler -> dataset, and the settings that decide what a rank
    receives. The report names a duplicate's or a missing sample's reason only when the
    mechanism that causes it is really there (a DistributedSampler pads, accelerate's
    BatchSamplerShard fills, IterableDatasetShard loops around, drop_last drops).

    Two ranks, `accelerator.prepare(DataLoader(ds, batch_size=4, shuffle=True))` gives
    DataLoaderShard -> BatchSamplerShard(even_batches=True) -> BatchSampler -> RandomSampler:
    {"prepared": True, "classes": [...], "even_batches": True, "distributed_sampler": False, ...}.
    """
    seen: list[str] = []
    info: dict[str, Any] = {"prepared": is_prepared(loader), "distributed_sampler": False,
                            "batch_sampler_shard": False, "iterable_shard": False,
                            "dispatcher": type(loader).__name__ == "DataLoaderDispatcher",
                            "even_batches": None, "split_batches": None, "drop_last": False,
                            "seedable_sampler": False}
    todo, visited = [loader], set()
    while todo and len(visited) < 32:
        obj = todo.pop(0)
        if obj is None or id(obj) in visited:
            continue
        visited.add(id(obj))
        name = type(obj).__name__
        if name != "IndexedDataset":
            seen.append(name)
        if getattr(obj, "drop_last", False) is True:
            info["drop_last"] = True
        if name == "DistributedSampler" or (hasattr(obj, "num_replicas") and hasattr(obj, "rank")):
            info["distributed_sampler"] = True
        if name == "BatchSamplerShard":
            info["batch_sampler_shard"] = True
        if name == "IterableDatasetShard":
            info["iterable_shard"] = True
        if name == "SeedableRandomSampler":
            info["seedable_sampler"] = True
        for key in ("even_batches", "split_batches"):
            if isinstance(getattr(obj, key, None), bool) and info[key] is None:
                info[key] = getattr(obj, key)
        attrs = getattr(obj, "__dict__", {})
        # `_inner`: what sharddemo's IndexedDataset stands in for.
        for key in ("base_dataloader", "batch_sampler", "sampler", "dataset", "_inner"):
            child = attrs.get(key)
            if child is not None and not isinstance(child, (int, float, str, bool)):
                todo.append(child)
    info["classes"] = seen
    base = base_loader(loader)
    info["num_workers"] = int(getattr(base, "num_workers", 0) or 0)
    dataset = getattr(base, "dataset", None)
    dataset = getattr(dataset, "_inner", dataset)  # sharddemo's IndexedDataset
    info["iterable_dataset"] = isinstance(dataset, torch.utils.data.IterableDataset) or \
        type(dataset).__name__ == "IterableDataset"
    shards = getattr(dataset, "num_shards", None) or getattr(dataset, "n_shards", None)
    info["dataset_shards"] = int(shards) if isinstance(shards, int) else None
    info.update(index_domain(loader))
    info["shuffled"] = sampler_shuffles(base)
    info.update(_shard_batch_size(base))
    return info


def _shard_batch_size(base) -> dict:
    """{"shard_batch_size", "batch_sampler_class"} where accelerate's BatchSamplerShard wraps a
    batch sampler of the user's (not torch's BatchSampler, whose batches are all full but the
    last) that has a batch_size: BatchSamplerShard then deals a round only when its last batch
    holds that many (accelerate's _iter_with_no_split), and drops the rest. Else {}."""
    shard = getattr(base, "batch_sampler", None)
    inner = getattr(shard, "batch_sampler", None)
    if type(shard).__name__ != "BatchSamplerShard" or inner is None or getattr(
            shard, "split_batches", False) or isinstance(inner, torch.utils.data.BatchSampler):
        return {}
    size = getattr(shard, "batch_size", None)
    if not isinstance(size, int):
        return {}
    return {"shard_batch_size": size, "batch_sampler_class": type(inner).__name__}


def sampler_shuffles(base) -> Optional[bool]:
    """Whether the sampler that draws the dataset positions deals a new random order on every
    pass, as its own object says: False for torch's SequentialSampler and a DistributedSampler
    built with shuffle=False, True for RandomSampler (accelerate's SeedableRandomSampler is
    one), SubsetRandomSampler, WeightedRandomSampler and a shuffling DistributedSampler. None
    for anything else (a sampler of the user's, a stream): the report then reads the order
    from the ids, as unshuffled where they never decrease."""
    from torch.utils.data import (DistributedSampler, RandomSampler, SequentialSampler,
                                  SubsetRandomSampler, WeightedRandomSampler)

    sampler = _index_sampler(base)
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle)
    if isinstance(sampler, SequentialSampler):
        return False
    if isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)):
        return True
    return None


def sampler_chain(base):
    """The batch samplers and samplers under a DataLoader, outermost first: its batch_sampler
    (else its sampler), then what that one holds, down to the sampler that draws the dataset
    positions (accelerate's BatchSamplerShard -> BatchSampler -> sampler)."""
    obj = base
    for _ in range(9):
        found = getattr(obj, "batch_sampler", None)  # (not `or`: truth-testing a sampler
        nxt = found if found is not None else getattr(obj, "sampler", None)  # calls __len__)
        if nxt is None or nxt is obj:
            return
        yield nxt
        obj = nxt


def _index_sampler(base):
    """The sampler that draws the dataset positions (inside BatchSamplerShard, BatchSampler);
    None where the chain ends at a batch sampler of the user's that holds no sampler (some
    object's `batch_sampler`: it deals whole batches, its length counts batches, not
    positions)."""
    holder, last = None, None
    for nxt in sampler_chain(base):
        holder, last = (base if last is None else last), nxt
    if last is not None and getattr(holder, "batch_sampler", None) is last:
        return None
    return last


def index_domain(loader) -> dict:
    """What the loader's own objects let it deal in an epoch, read from them (no iteration):

    - `domain`: how many distinct dataset ids (the ids sharddemo records: indices of the data
      under any torch Subset, table rows of a datasets.Dataset view) the loader can deal at
      all, where a Subset (random_split), a SubsetRandomSampler or a view's indices mapping
      (train_test_split, select, filter) narrows them to fewer than the whole; else None.
    - `draws`: where the index sampler does not deal each of its positions once, its draw:
      {"sampler", "replacement", "count"} (RandomSampler(replacement=True) or num_samples,
      WeightedRandomSampler); else None. A DistributedSampler is not a draw: it shards
      (over a Subset or a view it has a domain all the same).

    random_split(ds, [40, 10])[0] in a prepared DataLoader: {"domain": 40, "draws": None}.
    Read once per loader (a Subset's ids are counted in a mask of the dataset's length)."""
    base = base_loader(loader)
    try:
        return dict(_DOMAINS[base])
    except (KeyError, TypeError):
        pass
    out = _index_domain(base)
    try:
        _DOMAINS[base] = out
    except TypeError:
        pass  # not weak-referenceable: read again next time
    return dict(out)


_DOMAINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def under_subsets(dataset) -> tuple[Any, list]:
    """(the dataset under any torch Subsets and sharddemo's IndexedDataset, each Subset's
    indices, outermost first)."""
    chain = []
    for _ in range(16):
        if isinstance(dataset, IndexedDataset):
            dataset = dataset._inner
        elif isinstance(dataset, torch.utils.data.Subset):
            chain.append(dataset.indices)
            dataset = dataset.dataset
        else:
            break
    return dataset, chain


def _index_domain(base) -> dict:
    import numpy as np

    dataset, chain = under_subsets(getattr(base, "dataset", None))
    rows = hf_rows(dataset)  # a datasets.Dataset view: its positions are these table rows
    if rows is not None:
        chain.append(rows)
    sampler = _index_sampler(base)
    out: dict[str, Any] = {"domain": None, "draws": None}
    if sampler is None:
        return out
    # A DistributedSampler shards the positions (every one, once, over the ranks): no draw
    # of its own, but a Subset or a view under it narrows them as under any sampler. One that
    # wraps the user's sampler (Lightning's DistributedSamplerWrapper, for a
    # WeightedRandomSampler say) shards that sampler's draw: the draw is the wrapped one's.
    sharded = hasattr(sampler, "num_replicas")
    wrapped = _wrapped_sampler(sampler) if sharded else None
    if wrapped is not None:
        sampler, sharded = wrapped, False
    subset_sampler = isinstance(sampler, torch.utils.data.SubsetRandomSampler)
    try:
        positions = len(sampler.indices) if subset_sampler else len(base.dataset)
        count = positions if sharded else len(sampler)
    except (TypeError, AttributeError):
        return out  # a stream, or a sampler without a length
    replacement = getattr(sampler, "replacement", False) is True
    if replacement or count != positions:
        out["draws"] = {"sampler": type(sampler).__name__, "replacement": replacement,
                        "count": int(count)}
    if chain or subset_sampler:
        ids = (np.asarray(sampler.indices, dtype=np.int64) if subset_sampler
               else np.arange(positions, dtype=np.int64))
        for indices in chain:
            ids = np.asarray(indices, dtype=np.int64)[ids]
        whole = root_length(base.dataset)
        if whole is not None and ids.size and 0 <= ids.min() and ids.max() < whole:
            seen = np.zeros(whole, dtype=bool)  # distinct ids: a mask, not a sort
            seen[ids] = True
            domain = int(np.count_nonzero(seen))
        else:
            domain = int(np.unique(ids).size)
        out["domain"] = domain if whole is None or domain < whole else None
        if domain < ids.size and out["draws"] is None:
            # indices that repeat samples (SubsetRandomSampler([0, 0, 1]), a Subset the same
            # way): the sampler deals `count` indices naming `domain` samples, repeats by design
            out["draws"] = {"sampler": type(sampler).__name__, "replacement": False,
                            "count": int(count), "repeated_indices": True}
    return out


def _wrapped_sampler(sampler):
    """The user's sampler inside a distributed sampler that shards its draw: Lightning's
    DistributedSamplerWrapper is a DistributedSampler over _DatasetSamplerWrapper(sampler),
    which keeps it as `_sampler` (catalyst's DatasetFromSampler: `sampler`). None for a
    DistributedSampler over the data itself."""
    inner = getattr(sampler, "dataset", None)
    for name in ("_sampler", "sampler"):
        found = getattr(inner, name, None)
        if isinstance(found, torch.utils.data.Sampler):
            try:  # such a wrapper is as long as the draw it stands for
                return found if len(inner) == len(found) else None
            except TypeError:
                return None
    return None


# ---------------------------------------------------------------------------------------------
# Provenance: which indices each batch was made of, and which DataLoader worker made it.
#
# A DataLoader fetches a batch's samples and collates them in one process: the main process
# with num_workers=0, else one worker. So sharddemo wraps, in the rank process and before any
# worker starts, (1) the dataset, to note each index it is asked for, and (2) the collate
# function, which runs right after in the same process, to attach those indices and the worker
# id to the batch. The loader still draws the same indices in the same order (nothing consumes
# an RNG), and only the walk sees the wrapped batch: `unwrap` gives back the user's batch.
# Batches sliced by accelerate (dispatch_batches) carry per-sample tags, so slices stay right.

TAG = "__sharddemo__"
MAIN_PROCESS = -1  # the worker id of a batch made without workers


def hf_rows(dataset):
    """The table rows a datasets.Dataset view reads, position by position, where it has an
    indices mapping (train_test_split, select, filter, shuffle): a numpy array; else None."""
    return dataset._indices.column(0).to_numpy() if _is_hf_view(dataset) else None


def _is_hf_dataset(dataset) -> bool:
    """A datasets.Dataset: an Arrow table (`data`) and an indices mapping or None."""
    return hasattr(dataset, "_indices") and hasattr(getattr(dataset, "data", None), "slice")


def _is_hf_view(dataset) -> bool:
    """A datasets.Dataset whose positions go through an indices mapping to its table's rows."""
    return _is_hf_dataset(dataset) and dataset._indices is not None


def rows_digest(dataset) -> Optional[str]:
    """For a dataset whose rows can be read as stored, running none of the user's code and
    drawing no RNG, so that ranks can tell whether position i is the same sample everywhere
    (a dataset split by rank before the loader is not): a hash of its length and of its first,
    middle and last rows. That is a datasets.Dataset with no indices mapping (its positions
    are its Arrow rows; split_dataset_by_node and Dataset.shard give each rank its own), a
    torch TensorDataset, a tensor or numpy array, and a list, tuple or range of plain values.
    None for anything else (a dataset class of the user's: reading a row runs its code)."""
    if _is_hf_dataset(dataset) and dataset._indices is None:  # positions are table rows
        data = dataset.data
        n = int(data.num_rows)
        return _rows_hash(n, [lambda i: repr(data.slice(i, 1).to_pydict()).encode()])
    import numpy as np

    if isinstance(dataset, torch.utils.data.TensorDataset):
        arrays = list(dataset.tensors)
    elif isinstance(dataset, torch.Tensor) and dataset.ndim:
        arrays = [dataset]
    elif isinstance(dataset, np.ndarray) and dataset.ndim and dataset.dtype != object:
        arrays = [dataset]  # (an object array's bytes are pointers, another in each process)
    elif isinstance(dataset, (list, tuple, range)):
        rows = dataset
        n = len(rows)
        if not all(_plain(rows[i]) for i in {0, n // 2, n - 1} if n):
            return None
        return _rows_hash(n, [lambda i: repr(rows[i]).encode()])
    else:
        return None
    if not arrays or any(len(a) != len(arrays[0]) for a in arrays):
        return None
    return _rows_hash(len(arrays[0]), [
        (lambda i, a=a: f"{a.dtype}{tuple(a.shape)}".encode() + _row_bytes(a[i]))
        for a in arrays])


def _rows_hash(n: int, readers: list) -> str:
    h = xxhash.xxh3_64(str(n).encode())
    for i in sorted({0, n // 2, n - 1}) if n else []:
        for read in readers:
            h.update(read(i))
    return h.hexdigest()


def _row_bytes(row) -> bytes:
    """One row of a tensor or array as bytes (a copy of that row alone, on the CPU)."""
    if isinstance(row, torch.Tensor):
        row = row.detach().to("cpu").reshape(-1).clone()
        return row.view(torch.uint8).numpy().tobytes() if row.numel() else b""
    import numpy as np

    return np.ascontiguousarray(row).tobytes()


def _plain(value, depth: int = 0) -> bool:
    """A value whose repr runs no user code: a number, string, bytes, None, or a tuple of
    them."""
    if value is None or type(value) in (int, float, bool, str, bytes):
        return True
    return depth == 0 and type(value) is tuple and all(_plain(v, 1) for v in value)


class IndexedDataset(torch.utils.data.Dataset):
    """Stands in for a map-style dataset: returns what it returns, and notes each index (the
    table row, for a datasets.Dataset view with an indices mapping: hf_rows)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self._rows = hf_rows(inner)
        self._fetched: list[int] = []

    def __len__(self) -> int:
        return len(self._inner)

    def __getitem__(self, index):
        if isinstance(index, (list, tuple)) or getattr(index, "ndim", 0):
            # a batch of indices in one call: a DataLoader with batch_size=None over a
            # sampler that yields lists (a BatchSampler as `sampler`), the dataset fetching
            # the whole batch at once
            rows = self._rows
            self._fetched.extend(int(i) if rows is None else int(rows[i]) for i in index)
        else:
            self._fetched.append(int(index) if self._rows is None else int(self._rows[index]))
        return self._inner[index]

    def __getitems__(self, indices):
        rows = self._rows
        self._fetched.extend(int(i) if rows is None else int(rows[i]) for i in indices)
        batched = getattr(self._inner, "__getitems__", None)
        return batched(indices) if batched else [self._inner[i] for i in indices]

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_inner"], name)

    def take(self) -> list[int]:
        out, self._fetched = self._fetched, []
        return out


class TaggingCollate:
    """Wraps a collate function: the user's batch plus, per sample, its worker and (for an
    IndexedDataset) its index."""

    def __init__(self, inner: Callable, indexed: Optional[IndexedDataset],
                 auto: bool = True) -> None:
        self.inner = inner
        self.indexed = indexed
        # auto-collation (a batch_size or batch_sampler): `samples` is the list of samples;
        # without it (batch_size=None) it is what one fetch returned, a sample or a batch
        self.auto = auto

    def __call__(self, samples):
        batch = self.inner(samples)
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else MAIN_PROCESS
        indices = self.indexed.take() if self.indexed is not None else None
        n = len(samples) if self.auto else (len(indices) if indices else 1)
        tag = {"worker": torch.full((n,), worker, dtype=torch.int64)}
        if indices is not None and len(indices) == n:
            tag["index"] = torch.tensor(indices, dtype=torch.int64)
        return {"batch": batch, TAG: tag}


def base_loader(loader):
    """The torch DataLoader inside accelerate's wrappers (they delegate to base_dataloader)."""
    return getattr(loader, "__dict__", {}).get("base_dataloader", loader)


def tag_batches(loader, record_indices: bool) -> bool:
    """Make every batch of `loader` carry its worker id (and, for map-style datasets when
    `record_indices`, the indices fetched). False when the loader is not a DataLoader whose
    collate function can be wrapped (the walk then reads batches as they are), and when there
    is nothing to record: no indices asked for and no workers (the walk knows the main
    process made every batch, known_worker). A tag costs a tensor and a dict per batch, which
    accelerate's send_to_device then walks through, and reading it back a few microseconds:
    on a toy loader as much as the rest of the walk."""
    if not record_indices and known_worker(loader) == MAIN_PROCESS:
        return False
    base = base_loader(loader)
    collate = getattr(base, "collate_fn", None)
    if collate is None or isinstance(collate, TaggingCollate) or not hasattr(base, "dataset"):
        return False
    if getattr(base, "_iterator", None) is not None:
        return False  # an iterator (and its workers) already runs with the loader as it was
    indexed = None
    dataset = base.dataset
    if record_indices and not isinstance(dataset, torch.utils.data.IterableDataset) \
            and hasattr(dataset, "__getitem__"):
        # Indices into a Subset are not sample ids: note them where the Subset (or a chain of
        # them) asks its own dataset, so the ids are the root dataset's indices.
        holder, attr = base, "dataset"
        while isinstance(getattr(holder, attr), torch.utils.data.Subset):
            holder, attr = getattr(holder, attr), "dataset"
        indexed = IndexedDataset(getattr(holder, attr))
        # DataLoader refuses to have its dataset set after construction: set it underneath.
        object.__setattr__(holder, attr, indexed)
    base.collate_fn = TaggingCollate(collate, indexed, getattr(base, "_auto_collation", True))
    return True


def is_tagged(loader) -> bool:
    return isinstance(getattr(base_loader(loader), "collate_fn", None), TaggingCollate)


def unwrap(batch) -> tuple[Any, Optional[dict]]:
    """A tagged batch -> (the user's batch, its tag); an untagged one -> (batch, None)."""
    if isinstance(batch, dict) and TAG in batch and "batch" in batch:
        return batch["batch"], batch[TAG]
    return batch, None


# ---------------------------------------------------------------------------------------------
# Fingerprint: do the ranks even agree on the data, before anything is walked?


def _order_hash(sampler) -> Optional[str]:
    """A hash of the first epoch's index order, where computing it draws from no RNG the
    loader will use: a DistributedSampler (its own generator, seeded with seed + epoch; every
    rank hashes rank 0's part of it, from a copy set to rank 0, so the ranks compare the same
    thing and none holds more than its own walk holds), accelerate's SeedableRandomSampler
    (reseeds itself on every pass), or a SequentialSampler. None for samplers whose order
    would consume a generator (RandomSampler) or says nothing new (SequentialSampler). The
    order is hashed as it streams, a chunk at a time: no second copy of it."""
    import copy
    import hashlib
    import itertools

    import numpy as np

    name = type(sampler).__name__
    if name == "DistributedSampler":
        first = copy.copy(sampler)
        first.rank, first.epoch = 0, 0
        order = iter(first)
    elif name == "SeedableRandomSampler":
        epoch = getattr(sampler, "epoch", 0)
        sampler.set_epoch(0)
        order = iter(list(sampler))
        sampler.set_epoch(epoch)
    else:
        return None  # a SequentialSampler's order says no more than the length
    digest = hashlib.sha256()
    while True:
        chunk = np.fromiter(itertools.islice(order, 1 << 16), dtype=np.int64)
        if not chunk.size:
            break
        digest.update(chunk.tobytes())
    return digest.hexdigest()[:16]


def root_length(dataset) -> Optional[int]:
    """The length of the data every rank starts from, under the views that legitimately differ
    by rank: a torch Subset, a datasets.Dataset view with an indices mapping (the whole
    table's rows: train_test_split, select, filter), sharddemo's own IndexedDataset. None for
    a stream."""
    dataset, _ = under_subsets(dataset)
    if _is_hf_view(dataset):
        return int(dataset.data.num_rows)
    try:
        return len(dataset)
    except TypeError:
        return None


def fingerprint(loader, description: Optional[dict] = None) -> dict:
    """What this rank believes the data is: dataset length (None for a stream), the sampler's
    and batch sampler's classes and seed, drop_last, batch size, workers, and a hash of the
    first epoch's order where that costs no RNG draw and the dataset is smaller than
    COUNT_FROM (above it the hash would be a second pass over the whole order; the count path
    then reports ranks that dealt from different orders as `ranks-disagree`). Every rank must
    agree."""
    from sharddemo.options import COUNT_FROM

    base = base_loader(loader)
    length = root_length(getattr(base, "dataset", None))
    batch_sampler = getattr(base, "batch_sampler", None)
    sampler = getattr(base, "sampler", None)
    # accelerate keeps the user's sampler inside its batch sampler shard
    inner = getattr(getattr(batch_sampler, "batch_sampler", batch_sampler), "sampler", sampler)
    seed = getattr(inner, "seed", None)
    if seed is None:
        seed = getattr(inner, "initial_seed", None)
    return {"dataset_length": length,
            "sampler": type(inner).__name__ if inner is not None else None,
            "batch_sampler": type(batch_sampler).__name__ if batch_sampler is not None else None,
            "seed": int(seed) if isinstance(seed, int) else None,
            "drop_last": bool(getattr(base, "drop_last", False)),
            "batch_size": getattr(base, "batch_size", None) or getattr(batch_sampler,
                                                                      "batch_size", None),
            "num_workers": int(getattr(base, "num_workers", 0) or 0),
            "order_hash": (_order_hash(inner) if inner is not None
                           and (length is None or length < COUNT_FROM) else None),
            "shards_itself": _shards_itself(description or describe_loader(loader)),
            "rows_digest": _safe_rows_digest(under_subsets(getattr(base, "dataset", None))[0])}


def _safe_rows_digest(dataset) -> Optional[str]:
    """rows_digest, or None where a row cannot be read as bytes (a tensor type that cannot be
    viewed as bytes, say): the check is then skipped, as for a dataset class of the user's."""
    try:
        return rows_digest(dataset)
    except Exception:  # noqa: BLE001 - a best-effort check before the walk, never a failure
        return None


def _shards_itself(info: dict) -> bool:
    """The loader splits the data across ranks itself (a DistributedSampler, or accelerate's
    BatchSamplerShard, IterableDatasetShard or dispatch), so every rank must start from the
    same data. A plain loader over data split by rank beforehand legitimately differs."""
    return bool(info["distributed_sampler"] or info["batch_sampler_shard"]
                or info["iterable_shard"] or info["dispatcher"])


FINGERPRINT_WORDS = {"dataset_length": "samples", "sampler": "sampler", "seed": "sampler seed",
                     "batch_sampler": "batch sampler", "drop_last": "drop_last",
                     "batch_size": "batch size", "num_workers": "DataLoader workers",
                     "order_hash": "first epoch's order (hash)"}


def agree_on_fingerprint(accelerator, loader, stop: bool = True,
                         description: Optional[dict] = None,
                         ids_by_position: bool = False) -> dict:
    """Every rank's fingerprint, exchanged with one gather. If they differ, every rank stops
    with the same one-line message naming the field and the ranks (a Disagreement, exit 1);
    with `stop=False` (compare's pitfall demos, which disagree on purpose) the message is
    returned under `disagreement` instead. `ids_by_position`: the walk will take the
    positions the DataLoader asks for as sample ids. Where the ranks read different rows
    (rows_digest), position i is not one sample: for data split by rank before the loader
    every rank stops with a UsageError asking for --id-field (by position it would read as
    replication); under a loader that shards the data itself the walk goes on (unseeded
    random data does this, harmless in a demo) and `rows_note` says what it means."""
    from accelerate.utils import gather_object

    from sharddemo.collect import collective
    from sharddemo.errors import Disagreement, UsageError

    mine = fingerprint(loader, description)
    every = [mine] if accelerator.num_processes == 1 else collective(gather_object, [mine])
    differ = len({fp["rows_digest"] for fp in every}) > 1
    same_data = any(fp["shards_itself"] for fp in every)
    if ids_by_position and differ and not same_data:
        raise UsageError(f"the ranks read different rows of a {_kind(loader)} (a dataset "
                         "split by rank before the loader: split_dataset_by_node, "
                         "Dataset.shard, or data sliced by rank), so a position the DataLoader "
                         "asks for is not the same sample on every rank; pass --id-field with "
                         "the field (column, dict key or tuple position) that holds each "
                         "sample's id")
    # each rank's own rows (a per-rank split): one rank's length is not the dataset's
    mine = {**mine, "rows_differ": differ}
    if ids_by_position and differ:
        mine["rows_note"] = (f"the ranks hold different rows of a {_kind(loader)} at the same "
                             "positions (the first, middle or last row differs: unseeded "
                             "random data, or each rank loading its own files), and the ids "
                             "here are positions: the split below is of positions, not of "
                             "samples; pass --id-field to audit by each sample's own id")
    for key, words in FINGERPRINT_WORDS.items():
        if not same_data and key not in ("sampler", "batch_sampler", "num_workers"):
            continue  # data split by rank before the loader: each rank's own may differ
        values = [fp[key] for fp in every]
        if len({repr(v) for v in values}) > 1:
            groups: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                groups.setdefault(repr(value), []).append(rank)
            # the odd ones out first, rank 0's (the reference) last
            parts = sorted(groups.values(), key=lambda ranks: (0 in ranks, len(ranks), ranks))
            said = [f"rank {', '.join(map(str, ranks))} {'has' if len(ranks) == 1 else 'have'} "
                    + _say(key, values[ranks[0]], words, first=k == 0)
                    for k, ranks in enumerate(parts)]
            message = "ranks disagree on the dataset: " + ", ".join(said)
            if stop:
                raise Disagreement(message)
            return {**mine, "disagreement": message}
    return mine


def _kind(loader) -> str:
    """The class of the dataset under any Subset, as a person names it."""
    dataset, _ = under_subsets(getattr(base_loader(loader), "dataset", None))
    if _is_hf_dataset(dataset):
        return "datasets.Dataset"
    return type(dataset).__name__


def _say(key: str, value: Any, words: str, first: bool = True) -> str:
    """`9,999 samples` the first time, then `10,000`: the words once, as a person says it."""
    if key == "dataset_length" and isinstance(value, int):
        return f"{value:,} samples" if first else f"{value:,}"
    if key == "dataset_length":
        return "a stream with no length"
    return f"{words} {value}"
