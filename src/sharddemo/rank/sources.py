"""Where the samples come from: the reference's toy dataset and the other sources.

Every source carries its sample ids: the toy sources yield the value id + 1 (the
reference's 1..N), the HF sources an `id` column. `batch_ids` reads either kind of batch
back as 0-based ids (`batch_values`: as values and the shift to take off), so the trace and
the report treat all sources alike.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from typing import Any, Optional

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from sharddemo.rank.ids import unshift


class ToyDataset(Dataset):
    """N samples whose values are 1..N (as in the reference). The sample id is value - 1.

    A sample is a Python int; the DataLoader's default collate turns a batch of them into an
    int64 tensor, so batches are tensors as in the reference, ids stay exact at any size (the
    reference's float32 would not past 2**24), and fetching costs well under a microsecond a
    sample. `__getitems__` is the batched fetch DataLoader uses when a dataset offers it.
    """

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for a dataset of {self.length}")
        return index + 1

    def __getitems__(self, indices: list[int]) -> list[int]:
        return [self[i] for i in indices]


class ToyIterable(IterableDataset):
    """The toy samples as a stream with no length: values 1..N in order.

    With DataLoader workers, worker k of K yields every K-th value, so the stream is read
    once per rank whatever the worker count.
    """

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self):
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(start + 1, self.length + 1, step))


class ToyIterableUnsplit(IterableDataset):
    """The common mistake: a stream that ignores DataLoader workers (and ranks).

    Every worker of every rank yields values 1..N: with K workers a rank receives each sample K
    times."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self):
        return iter(range(1, self.length + 1))


def hf_dataset(length: int):
    """A datasets.Dataset in memory: one `id` column, torch format."""
    from datasets import Dataset as HFDataset

    return HFDataset.from_dict({"id": list(range(length))}).with_format("torch")


def hf_stream(length: int, shards: int):
    """A datasets.IterableDataset streamed from `shards` JSON-lines files written locally.

    Each process writes its own copy (the same content) into a temporary folder, so no rank
    waits on another and nothing is fetched from a hub. Under a launch the folder lies in the
    launch's own temporary folder, removed with it (launch.run_launch sets TMPDIR: a rank ends
    with os._exit, which skips atexit); in a process of its own it is removed at exit.
    """
    from datasets import load_dataset

    folder = tempfile.mkdtemp(prefix="sharddemo-stream-")
    atexit.register(shutil.rmtree, folder, True)
    files = []
    per = -(-length // shards)
    for k in range(shards):
        path = os.path.join(folder, f"shard-{k:05d}.jsonl")
        with open(path, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps({"id": i}) + "\n"
                              for i in range(k * per, min(length, (k + 1) * per)))
        files.append(path)
    stream = load_dataset("json", data_files=files, split="train", streaming=True)
    return stream.with_format("torch")


class WdsShards:
    """WebDataset tar shards written locally (extra `[webdataset]`).

    Sample i is named `sample{i:06d}` (`__key__`) and holds its id i (`id.cls`). `urls(count)`
    writes the N samples in order as `count` shards whose sizes differ by at most one (a count
    above N: N shards of one), once per count, into a temporary folder of this process, removed
    as hf_stream's is.

    `shards` is the run's --shards; the webdataset modes (loaders.WDS_BUILDERS) build their
    pipeline over `urls(shards)` or, for `uneven-shards`, over another count."""

    def __init__(self, length: int, shards: int) -> None:
        self.length, self.shards = length, shards
        self._folder: Any = None
        self._written: dict[int, list[str]] = {}

    def urls(self, count: Optional[int] = None) -> list[str]:
        import webdataset as wds

        count = min(self.shards if count is None else count, self.length)
        if count not in self._written:
            if self._folder is None:
                self._folder = tempfile.mkdtemp(prefix="sharddemo-wds-")
                atexit.register(shutil.rmtree, self._folder, True)
            urls, start = [], 0
            for s in range(count):
                size = self.length // count + (s < self.length % count)
                path = os.path.join(self._folder, f"{count}-shard-{s:05d}.tar")
                with wds.TarWriter(path) as sink:
                    for i in range(start, start + size):
                        sink.write({"__key__": f"sample{i:06d}", "id.cls": i})
                urls.append(path)
                start += size
            self._written[count] = urls
        return self._written[count]


def build_source(name: str, length: int, shards: int = 4):
    if name == "toy":
        return ToyDataset(length)
    if name == "iterable":
        return ToyIterable(length)
    if name == "iterable-unsplit":
        return ToyIterableUnsplit(length)
    if name == "hf":
        return hf_dataset(length)
    if name == "hf-stream":
        return hf_stream(length, shards)
    if name == "webdataset":
        return WdsShards(length, shards)
    raise ValueError(f"unknown source {name!r}")


def stream_arithmetic(stream, world: int, num_workers: int, split: bool,
                      dispatch: bool = False) -> dict:
    """Return how HF datasets spreads a streamed dataset's files over ranks and workers.

    Asked of datasets itself: `split_dataset_by_node` per rank (whole files when the file count
    divides by W, else every W-th example of every file), then, per worker, the shard indices
    its `_iter_pytorch` gives that worker (`split_shard_indices_by_worker`).

    `dispatch`: the loader is accelerate's DataLoaderDispatcher (dispatch_batches), whose
    `_fetch_batches` reads the stream on process 0 only and sends every rank its slice: the
    other ranks read no file for their batches (0 files, no workers listed; their own DataLoader
    workers still start and prefetch, and that data is never used)."""
    from datasets.distributed import split_dataset_by_node

    files = int(stream.num_shards)
    out: dict[str, Any] = {"files": files, "world_size": world, "num_workers": num_workers,
                           "split_by_node": split, "dispatch_batches": dispatch}
    per_rank, per_worker, idle = [], [], []
    for rank in range(world):
        if dispatch and rank:
            per_rank.append(0)
            per_worker.append([])
            continue
        part = split_dataset_by_node(stream, rank=rank, world_size=world) if split else stream
        per_rank.append(int(part.num_shards))
        workers = []
        for k in range(max(num_workers, 1)):
            shards = part._ex_iterable.split_shard_indices_by_worker(
                num_shards=max(num_workers, 1), index=k, contiguous=False)
            workers.append(len(shards))
            if num_workers and not shards:
                idle.append({"rank": rank, "worker": k})
        per_worker.append(workers)
    out["how"] = ("rank 0 reads the whole stream and sends every rank its slice "
                  "(dispatch_batches)" if dispatch else
                  "every rank reads the whole stream" if not split else
                  "whole files per rank" if files % world == 0 else
                  f"every {world}-th example of every file (the {files} files do not divide by "
                  f"{world} ranks)")
    out["files_per_rank"] = per_rank
    out["files_per_worker"] = per_worker
    out["idle_workers"] = idle
    return out


def wds_arithmetic(urls: list[str], world: int, num_workers: int, mode: str) -> dict:
    """Return how WebDataset spreads the shards over ranks and DataLoader workers.

    Asked of WebDataset itself: its `split_by_node` and `split_by_worker` over the url list for
    each rank and worker (its pytorch_worker_info reads RANK/WORLD_SIZE and WORKER/NUM_WORKERS
    from the environment, set here for each in turn and restored). `mode`: which nodesplitter
    the mode's pipeline has (split and uneven-shards: split_by_node; silenced: none, every rank
    every shard; resampled: shards drawn, not split; no-nodesplitter: single_node_only, which
    raises on more than one rank)."""
    import webdataset as wds

    split = mode in ("split", "uneven-shards")
    out: dict[str, Any] = {"files": len(urls), "world_size": world, "num_workers": num_workers,
                           "split_by_node": split, "dispatch_batches": False}
    keys = ("RANK", "WORLD_SIZE", "WORKER", "NUM_WORKERS")
    saved = {k: os.environ.get(k) for k in keys}
    per_rank, per_worker, idle = [], [], []
    try:
        for rank in range(world):
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
            mine = list(wds.split_by_node(urls)) if split else list(urls)
            per_rank.append(len(mine))
            workers = []
            for k in range(max(num_workers, 1)):
                os.environ.update(WORKER=str(k), NUM_WORKERS=str(max(num_workers, 1)))
                got = len(list(wds.split_by_worker(mine)))
                workers.append(got)
                if num_workers and not got:
                    idle.append({"rank": rank, "worker": k})
            per_worker.append(workers)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    units = world * max(num_workers, 1)
    out["how"] = {
        "silenced": "nodesplitter=lambda src: src: every rank reads every shard",
        "resampled": "resampled=True: every worker draws shards with replacement (the files "
                     "listed are what it draws from)",
        "no-nodesplitter": "the default nodesplitter (single_node_only) refuses more than one "
                           "rank",
    }.get(mode, "wds.split_by_node then wds.split_by_worker: shard s to rank s mod W, then to "
                "worker (s div W) mod K" + ("" if len(urls) % units == 0 else
                                            f"; the {len(urls)} shards do not divide over "
                                            f"{world} rank(s) x {max(num_workers, 1)} "
                                            "worker(s): the ranks read unequal amounts"))
    out["files_per_rank"] = per_rank
    out["files_per_worker"] = per_worker
    out["idle_workers"] = idle
    return out


def batch_values(batch: Any) -> tuple[torch.Tensor, int]:
    """Return a batch's values and shift, from any built-in source.

    (values, shift): a 1-D int64 tensor on the CPU whose entries are the batch's 0-based ids +
    shift. The toy sources hold id + 1 (shift 1), the HF sources an `id` column (shift 0). The
    walk takes the shift off where it is cheap: the count path once per flush of
    counting.counters.FLUSH_IDS ids rather than once per batch (rank.ids.ReadIds)."""
    if isinstance(batch, dict):
        return batch["id"].reshape(-1).to("cpu", torch.int64), 0
    # Called on every batch: the reshape and conversion only where needed.
    if batch.dim() != 1:
        batch = batch.reshape(-1)
    if batch.dtype is not torch.int64 or not batch.is_cpu:
        batch = batch.to("cpu", torch.int64)
    return batch, 1


def batch_ids(batch: Any) -> torch.Tensor:
    """Return the 0-based dataset ids a batch from any built-in source holds.

    A 1-D int64 tensor on the CPU."""
    values, shift = batch_values(batch)
    return unshift(values, shift)
