"""What torch, accelerate and datasets hand each rank, asked of the libraries directly.

Nothing here imports sharddemo: every expected value in the truth tests comes from these
functions (torch's DistributedSampler and DataLoader, accelerate's prepare_data_loader with the
rng handling an Accelerator uses, BatchSamplerShard, IterableDatasetShard, datasets'
split_dataset_by_node), built in this process for one rank at a time.

Why one process can stand for rank r: a prepared loader synchronises its generator from rank 0
at the start of every epoch (`rng_types=["generator"]`, what `Accelerator()` passes). Each
simulated rank here builds its loader from the same seeded generator, so its state already IS
rank 0's; the sync is then a no-op, here as on real ranks. The `unseeded` pitfall is the
exception by design: each process seeds itself (seed + rank) and the SeedableRandomSampler it
gets is not synchronised, which is why its ranks disagree; here rank r is seeded the same way.
"""

from __future__ import annotations

import atexit
import shutil
from dataclasses import dataclass

import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

# What Accelerator() passes to prepare_data_loader for a loader with its own generator.
ACCELERATOR_RNG_TYPES = ["generator"]


@dataclass(frozen=True)
class Case:
    mode: str
    n: int
    b: int
    world: int
    shuffle: bool = True
    drop_last: bool = False
    even_batches: bool = True
    split_batches: bool = False
    num_workers: int = 0
    set_epoch: bool = True
    seed: int = 5
    epochs: int = 2
    source: str = "toy"
    shards: int = 4

    def run_options(self) -> dict:
        """The same case as sharddemo's RunOptions keywords (for the code under test)."""
        return dict(dataset_size=self.n, batch_size=self.b, epochs=self.epochs, seed=self.seed,
                    modes=(self.mode,), shuffle=self.shuffle, drop_last=self.drop_last,
                    set_epoch=self.set_epoch, num_workers=self.num_workers,
                    even_batches=self.even_batches, split_batches=self.split_batches,
                    source=self.source, shards=self.shards)


class Ids(torch.utils.data.Dataset):
    """Sample i is the id i itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class IdStream(IterableDataset):
    """ids 0..n-1 in order, split by DataLoader worker (worker k yields every K-th id)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(start, self.n, step))


class WholeStream(IterableDataset):
    """ids 0..n-1 in every DataLoader worker: a stream that ignores its workers (the
    iterable-unsplit source's mistake, as its help describes it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _plain(dataset, case: Case, shuffle: bool) -> DataLoader:
    return DataLoader(dataset, batch_size=case.b, shuffle=shuffle, drop_last=case.drop_last,
                      num_workers=case.num_workers,
                      generator=torch.Generator().manual_seed(case.seed) if shuffle else None)


def _distributed(dataset, case: Case, rank: int) -> tuple[DataLoader, DistributedSampler]:
    sampler = DistributedSampler(dataset, num_replicas=case.world, rank=rank,
                                 shuffle=case.shuffle, seed=case.seed, drop_last=case.drop_last)
    return DataLoader(dataset, batch_size=case.b, sampler=sampler, drop_last=case.drop_last,
                      num_workers=case.num_workers), sampler


def ensure_accelerator_state() -> None:
    """The rng sync of a prepared loader reads AcceleratorState, which an Accelerator sets up:
    build one (world size 1, CPU) in this process, as a script would."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        Accelerator(cpu=True)


def _prepare(loader, case: Case, rank: int, **extra):
    ensure_accelerator_state()
    return prepare_data_loader(loader, num_processes=case.world, process_index=rank,
                               put_on_device=False, rng_types=list(ACCELERATOR_RNG_TYPES),
                               split_batches=case.split_batches, even_batches=case.even_batches,
                               **extra)


def _ids(batch) -> list[int]:
    if isinstance(batch, dict):
        batch = batch["id"]
    return [int(i) for i in torch.as_tensor(batch).reshape(-1)]


def _dataset(case: Case):
    if case.source == "hf":
        from datasets import Dataset

        return Dataset.from_dict({"id": list(range(case.n))}).with_format("torch")
    if case.source == "iterable":
        return IdStream(case.n)
    if case.source == "iterable-unsplit":
        return WholeStream(case.n)
    if case.source == "hf-stream":
        return _json_stream(case.n, case.shards)
    return Ids(case.n)


