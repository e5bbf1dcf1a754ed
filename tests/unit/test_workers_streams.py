"""Recording a loader does not change what a stateful loader yields (one process). Workers,
streams and the dataset fingerprint on real ranks: tests/ranks/test_workers_streams.py."""

from __future__ import annotations


import pytest


def test_recording_does_not_change_what_a_stateful_loader_yields():
    """The same loader, built twice from the same seed in one process, walked with and without
    sharddemo's tags: the same batches (no extra RNG draw)."""
    pytest.importorskip("torchdata")
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from sharddemo.rank.tagging import tag_batches, unwrap

    def batches(tag):
        torch.manual_seed(7)
        loader = StatefulDataLoader(torch.utils.data.TensorDataset(torch.arange(24)),
                                    batch_size=4, shuffle=True, num_workers=2)
        if tag:
            assert tag_batches(loader, record_indices=True)
        out = []
        for batch in loader:
            inner, info = unwrap(batch)
            out.append(inner[0].tolist())
            if tag:
                assert info["index"].tolist() == inner[0].tolist()  # the ids are the indices
        return out

    assert batches(True) == batches(False)
