"""The reference's toy dataset: sample i holds the value i + 1, so a value names its sample."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


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


def values_to_ids(values: torch.Tensor) -> list[int]:
    """A batch of toy values -> the 0-based dataset ids they name."""
    return (values.reshape(-1).to("cpu", torch.int64) - 1).tolist()