_STREAM_FILES: dict = {}  # (n, shards) -> the files, written once per test process


def _json_stream(n: int, shards: int):
    """ids 0..n-1 written as `shards` JSON-lines files of ceil(n / shards) ids each, in order,
    streamed by datasets (the hf-stream source, as its help describes it)."""
    import json
    import os
    import tempfile

    from datasets import load_dataset

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    files = _STREAM_FILES.get((n, shards))
    if files is None:
        folder = tempfile.mkdtemp(prefix="oracle-stream-")
        atexit.register(shutil.rmtree, folder, True)
        per, files = -(-n // shards), []
        for k in range(shards):
            path = os.path.join(folder, f"shard-{k:05d}.jsonl")
            with open(path, "w", encoding="utf-8") as handle:
                handle.writelines(json.dumps({"id": i}) + "\n"
                                  for i in range(k * per, min(n, (k + 1) * per)))
            files.append(path)
        _STREAM_FILES[(n, shards)] = files
    return load_dataset("json", data_files=files, split="train", streaming=True).with_format("torch")


def rank_epochs(case: Case, rank: int) -> list[list[list[int]]]:
    """[epoch] -> the batches (lists of ids) the libraries give `rank` for this case."""
    torch.manual_seed(case.seed)  # what set_seed does for the process
    dataset = _dataset(case)
    sampler = None
    is_stream = case.source in ("iterable", "iterable-unsplit", "hf-stream")
    if case.mode == "sampler":
        loader, sampler = _distributed(dataset, case, rank)
        if not case.set_epoch:
            sampler = None
    elif case.mode == "replicated":
        loader = _plain(dataset, case, case.shuffle and not is_stream)
    elif case.mode == "prepared":
        loader = _prepare(_plain(dataset, case, case.shuffle and not is_stream), case, rank,
                          dispatch_batches=False if is_stream else None)
    elif case.mode == "double-split":
        base, sampler = _distributed(dataset, case, rank)
        loader = _prepare(base, case, rank)
    elif case.mode == "unseeded":
        torch.manual_seed(case.seed + rank)  # every process its own seed: the pitfall
        base = DataLoader(dataset, batch_size=case.b, shuffle=True, drop_last=case.drop_last,
                          num_workers=case.num_workers)
        loader = _prepare(base, case, rank, use_seedable_sampler=True)
    elif case.mode == "split":
        from datasets.distributed import split_dataset_by_node

        shard = split_dataset_by_node(dataset, rank=rank, world_size=case.world)
        loader = _plain(shard, case, case.shuffle and not is_stream)
    else:
        raise ValueError(case.mode)
    out = []
    for epoch in range(case.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        out.append([_ids(batch) for batch in loader])
    return out


def all_ranks(case: Case) -> list[list[list[list[int]]]]:
    """[epoch][rank] -> batches, for every rank of the case."""
    per_rank = [rank_epochs(case, r) for r in range(case.world)]
    return [[per_rank[r][e] for r in range(case.world)] for e in range(case.epochs)]


def distributed_padding(case: Case) -> int:
    """How many indices torch's DistributedSampler repeats per epoch (its own total_size)."""
    sampler = DistributedSampler(Ids(case.n), num_replicas=case.world, rank=0,
                                 drop_last=case.drop_last)
    return sampler.total_size - case.n if not case.drop_last else 0


def torch_collate_error() -> tuple[BaseException, str]:
    """What torch's DataLoader raises for tests/support/factories.py's OneWideSample where the audit's
    walk meets it (epoch 1, step 1: samples 2 and 3, sample 2 two wide; here its 3rd fetch),
    and the module:function of the innermost frame it came from."""
    import os
    import traceback

    import pytest
    from support.factories import OneWideSample

    loader = torch.utils.data.DataLoader(OneWideSample(0, (0,), bad=3), batch_size=2)
    with pytest.raises(RuntimeError) as raised:
        list(loader)
    frame = traceback.extract_tb(raised.value.__traceback__)[-1]
    path = os.path.normpath(frame.filename).split(os.sep)
    module = ".".join(path[path.index("site-packages") + 1:])[:-len(".py")]
    return raised.value, f"{module}:{frame.name}"
