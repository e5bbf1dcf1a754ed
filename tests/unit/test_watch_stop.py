"""A watched loop that stops mid-epoch (a `break`, a new pass, close), in one process: the
epoch so far is reported as partial, with the verdicts a part supports. Expected values are
literals worked out by hand. On real ranks: tests/ranks/test_watch_stop.py."""

from __future__ import annotations


import pytest
import torch
from support.reports import entries
from torch.utils.data import DataLoader, TensorDataset

from sharddemo import ShardingViolation, watch

WHOLE_EPOCH_ONLY = {"no-missing-samples", "order-changes-each-epoch",
                    "eval-counts-each-sample-once"}


def verdicts(entry: dict) -> set[str]:
    return {v["verdict"] for v in entry["verdicts"]}


# -- one process --------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["close", "with"])
def test_a_loop_that_breaks_is_reported_as_a_partial_epoch(tmp_path, capsys, how):
    """100 samples, batches of 8, a break after 5 steps: 40 samples (by hand), none missing."""
    report = tmp_path / "w.jsonl"
    got = []
    if how == "with":
        with watch(DataLoader(TensorDataset(torch.arange(100)), batch_size=8, shuffle=True),
                   report=str(report)) as loader:
            for step, (ids,) in enumerate(loader):
                got += ids.tolist()
                if step == 4:
                    break
    else:
        loader = watch(DataLoader(TensorDataset(torch.arange(100)), batch_size=8, shuffle=True),
                       report=str(report))
        for step, (ids,) in enumerate(loader):
            got += ids.tolist()
            if step == 4:
                break
        loader.close()
        loader.close()  # a second close does nothing
    [entry] = entries(report)
    assert entry["partial"] is True and entry["missing"] is None and entry["ok"]
    assert (entry["seen"], entry["unique"], entry["steps"]) == (len(got), len(set(got)), [5])
    assert not verdicts(entry) & WHOLE_EPOCH_ONLY
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sharddemo:")]
    assert lines == ["sharddemo: epoch 0 train (partial): 40 samples, 40 distinct, across "
                     "1 rank, 5 steps: ok"]


def test_a_partial_epoch_says_its_counts_with_the_same_separators(tmp_path, capsys):
    """2,000 samples, batches of 8, a break after 240 steps: 1,920 samples, all distinct (by
    hand); both counts with thousands separators (the trial saw "1,916 samples, 1916
    distinct")."""
    loader = watch(DataLoader(TensorDataset(torch.arange(2000)), batch_size=8, shuffle=True),
                   report=str(tmp_path / "w.jsonl"))
    for step, _ in enumerate(loader):
        if step == 239:
            break
    loader.close()
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sharddemo:")]
    assert lines == ["sharddemo: epoch 0 train (partial): 1,920 samples, 1,920 distinct, "
                     "across 1 rank, 240 steps: ok"]


def test_a_new_pass_after_a_break_ends_the_epoch_before_it(tmp_path):
    """3 epochs of 100 samples, batches of 8, each left at step 5 (a step budget per epoch):
    3 partial entries of 40 samples each (5 x 8, by hand), each holding its own epoch's ids,
    not one epoch 0 where the second pass's samples read as repeats."""
    report = tmp_path / "w.jsonl"
    loader = watch(DataLoader(TensorDataset(torch.arange(100)), batch_size=8, shuffle=True),
                   report=str(report))
    got: list[list[int]] = []
    for _ in range(3):
        got.append([])
        for step, (ids,) in enumerate(loader):
            got[-1] += ids.tolist()
            if step == 4:
                break
    loader.close()
    found = entries(report)
    assert [e["epoch"] for e in found] == [0, 1, 2]
    for mine, entry in zip(got, found):
        assert (entry["seen"], entry["unique"], entry["steps"]) == (40, len(set(mine)), [5])
        assert entry["partial"] and entry["ok"] and entry["missing"] is None


def test_close_after_whole_epochs_adds_nothing(tmp_path):
    report = tmp_path / "w.jsonl"
    loader = watch(DataLoader(TensorDataset(torch.arange(10)), batch_size=4),
                   report=str(report))
    for _ in loader:
        pass
    loader.close()
    assert [(e["epoch"], "partial" in e) for e in entries(report)] == [(0, False)]


def test_a_part_that_repeats_a_sample_fails_and_raises_at_close(tmp_path):
    """A sampler of 6 draws over 6 samples that deals 0, 1, 2 twice, stopped after 4
    batches of 1: sample 0 came twice before the loader's end (no padding explains a repeat
    there, and the sampler draws no more than the dataset holds)."""
    class Twice(torch.utils.data.Sampler):
        def __iter__(self):
            return iter([0, 1, 2, 0, 1, 2])

        def __len__(self):
            return 6

    loader = watch(DataLoader(TensorDataset(torch.arange(6)), batch_size=1, sampler=Twice()),
                   report=None, on_violation="raise")
    for step, _ in enumerate(loader):
        if step == 3:
            break
    with pytest.raises(ShardingViolation, match=r"\(partial\).*FAIL no-unexplained-dup"):
        loader.close()
