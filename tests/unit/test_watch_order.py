"""Order verdicts that do not guess, and a stream's N: "the order did not change" is a fault
only for a loader meant to shuffle (a shuffling sampler, a shuffled stream); workers
interleaving a stream's shards are no shuffle. One process; expected values from the
libraries' own loaders walked unwatched, or from literals worked out by hand."""

from __future__ import annotations

import pytest
import torch
from support.reports import entries
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from sharddemo import watch


def order_verdict(entry: dict) -> dict:
    return next(v for v in entry["verdicts"] if v["verdict"] == "order-changes-each-epoch")


def two_epochs(make, **kwargs) -> tuple[list[list[int]], list[dict]]:
    """The library's own order of two epochs (unwatched), then the watch's entries."""
    plain = [[i for b in make() for i in b["id"].tolist()] for _ in range(2)]
    loader = watch(make(), report=None, id_field="id", **kwargs)
    for _ in range(2):
        for _ in loader:
            pass
    return plain, loader.__dict__["_sharddemo_watch"].entries


def test_workers_interleaving_a_datasets_stream_are_no_shuffle():
    """A datasets stream (to_iterable_dataset(num_shards=4)) read with 2 workers: the workers
    interleave the shards (ids do not rise), the same way each epoch; nothing shuffles, so the
    unchanged order is no fault."""
    datasets = pytest.importorskip("datasets")
    stream = datasets.Dataset.from_dict({"id": list(range(40))}).to_iterable_dataset(
        num_shards=4)
    plain, got = two_epochs(lambda: DataLoader(stream, batch_size=4, num_workers=2))
    assert plain[0] == plain[1] and plain[0] != sorted(plain[0])  # interleaved, unchanged
    assert got[1]["order_changed"] is False and order_verdict(got[1])["ok"] and got[1]["ok"]


def test_a_shuffled_stream_that_repeats_its_order_fails():
    """The same stream after .shuffle(seed=0), set_epoch never called: datasets draws the same
    order each epoch (its seed + epoch 0), which the watch must name."""
    datasets = pytest.importorskip("datasets")
    stream = datasets.Dataset.from_dict({"id": list(range(40))}).to_iterable_dataset(
        num_shards=4).shuffle(seed=0, buffer_size=8)
    plain, got = two_epochs(lambda: DataLoader(stream, batch_size=4))
    assert plain[0] == plain[1]  # the library's own answer: the same order twice
    assert got[1]["order_changed"] is False and not order_verdict(got[1])["ok"]
    assert "set_epoch is never called" in got[1]["line"]


class Stored(IterableDataset):
    """Rows stored in a fixed order that does not rise: 9, 3, 7, 1, 5, 0, 8, 2, 6, 4."""

    def __iter__(self):
        return iter({"id": i} for i in (9, 3, 7, 1, 5, 0, 8, 2, 6, 4))


def test_rows_stored_out_of_order_are_no_shuffle():
    plain, got = two_epochs(lambda: DataLoader(Stored(), batch_size=2))
    assert plain[0] == plain[1]
    assert order_verdict(got[1])["ok"] and got[1]["ok"]


class Head(IterableDataset):
    """A stream that delivers ids 0..19 of a dataset of 40 (its tail lost), split over the
    DataLoader's workers."""

    def __iter__(self):
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info else (0, 1)
        return iter({"id": i} for i in range(start, 20, step))


def test_dataset_size_tells_a_stream_its_n(tmp_path, capsys):
    """Without dataset_size, N is inferred from the largest id (19 + 1 = 20) and the line says
    so; with dataset_size=40 the 20 ids lost at the tail are missing (by hand)."""
    report = tmp_path / "w.jsonl"
    for size in (None, 40):
        loader = watch(DataLoader(Head(), batch_size=4), report=str(report), id_field="id",
                       dataset_size=size, name=f"n{size}")
        for _ in loader:
            pass
    inferred, told = entries(report)
    assert (inferred["dataset_size"], inferred["missing"]["count"]) == (20, 0)
    assert inferred["dataset_size_inferred"] is True
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sharddemo:")]
    assert "N = 20 inferred from the largest id seen" in lines[0]
    assert (told["dataset_size"], told["missing"]["count"]) == (40, 20)
    assert told["missing"]["ids"] == list(range(20, 40)) and not told["ok"]
    assert "dataset_size_inferred" not in told and "inferred" not in lines[1]
    assert torch.__version__


class Sparse(IterableDataset):
    """Ids from 3,000,000 on: 3,000,000..3,000,009 and 3,000,004 again (one repeat), with
    3,000,007 left out in the second epoch."""

    def __init__(self) -> None:
        self.epoch = 0

    def __iter__(self):
        ids = [3_000_000 + i for i in range(10)] + [3_000_004]
        if self.epoch:
            ids.remove(3_000_007)
        self.epoch += 1
        return iter({"id": i} for i in ids)


def test_sparse_ids_without_dataset_size_are_judged_without_an_n_from_the_largest(
        tmp_path, capsys):
    """A stream of ids far above their count and no dataset_size: N from the largest id
    (3,000,010) would cost memory for three million numbers no sample has. The 11 ids are
    judged as they are (worked by hand): 10 distinct, 3,000,004 twice, no missing verdict (N is
    unknown), and the second epoch's count against the ids of both (11 distinct)."""
    import tracemalloc

    report = tmp_path / "w.jsonl"
    loader = watch(DataLoader(Sparse(), batch_size=4), report=str(report), id_field="id")
    tracemalloc.start()
    for _ in range(2):
        for _ in loader:
            pass
    loader.close()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    first, second = entries(report)
    assert peak < 20e6  # (an analysis over N = 3,000,010 took over 300 MB)
    assert (first["seen"], first["unique"], first["dataset_size"]) == (11, 10, 10)
    assert first["duplicated"]["ids"] == [3_000_004] and first["missing"] is None
    assert first["sparse_ids"] is True and first["dataset_size_inferred"] is True
    assert "no-missing-samples" not in {v["verdict"] for v in first["verdicts"]}
    assert (second["seen"], second["unique"], second["dataset_size"]) == (10, 9, 10)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sharddemo:")]
    assert "N unknown: 10 distinct ids up to 3,000,009" in lines[0]
