"""Batches that say where they came from: which worker made each one, and of which indices.

Which DataLoader worker made each one and, for a map-style dataset, which indices it was made
of, recorded as the dataset is asked for them (the user's batch is handed on untouched: `unwrap`
takes the tag off)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from sharddemo.rank.describe import base_loader, hf_rows

TAG = "__sharddemo__"


MAIN_PROCESS = -1  # the worker id of a batch made without workers


UNKNOWN_WORKER = -2


def known_worker(loader) -> Optional[int]:
    """Return MAIN_PROCESS where the loader has no worker processes, else None.

    Where the loader's torch DataLoader has no worker processes, the process that iterates it
    makes every batch (with dispatch_batches, rank 0's main process makes them all), so no batch
    needs a tag to say so. None where workers make them (or the loader is not a DataLoader):
    each batch's tag says which."""
    workers = getattr(base_loader(loader), "num_workers", None)
    return MAIN_PROCESS if workers == 0 else None


class IndexedDataset(torch.utils.data.Dataset):
    """Stands in for a map-style dataset: returns what it returns, and notes each index.

    The index noted is the table row for a datasets.Dataset view with an indices mapping
    (hf_rows)."""

    notes_indices = True  # what rank.describe looks for to see through it

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
    """Wraps a collate function: the user's batch plus, per sample, its worker and index.

    The index for an IndexedDataset only."""

    def __init__(self, inner: Callable, indexed: Optional[IndexedDataset],
                 auto: bool = True, sliced: bool = True) -> None:
        self.inner = inner
        self.indexed = indexed
        # a batch accelerate's dispatcher slices across the ranks needs its tag per sample, as
        # a tensor sliced with it; any other needs one worker id, and a plain list travels
        # from a worker in the pickle itself, where each tensor takes a shared-memory file of
        # its own (much slower on a large stream: docs/benchmarks.md, "Figures behind design
        # choices")
        self.sliced = sliced
        # auto-collation (a batch_size or batch_sampler): `samples` is the list of samples;
        # without it (batch_size=None) it is what one fetch returned, a sample or a batch
        self.auto = auto

    def __call__(self, samples):
        batch = self.inner(samples)
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else MAIN_PROCESS
        indices = self.indexed.take() if self.indexed is not None else None
        n = len(samples) if self.auto else (len(indices) if indices else 1)
        tag = {"worker": torch.full((n,), worker, dtype=torch.int64) if self.sliced
               else [worker]}
        if indices is not None and len(indices) == n:
            tag["index"] = torch.tensor(indices, dtype=torch.int64)
        return {"batch": batch, TAG: tag}


def tag_batches(loader, record_indices: bool, sliced: Optional[bool] = None) -> bool:
    """Make every batch of `loader` carry its worker id, and the indices fetched where asked.

    The indices for map-style datasets when `record_indices`. False when the loader is not a
    DataLoader whose collate function can be wrapped (the walk then reads batches as they are),
    and when there is nothing to record: no indices asked for and no workers (the walk knows the
    main process made every batch, known_worker). A tag costs a tensor and a dict per batch,
    which accelerate's send_to_device then walks through, and reading it back a few
    microseconds: on a toy loader as much as the rest of the walk. `sliced`: accelerate's
    dispatcher may slice the batches (a loader on its way into prepare); by default, where
    `loader` is one."""
    if sliced is None:
        sliced = type(loader).__name__ == "DataLoaderDispatcher"
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
    base.collate_fn = TaggingCollate(collate, indexed, getattr(base, "_auto_collation", True),
                                     sliced)
    return True


def is_tagged(loader) -> bool:
    return isinstance(getattr(base_loader(loader), "collate_fn", None), TaggingCollate)


def unwrap(batch) -> tuple[Any, Optional[dict]]:
    """A tagged batch -> (the user's batch, its tag); an untagged one -> (batch, None)."""
    if isinstance(batch, dict) and TAG in batch and "batch" in batch:
        return batch["batch"], batch[TAG]
    return batch, None


@contextlib.contextmanager
def tagging_prepare(accelerator, record_indices: bool):
    """Tag every DataLoader the user's factory passes to `accelerator.prepare`, on its way in.

    While the factory runs, each is tagged (tag_batches), so the loader accelerate builds from
    it carries the tags from its very first iterator. (A stateful loader starts its iterator,
    and its workers, inside prepare; tagging afterwards would miss that epoch, and replacing the
    iterator would change what it yields.) Nothing else about prepare changes."""
    from torch.utils.data import DataLoader

    original = accelerator.prepare

    def prepare(*objects, **kwargs):
        for obj in objects:
            if isinstance(obj, DataLoader):
                tag_batches(obj, record_indices=record_indices, sliced=True)
        return original(*objects, **kwargs)

    accelerator.prepare = prepare
    try:
        yield
    finally:
        del accelerator.prepare  # the bound method again
