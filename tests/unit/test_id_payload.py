"""The id path's payload in one process (rank.recorder.IdLog): a rank's batches travel as runs
(a batch of consecutive ascending ids: its first id alone) and listed ids, in the settling
exchange where they fit its slot (ID_SLOT ints), else in a gather. Whatever the batches, the
record gives back each batch as the loop was given it; runs a second epoch meets again are the
lists the first epoch's record holds. The expected values are the batches fed in; real ranks:
tests/ranks/test_truth_ranks.py::test_the_id_path_gives_back_every_payload_whole."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from hypothesis import given, settings
from hypothesis import strategies as st

from sharddemo.rank.recorder import IdLog


def _run(first: int, size: int) -> list[int]:
    return list(range(first, first + size))


# a batch: a run, a run backwards, ids in any order (repeats too), or an empty batch
BATCH = st.one_of(
    st.builds(_run, st.integers(-5, 5000), st.integers(1, 300)),
    st.builds(lambda f, k: _run(f, k)[::-1], st.integers(0, 5000), st.integers(2, 50)),
    st.lists(st.integers(-3, 5000), min_size=0, max_size=40),
    st.builds(lambda f, k: [i + 3_000_000_000 for i in _run(f, k)], st.integers(0, 9),
              st.integers(1, 20)),
    # a few runs one after another (a shard's last batch padded from the start)
    st.builds(lambda parts: [i for f, k in parts for i in _run(f, k)],
              st.lists(st.tuples(st.integers(-2, 5000), st.integers(1, 60)), min_size=2,
                       max_size=4)),
)


def _epoch(accelerator, log: IdLog, batches, shift: int, workers) -> dict:
    for batch, worker in zip(batches, workers):
        log.add(torch.tensor(batch, dtype=torch.int64) + shift, worker, shift)
    return log.finish(accelerator, None, 0)


@settings(max_examples=150, deadline=None)
@given(batches=st.lists(BATCH, max_size=200), shift=st.sampled_from([0, 1, 7]),
       n=st.sampled_from([None, 100, 6000]), data=st.data())
def test_every_batch_comes_back_as_it_was_given(batches, shift, n, data):
    accelerator = Accelerator(cpu=True)
    workers = data.draw(st.lists(st.integers(-2, 3), min_size=len(batches),
                                 max_size=len(batches)))
    runs: dict = {}
    first = _epoch(accelerator, IdLog(n, runs), batches, shift, workers)
    rank = first["ranks"][0]
    assert rank["batches"] == batches and rank["workers"] == workers
    assert all(type(i) is int for b in rank["batches"] for i in b)
    again = _epoch(accelerator, IdLog(n, runs), batches, shift, workers)["ranks"][0]
    assert again["batches"] == batches
    is_run = [bool(b) and b == _run(b[0], len(b)) for b in batches]
    # runs are looked for while the payload may fit its 512 ints (one of them its length): a
    # batch takes its size and worker, then 2 for one run, else 2 a run where that is fewer
    # than its ids, else its ids; at most max(4, 2 + its ids), and while those add up to 511
    # at most, every batch of one run is kept as its run
    if sum(max(4, 2 + len(b)) for b in batches) <= 511:
        for old, new, run in zip(rank["batches"], again["batches"], is_run):
            if run:  # met again, it is the list the first record holds
                assert new is old


def test_a_payload_that_fits_its_slot_needs_no_gather(monkeypatch):
    """25 batches of 4096 consecutive ids (a stream read in order) ride in the exchange; a
    shuffled epoch of 400 ids in 100 batches (100 sizes, 100 workers and 400 ids: 600 ints)
    does not fit 512 ints and goes in the gather."""
    from sharddemo.rank import recorder

    accelerator = Accelerator(cpu=True)
    calls = []
    real = recorder.gather_ragged
    monkeypatch.setattr(recorder, "gather_ragged",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    stream = [_run(4096 * k, 4096) for k in range(25)]
    assert _epoch(accelerator, IdLog(None), stream, 1, [-1] * 25)["ranks"][0]["batches"] \
        == stream
    assert calls == []
    shuffled = [[(7 * i) % 400 for i in range(k, k + 4)] for k in range(0, 400, 4)]
    assert _epoch(accelerator, IdLog(None), shuffled, 0, [0] * 100)["ranks"][0]["batches"] \
        == shuffled
    assert calls == [1]
