"""sharddemo.watch from 2^26 samples, in one process: there it counts two bits a sample a rank
(as `audit` does), and says what it said below. Expected values are literals worked out by
hand from the batches the stream yields."""

from __future__ import annotations

import json

import torch
from torch.utils.data import DataLoader, IterableDataset

from sharddemo import watch

BITS_FROM = 1 << 26  # docs/watch.md: "two bits a sample from 2^26 samples"


def test_a_stream_of_2_26_samples_is_reported_as_one_just_below(tmp_path):
    """The same two batches, [0, 1, 2, 3] and [3, 4, N - 1], with N = 2^26 - 1 (one byte a
    sample) and N = 2^26 (two bits): 7 seen, 6 distinct, 3 twice, N - 6 never seen, in both.
    A checkpoint taken mid-epoch at 2^26 keeps no per-sample state (docs/watch.md)."""
    got = {}
    for n in (BITS_FROM - 1, BITS_FROM):
        class Stream(IterableDataset):
            def __iter__(self, n=n):
                yield {"id": torch.tensor([0, 1, 2, 3])}
                yield {"id": torch.tensor([3, 4, n - 1])}

        report = tmp_path / f"{n}.jsonl"
        loader = watch(DataLoader(Stream(), batch_size=None), id_field="id", dataset_size=n,
                       report=str(report), on_violation="ignore")
        state = None
        for step, _ in enumerate(loader):
            if step == 0:
                state = loader.__dict__["_sharddemo_watch"].state_dict()
        [entry] = [json.loads(line) for line in report.read_text().splitlines()]
        got[n] = (entry["seen"], entry["unique"], entry["duplicated"]["ids"],
                  entry["missing"]["count"], entry["steps"])
        assert got[n] == (7, 6, [3], n - 6, [2]), got[n]
        assert (state["before"] is None) == (n == BITS_FROM)
