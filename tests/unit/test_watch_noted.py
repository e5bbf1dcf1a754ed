"""sharddemo.watch keeps a batch sampler's index lists as they come and books them a few dozen
at a time (WatchState.note_batches). What it reports must still be what the loop received,
batch after batch: checked here in one process against the ids the loop itself got (the
dataset returns each sample's index), never against the watch's own record, across batch sizes
that end an epoch with a short batch, a sampler that reuses one list object, a checkpoint
taken between two bookings, and an order that repeats or changes from one epoch to the next."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from support.oracle import Ids
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from sharddemo import watch


class ReusedList:
    """A batch sampler that yields ONE list object, refilled in place for every batch (some
    users' samplers do), over a fixed permutation and then its first batch once more (a
    repeat the watch must count)."""

    def __init__(self, n: int, batch: int) -> None:
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
        self.batch = batch

    def __iter__(self):
        out: list = []
        cuts = [self.order[i:i + self.batch] for i in range(0, len(self.order), self.batch)]
        for part in [*cuts, cuts[0]]:
            out.clear()
            out.extend(part)
            yield out

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch) + 1


def entries(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected(received: list[list[int]], n: int) -> tuple:
    """seen, unique, the ids received more than once, the ids never received, the steps: from
    the loop's own batches."""
    counts = collections.Counter(i for batch in received for i in batch)
    return (sum(counts.values()), len(counts), sorted(i for i, c in counts.items() if c > 1),
            sorted(set(range(n)) - set(counts)), [len(received)])


@pytest.mark.parametrize("n,batch,drop_last", [(250, 7, False), (250, 7, True), (100, 1, False),
                                               (4000, 64, False), (30, 64, False)])
def test_what_the_watch_counts_is_what_the_loop_received(tmp_path, n, batch, drop_last):
    """250 / 7: 35 full batches and one of 5 (or dropped), past one booking of 32; 100 / 1:
    three bookings and a part; 4,000 / 64: 62 of 64 and one of 32; 30 / 64: one short batch."""
    report = tmp_path / "r.jsonl"
    loader = watch(DataLoader(Ids(n), batch_size=batch, shuffle=True, drop_last=drop_last),
                   report=str(report), on_violation="ignore")
    received = [b.tolist() for b in loader]
    [entry] = entries(report)
    seen, unique, again, never, steps = expected(received, n)
    assert (entry["seen"], entry["unique"], entry["duplicated"]["ids"], entry["steps"]) == (
        seen, unique, again, steps)
    assert entry["missing"]["count"] == len(never)
    assert entry["missing"]["ids"] == never[:len(entry["missing"]["ids"])]


def test_a_sampler_that_reuses_its_list_is_counted_batch_by_batch(tmp_path):
    """The list object is refilled after every batch: a watch that kept the object, not its
    contents, would count the last batch 37 times. 250 / 7: 36 batches of the permutation and
    its first batch again, so 7 samples twice."""
    report = tmp_path / "r.jsonl"
    loader = watch(DataLoader(Ids(250), batch_sampler=ReusedList(250, 7)), report=str(report),
                   on_violation="ignore")
    received = [b.tolist() for b in loader]
    [entry] = entries(report)
    seen, unique, again, never, steps = expected(received, 250)
    assert (seen, unique, len(again), never, steps) == (257, 250, 7, [], [37])  # (by hand)
    assert (entry["seen"], entry["unique"], entry["duplicated"]["ids"], entry["steps"]) == (
        seen, unique, again, steps)
    assert entry["missing"]["count"] == 0


@pytest.mark.parametrize("stop", [1, 31, 32, 33, 45])
def test_a_checkpoint_between_two_bookings_holds_every_batch_so_far(stop):
    """state_dict() at step `stop` (around the booking of 32 batches): the samples it says
    this epoch delivered are those of the loop's first `stop` batches."""
    loader = watch(DataLoader(Ids(500), batch_size=5, shuffle=True), report=None)
    received: list = []
    state = None
    for batch in loader:
        received.extend(batch.tolist())
        if len(received) == 5 * stop:
            state = loader.__dict__["_sharddemo_watch"].state_dict()
    assert state is not None
    assert sorted(torch.nonzero(state["before"]).flatten().tolist()) == sorted(received[:5 * stop])


def test_an_order_that_repeats_is_told_from_one_that_changes(tmp_path):
    """Two epochs of a RandomSampler whose generator is re-seeded alike before each (the same
    permutation twice, as torch draws it), then two with a generator left to run: the watch's
    order verdict follows the loop's own ids."""
    report = tmp_path / "r.jsonl"
    generator = torch.Generator()
    loader = watch(DataLoader(Ids(300), batch_sampler=BatchSampler(
        RandomSampler(Ids(300), generator=generator), batch_size=6, drop_last=False)),
        report=str(report), on_violation="ignore")
    epochs = []
    for epoch in range(4):
        if epoch < 2:
            generator.manual_seed(7)
        epochs.append([i for b in loader for i in b.tolist()])
    assert epochs[0] == epochs[1] and epochs[2] != epochs[1] and epochs[3] != epochs[2]
    got = [e["order_changed"] for e in entries(report)]
    assert got[1:] == [False, True, True], got
