"""Gradient-accumulation windows, in one process: literals worked out by hand, and properties
over random epochs (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sharddemo.analysis.accumulation import WINDOW_CAP, accumulation_windows


def test_windows_worked_by_hand():
    # rank 0 takes batches [0 1] [2 3] [4]; rank 1 [5 6] [7 8] [9]; K = 2:
    # optimizer step 0 = rank 0's [0 1 2 3] and rank 1's [5 6 7 8]; step 1 = [4] and [9]
    w = accumulation_windows([[[0, 1], [2, 3], [4]], [[5, 6], [7, 8], [9]]], 2)
    assert [x["ranks"] for x in w["windows"]] == [[[0, 1, 2, 3], [5, 6, 7, 8]], [[4], [9]]]
    assert w["optimizer_steps"] == 2 and w["last_batches"] == [1, 1] and w["uneven_last"]
    assert w["partition"] and w["in_several_windows"] == []
    # unequal step counts (a loader without even_batches): rank 1 has no batch in step 1
    w = accumulation_windows([[[0], [1], [2]], [[3], [4]]], 2)
    assert w["last_batches"] == [1, 0] and w["windows"][1]["ranks"] == [[2], []]
    # a padded id (0 again in the last batch) is in two optimizer steps
    w = accumulation_windows([[[0, 1], [2, 0]]], 1)
    assert w["in_several_windows"] == [0] and not w["uneven_last"]


batches = st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=4), max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(batches, min_size=1, max_size=3), st.integers(1, 5))
def test_windows_partition_every_rank_epoch(ranks, k):
    w = accumulation_windows(ranks, k)
    steps = [len(b) for b in ranks]
    assert w["optimizer_steps"] == max(-(-s // k) for s in steps)
    assert w["partition"]
    for r, mine in enumerate(ranks):
        laid = [i for x in w["windows"] for i in x["ranks"][r]]
        assert laid == [i for b in mine for i in b]
        assert sum(x["batches"][r] for x in w["windows"]) == len(mine)
    assert all(x["batches"][r] <= k for x in w["windows"] for r in range(len(ranks)))
    assert w["uneven_last"] == (w["optimizer_steps"] > 0 and any(b != k for b in w["last_batches"]))


def test_long_epochs_list_the_first_windows_and_the_last():
    ranks = [[[i] for i in range(WINDOW_CAP * 3)]]
    w = accumulation_windows(ranks, 1)
    assert w["optimizer_steps"] == WINDOW_CAP * 3 and w["windows_listed"] == WINDOW_CAP + 1
    assert w["windows"][-1]["window"] == WINDOW_CAP * 3 - 1
