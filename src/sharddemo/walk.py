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
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from sharddemo.collect import collective, exchange_ints, gather_ragged, narrowest_dtype

# Up to this many steps per rank and epoch, every batch is gathered as it comes. Beyond it,
# ids stay on the rank and are gathered once at the end of the epoch: a small gather costs
# 0.3-1.5 ms on gloo here, more than a whole step of a toy loader (docs/benchmarks.md).
PER_BATCH_GATHER_LIMIT = 100

Progress = Callable[[int, Optional[int]], None]


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

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "gather": self.gather,
                "ranks": [{"rank": r, "batches": b} for r, b in enumerate(self.ranks)],
                "gathered_for_metrics": self.for_metrics, "remainder": self.remainder}


def safe_len(loader) -> Optional[int]:
    try:
        return len(loader)
    except TypeError:
        return None


def is_prepared(loader) -> bool:
    """True for the loaders `accelerator.prepare` returns (they report to gradient_state)."""
    return hasattr(loader, "gradient_state") and hasattr(loader, "end_of_dataloader")


def choose_gather(accelerator, loader, strategy: str) -> str:
    """`batch` or `epoch`, the same on every rank (a collective: the lengths are exchanged)."""
    if strategy in ("batch", "epoch"):
        return strategy
    lengths = [row[0] for row in exchange_ints(accelerator, [safe_len(loader) or -1])]
    known = all(n >= 0 for n in lengths)
    return "batch" if known and max(lengths, default=0) <= PER_BATCH_GATHER_LIMIT else "epoch"


def walk_epoch(accelerator, loader, read_ids: Callable[[Any], torch.Tensor], *, epoch: int,
               strategy: str = "auto", progress: Optional[Progress] = None
               ) -> Optional[EpochRecord]:
    """Walk one epoch of `loader` on this rank. A collective: every rank calls it together."""
    how = choose_gather(accelerator, loader, strategy)
    if how == "batch":
        return _walk_per_batch(accelerator, loader, read_ids, epoch, progress)
    return _walk_then_gather(accelerator, loader, read_ids, epoch, progress)


_END = object()


def _walk_per_batch(accelerator, loader, read_ids, epoch: int,
                    progress: Optional[Progress]) -> Optional[EpochRecord]:
    main = accelerator.is_main_process
    world = accelerator.num_processes
    prepared = is_prepared(loader)
    total = safe_len(loader)
    ranks: list[list[list[int]]] = [[] for _ in range(world)]
    for_metrics: Optional[list[int]] = [] if prepared else None
    iterator = iter(loader)
    alive, step = True, 0
    while True:
        batch = next(iterator, _END) if alive else _END
        alive = batch is not _END
        ids = read_ids(batch) if alive else torch.empty(0, dtype=torch.int64)
        heads = exchange_ints(accelerator, [int(alive), ids.numel()])
        has = [h[0] for h in heads]
        if not any(has):
            break
        sizes = [h[1] for h in heads]
        parts = gather_ragged(accelerator, ids, sizes)  # accelerator.gather, padded + trimmed
        if main:
            for r in range(world):
                if has[r]:
                    ranks[r].append(parts[r].tolist())
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
            progress(step, total)
    remainders = _remainders(accelerator, loader) if prepared else [None] * world
    if not main:
        return None
    return EpochRecord(epoch, "batch", ranks, for_metrics, remainders)


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


def _walk_then_gather(accelerator, loader, read_ids, epoch: int,
                      progress: Optional[Progress]) -> Optional[EpochRecord]:
    local: list[torch.Tensor] = []
    total = safe_len(loader)
    for batch in loader:
        local.append(read_ids(batch))
        if progress is not None:
            progress(len(local), total)
    prepared = is_prepared(loader)
    remainder = int(getattr(loader, "remainder", -1)) if prepared else -2
    ids = torch.cat(local) if local else torch.empty(0, dtype=torch.int64)
    top = int(ids.abs().max()) if ids.numel() else 0
    heads = exchange_ints(accelerator, [len(local), ids.numel(), top, remainder])
    # One tensor per rank: the batch sizes, then the ids. int32 when every id fits.
    dtype = narrowest_dtype(max(h[2] for h in heads))
    sizes = torch.tensor([b.numel() for b in local], dtype=torch.int64)
    packed = torch.cat([sizes, ids]).to(dtype)
    parts = gather_ragged(accelerator, packed, [h[0] + h[1] for h in heads])
    if not accelerator.is_main_process:
        return None
    ranks = []
    for (n_batches, _, _, _), part in zip(heads, parts):
        part = part.to(torch.int64)
        flat, cuts = part[n_batches:].tolist(), part[:n_batches].tolist()
        batches, start = [], 0
        for size in cuts:
            batches.append(flat[start:start + size])
            start += size
        ranks.append(batches)
    remainders = [None if h[3] == -2 else h[3] for h in heads]
    return EpochRecord(epoch, "epoch", ranks, None, remainders)


def progress_reporter(accelerator, label: str,
                      env_var: str = "SHARDDEMO_PROGRESS") -> Optional[Progress]:
    """On the main rank, when the launcher asked for it (`env_var` = 1): a line on stdout at
    most twice a second, `sharddemo-progress LABEL STEP TOTAL`, turned into one bar there."""
    if not accelerator.is_main_process or os.environ.get(env_var) != "1":
        return None
    last = [0.0]

    def report(step: int, total: Optional[int]) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5:
            last[0] = now
            sys.stdout.write(f"sharddemo-progress {label} {step} {total or '?'}\n")
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
        if name != "IndexRecorder":
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
        # `_inner`: what sharddemo's own index recorder stands in for (audit.py).
        for key in ("base_dataloader", "batch_sampler", "sampler", "dataset", "_inner"):
            child = attrs.get(key)
            if child is not None and not isinstance(child, (int, float, str, bool)):
                todo.append(child)
    info["classes"] = seen
    return info
