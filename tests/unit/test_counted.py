"""The count path in one process: the walk's counters across flushes, the id path's lists,
the device counter against the host's, and the two-bit counter against what torch's and
accelerate's own samplers deal. End to end on real ranks: tests/ranks/test_counted.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from torch.utils.data import BatchSampler, DistributedSampler


def test_the_walk_counts_across_flushes_shifts_and_an_oversized_batch(monkeypatch):
    """One process (world size 1): the Recorder's count path over batches worked by hand, with
    flushes of 8 ids, so that several batches wait for one flush, the reader changes its shift
    while values wait, and one batch (9 ids) is larger than a flush."""
    import numpy as np
    import torch
    import xxhash
    from accelerate import Accelerator

    from sharddemo.rank import counting
    from sharddemo.rank.recorder import Recorder

    def walk(batches, n):
        recorder = Recorder(accelerator, lambda batch, tag: batch, how="count", n=n)
        for batch in batches:
            recorder.add(batch)
        return recorder.finish(0)

    monkeypatch.setattr(counting.counters, "FLUSH_IDS", 8)
    accelerator = Accelerator(cpu=True)
    # (values, shift): the ids are values - shift
    batches = [([1, 2], 1), ([3, 4, 5], 1), ([3, 9], 0), ([5, 6, 7, 8, 10, 11, 12, 13, 14], 0),
               ([0, 20], 0), ([3], 0)]
    # worked by hand from the above
    ids = [0, 1, 2, 3, 4, 3, 9, 5, 6, 7, 8, 10, 11, 12, 13, 14, 0, 20, 3]
    record = walk([(torch.tensor(v), s) for v, s in batches], 17)
    rank = record["ranks"][0]
    assert rank["samples"] == 19 and rank["steps"] == 6
    assert rank["sizes"] == [[2, 1], [3, 1], [2, 1], [9, 1], [2, 1], [1, 1]]
    assert rank["head"] == [[0, 1], [2, 3, 4], [3, 9]]
    assert rank["tail"] == [[5, 6, 7, 8, 10, 11, 12, 13, 14], [0, 20], [3]]
    assert rank["out_of_range"] == [20] and rank["out_of_range_total"] == 1
    assert rank["repeats"] == [[0, 2], [3, 3]] and rank["repeats_total"] == 2  # 0 x2, 3 x3
    assert rank["distinct"] == 15  # 0..14; 15 and 16 never came, 20 is outside [0, 17)
    assert record["coverage"]["missing"] == [15, 16]
    assert rank["order_hash"] == xxhash.xxh3_128(np.array(ids, dtype=np.int64)).hexdigest()
    assert rank["ascending"] is False
    # ten batches of 2, counted over several flushes: still one run of sizes, 0..19 once each
    record = walk([(torch.tensor([2 * k, 2 * k + 1]), 0) for k in range(10)], 20)
    rank = record["ranks"][0]
    assert rank["sizes"] == [[2, 10]] and rank["distinct"] == 20 and rank["ascending"] is True
    assert rank["head"] == [[0, 1], [2, 3], [4, 5]] and rank["tail"] == [[14, 15], [16, 17],
                                                                         [18, 19]]


def test_the_id_path_lists_every_id_as_a_plain_int_in_or_out_of_range():
    """One process (world size 1): the Recorder's id path (how="epoch") with the dataset's
    length known, over batches worked by hand. Ids in 0..n-1 are listed from one shared set of
    int objects, an epoch holding an id outside it (-1, n) the plain way: both give the batches
    as they were added, plain Python ints (JSON writes them as the trace always did)."""

    import torch
    from accelerate import Accelerator

    from sharddemo.rank.recorder import Recorder

    accelerator = Accelerator(cpu=True)

    def walk(batches, n):
        recorder = Recorder(accelerator, lambda batch, tag: batch, how="epoch", n=n)
        for batch in batches:
            recorder.add(torch.tensor(batch))
        return recorder.finish(0)["ranks"][0]["batches"]

    inside = [[4, 0, 9], [9], [1, 2, 3, 3]]  # all in 0..9 (n = 10)
    for got in (walk(inside, 10), walk(inside, 10)):  # twice: the second from the kept ints
        assert got == inside
        assert all(type(i) is int for batch in got for i in batch)
    outside = [[4, 0], [-1, 10], [2]]  # -1 and 10 are outside 0..9
    got = walk(outside, 10)
    assert got == outside and all(type(i) is int for batch in got for i in batch)
    assert json.dumps(walk(inside, 10)) == "[[4, 0, 9], [9], [1, 2, 3, 3]]"
    assert walk(inside, None) == inside  # no length known: the plain way


def test_the_id_path_lists_runs_other_batches_and_another_ranks_equal_batches_alike():
    """rank.recorder.list_ids, which lists each rank's ids on the main process at the epoch's
    end, over batches worked by hand (n = 10): a run of consecutive ids (cut from the shared
    list), a batch in any other order (picked one by one), a batch equal to the previous
    rank's at the same step (that rank's list), one that only starts like it, an empty batch,
    and a rank holding an id outside 0..9 (listed the plain way). Every batch as it was, in
    plain ints."""
    import numpy as np

    from sharddemo.rank.recorder import list_ids

    def listed(batches, n=10, like=None, runs=None):
        # runs: step -> the batch's runs ((first, length), ...), which travel instead of its ids
        runs = runs or {}
        flat = np.array([i for k, b in enumerate(batches) if k not in runs for i in b],
                        dtype=np.int32)
        got = list_ids(flat, [len(b) for b in batches], n, like,
                       [runs.get(k) for k in range(len(batches))])
        assert got.batches == batches and all(type(i) is int for b in got.batches for i in b)
        return got

    first = [[3, 4, 5], [9, 1], [], [7], [0, 1, 2, 3]]
    got = listed(first)
    second = [[3, 4, 5], [9, 2], [], [7], [0, 1, 2], [8]]  # steps 0, 2, 3 equal rank 0's
    again = listed(second, like=got)
    assert again.batches[0] is got.batches[0] and again.batches[3] is got.batches[3]
    listed([[3, 4, 5], [10, 2]], like=got)  # 10 is outside 0..9
    listed([[5, 4, 3], [2, 2]])
    listed([[1, 2, 3]], n=None)  # no length known: the plain way
    # runs: [3, 4, 5] and [0, 1, 2, 3] travel as one run each, [8, 9, 0, 1] as two
    ran = listed(first + [[8, 9, 0, 1]], runs={0: ((3, 3),), 4: ((0, 4),), 5: ((8, 2), (0, 2))})
    same = listed(first + [[8, 9, 0, 1]], like=ran,
                  runs={0: ((3, 3),), 4: ((0, 4),), 5: ((8, 2), (0, 2))})
    assert all(a is b for a, b in zip(same.batches, ran.batches))  # every step equal
    # a batch of runs and a listed batch of the same ids: the same lists either way, not shared
    mixed = listed(first, like=ran, runs={4: ((0, 4),)})
    assert mixed.batches[0] == [3, 4, 5] and mixed.batches[4] is ran.batches[4]
    listed([[8, 9, 10], [2]], runs={0: ((8, 3),)})  # a run reaching outside 0..9: the plain way
    listed([[7, 8, 9, 1, 2]], n=None, runs={0: ((7, 3), (1, 2))})


def test_the_device_counter_gives_the_same_record_as_the_host(monkeypatch):
    """Ids that live on a device are counted there (rank.counting.DeviceRunning: no copy to
    the host and no sync per step). Run here on the CPU over the batches worked by hand in the
    test above: the same record, field for field, but for the order hash, which is the
    device's own; that one is the same however the ids fall into flushes, and changes when
    two batches change places."""
    import torch
    from accelerate import Accelerator

    from sharddemo.rank import counting
    from sharddemo.rank.recorder import Recorder

    accelerator = Accelerator(cpu=True)

    def walk(batches, n, where, flush):
        monkeypatch.setattr(counting.counters, "FLUSH_IDS", flush)
        recorder = Recorder(accelerator, lambda batch, tag: batch, how="count", n=n)
        if where == "device":
            recorder.log.state = counting.DeviceRunning(torch.device("cpu"), n)
        for values, shift in batches:
            recorder.add((torch.tensor(values), shift))
        return recorder.finish(0)

    batches = [([1, 2], 1), ([3, 4, 5], 1), ([3, 9], 0), ([5, 6, 7, 8, 10, 11, 12, 13, 14], 0),
               ([0, 20], 0), ([3], 0)]
    host = walk(batches, 17, "host", 8)
    device = walk(batches, 17, "device", 8)
    mine, theirs = device["ranks"][0], host["ranks"][0]
    assert {k: v for k, v in mine.items() if k != "order_hash"} == {
        k: v for k, v in theirs.items() if k != "order_hash"}
    assert device["coverage"] == host["coverage"]
    # worked out by hand in the test above, not taken from the host's record
    assert (mine["samples"], mine["steps"], mine["distinct"]) == (19, 6, 15)
    assert mine["repeats"] == [[0, 2], [3, 3]] and device["coverage"]["missing"] == [15, 16]
    assert mine["head"] == [[0, 1], [2, 3, 4], [3, 9]] and mine["ascending"] is False
    assert mine["out_of_range"] == [20] and mine["out_of_range_total"] == 1
    assert walk(batches, 17, "device", 1 << 18)["ranks"][0]["order_hash"] == mine["order_hash"]
    swapped = [batches[0], batches[2], batches[1], *batches[3:]]
    assert walk(swapped, 17, "device", 8)["ranks"][0]["order_hash"] != mine["order_hash"]
    ascending = walk([([2 * k, 2 * k + 1], 0) for k in range(10)], 20, "device", 8)
    assert ascending["ranks"][0]["ascending"] is True


@pytest.mark.parametrize("case", ["stream", "draws", "replicated"])
def test_the_two_bit_counter_counts_what_the_libraries_deal(monkeypatch, case):
    """The count path at 2 bits a sample (counting.BitCounts, from BITS_FROM samples), one
    process, against collections.Counter over the batches torch's own objects make: a
    DistributedSampler's share walked in order (flushes counted in a dense scratch), a
    RandomSampler drawing with replacement (ids scattered: counted by a sort), and every id
    three times (more repeats than a rank lists: the count stays exact, the list is cut)."""
    import numpy as np
    import torch
    from accelerate import Accelerator
    from torch.utils.data import RandomSampler

    from sharddemo.rank import counting
    from sharddemo.record import LIST_CAP

    monkeypatch.setattr(counting.counters, "FLUSH_IDS", 512)
    n = 5000
    if case == "stream":
        ids = list(DistributedSampler(range(n), num_replicas=3, rank=1, shuffle=False))
    elif case == "draws":
        ids = list(RandomSampler(range(n), replacement=True, num_samples=3 * n,
                                 generator=torch.Generator().manual_seed(1)))
    else:
        ids = [i for i in range(n) for _ in range(3)]
    batches = list(BatchSampler(ids, 64, drop_last=False))
    log = counting.BitCounts(n, 3, False)
    for batch in batches:
        log.add(torch.tensor(batch), -1, 0)
    record = log.finish(Accelerator(cpu=True), None, 0)
    counter = Counter(ids)
    cov, rank = record["coverage"], record["ranks"][0]
    missing = sorted(set(range(n)) - set(counter))
    repeated = sorted(i for i, c in counter.items() if c > 1)
    assert (cov["seen"], cov["unique"], cov["missing_count"]) == (len(ids), len(counter),
                                                                   len(missing))
    assert cov["missing"] == missing[:LIST_CAP]
    assert (cov["duplicate_count"], rank["repeats_total"]) == (len(repeated), len(repeated))
    assert all(counter[i] == c for i, c in rank["repeats"])  # exact where listed
    assert len(rank["repeats"]) == min(len(repeated), LIST_CAP)
    assert rank["sizes"] == [[64, len(ids) // 64]] + ([[len(ids) % 64, 1]] if len(ids) % 64
                                                      else [])
    assert rank["ascending"] == (ids == sorted(ids))
    assert cov["most_copies"] == max(counter.values()) or not cov["most_copies_exact"]
    assert cov["most_copies_exact"] == (len(repeated) <= LIST_CAP)
    assert np.asarray(log.state.seen).nbytes == -(-n // 8)  # 1 bit a sample, and `again`


@pytest.mark.parametrize("where", ["host", "device", "bits"])
@pytest.mark.parametrize("flush", [2, 8, 1 << 18])
@pytest.mark.parametrize("batches,in_order", [
    ([[0, 1, 2], [3, 4, 5], [6, 0, 1]], True),  # one fall, inside the last batch (a fill)
    ([[0, 1, 2], [3, 4, 5], [0, 1, 2]], True),  # one fall, onto the last batch's start
    ([[0, 1, 2], [4, 3, 5], [6, 7, 8]], False),  # one fall, before the last batch
    ([[0, 1, 2], [3, 4, 5], [6, 0, 1, 0]], False),  # two falls
    ([[0, 1, 2], [3, 4, 5], [6, 7, 8]], True),  # none
])
def test_the_count_path_tells_an_order_with_a_fill_from_a_shuffle(monkeypatch, where, flush,
                                                                   batches, in_order):
    """`ascending` on the count path (host, device and 2-bit counters, the ids counted in
    flushes of any size): the ids never decrease but for one fall back inside the rank's last
    batch (worked out by hand for each case), as the id path reads them
    (analysis.views.in_order)."""
    from accelerate import Accelerator

    import torch

    from sharddemo.analysis.views import in_order as id_path_in_order
    from sharddemo.rank import counting
    from sharddemo.rank.recorder import Recorder

    monkeypatch.setattr(counting.counters, "FLUSH_IDS", flush)
    recorder = Recorder(Accelerator(cpu=True), lambda batch, tag: batch, how="count", n=9)
    if where == "device":
        recorder.log.state = counting.DeviceRunning(torch.device("cpu"), 9)
    elif where == "bits":
        recorder.log = counting.BitCounts(9, 3, False)
    for batch in batches:
        recorder.add(torch.tensor(batch))
    assert recorder.finish(0)["ranks"][0]["ascending"] is in_order
    assert id_path_in_order(batches) is in_order
