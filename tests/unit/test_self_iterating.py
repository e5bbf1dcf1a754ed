"""sharddemo.watch on a loader that is its own iterator (`__iter__` returns self, `__next__`
yields), in one process. The loader below has the shape of Ray Train's _WrappedDataLoader
(ray.train.torch.prepare_data_loader, ray 2.60): it copies the base loader's __dict__, so it
shares the base loader's sampler and batch sampler, and iterates the base loader inside.
Expected values: the batches the base loader itself yields (torch's own sampler order)."""

from __future__ import annotations

import json

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from sharddemo import watch


class SelfIteratingLoader(DataLoader):
    """As Ray's _WrappedDataLoader: one batch prefetched ahead, None at the end."""

    def __init__(self, base_dataloader: DataLoader) -> None:
        self.__dict__.update(getattr(base_dataloader, "__dict__", {}))
        self._dataloader = base_dataloader
        self.dataloader_iter = None
        self.next_batch = None

    def __len__(self) -> int:
        return len(self._dataloader)

    def _prefetch_next_batch(self) -> None:
        self.next_batch = next(self.dataloader_iter, None)

    def __iter__(self):
        self.dataloader_iter = iter(self._dataloader)
        self._prefetch_next_batch()
        return self

    def __next__(self):
        batch = self.next_batch
        if batch is None:
            raise StopIteration
        self._prefetch_next_batch()
        return batch


def test_a_loader_that_is_its_own_iterator_is_walked_once_per_pass(tmp_path):
    """10 samples, batches of 4, one rank: 3 steps an epoch, every sample once (by hand); the
    watch used to recurse without end on such a loader (RecursionError)."""
    data = TensorDataset(torch.arange(10))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    report = tmp_path / "w.jsonl"
    watched = watch(SelfIteratingLoader(DataLoader(data, batch_size=4, sampler=sampler)),
                    report=str(report))
    plain_sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    plain = DataLoader(data, batch_size=4, sampler=plain_sampler)
    assert isinstance(watched, SelfIteratingLoader) and len(watched) == 3
    for epoch in range(2):
        watched.sampler.set_epoch(epoch)  # the base loader's sampler: the same object
        plain_sampler.set_epoch(epoch)
        got = [b[0].tolist() for b in watched]
        expected = [b[0].tolist() for b in plain]
        assert got == expected, f"epoch {epoch}: the loop got {got}, torch's order {expected}"
    entries = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(e["epoch"], e["seen"], e["unique"], e["steps"], e["ok"]) for e in entries] == [
        (0, 10, 10, [3], True), (1, 10, 10, [3], True)]
    assert all(e["missing"]["count"] == 0 for e in entries)


def test_a_pass_left_early_starts_over_on_the_next(tmp_path):
    """A pass broken off after one step, then a full pass: the full pass is the loader's own
    three batches, 10 of 10 samples (by hand: 4 + 4 + 2)."""
    data = TensorDataset(torch.arange(10))
    report = tmp_path / "w.jsonl"
    watched = watch(SelfIteratingLoader(DataLoader(data, batch_size=4)), report=str(report))
    for batch in watched:
        break
    got = [b[0].tolist() for b in watched]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
