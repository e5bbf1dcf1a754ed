"""sharddemo.analysis on hand-written traces, no processes: every duplicate reason, every missing
reason, every verdict. Each trace below is worked out by hand in its comment."""

from __future__ import annotations

import torch

import json
from pathlib import Path

import jsonschema
import pytest

from sharddemo.analysis import build_report
from sharddemo.analysis.views import tail_repeats_head

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "report.schema.json").read_text())

# What describe_loader says of each kind of loader (only the fields the report reads).
SAMPLER = {"prepared": False, "distributed_sampler": True}
PREPARED = {"prepared": True, "batch_sampler_shard": True, "even_batches": True}
PREPARED_UNEVEN = {"prepared": True, "batch_sampler_shard": True, "even_batches": False}
STREAM_SHARD = {"prepared": True, "iterable_shard": True}
PLAIN = {"prepared": False}
DOUBLE = {"prepared": True, "distributed_sampler": True, "batch_sampler_shard": True,
          "even_batches": True}


def trace(mode, n, b, w, epochs, loader, hint=None, drop_last=False, expect=None,
          remainder=None):
    options = {"drop_last": drop_last}
    if expect:
        options["audit"] = {"expect": expect}
    return {"world_size": w, "backend": "gloo", "dataset_size": n, "batch_size": b,
            "global_batch": b * w, "epochs": len(epochs), "seed": 0, "options": options,
            "source": "user" if mode == "audit" else "toy",
            "modes": {mode: {"prepared": loader.get("prepared", False), "loader": loader,
                             "hint": hint,
                             "epochs": [{"epoch": k, "gather": "epoch", "remainder": remainder or [],
                                         "ranks": [{"rank": r, "batches": bs}
                                                   for r, bs in enumerate(ranks)]}
                                        for k, ranks in enumerate(epochs)]}}}


def report_of(t):
    report = build_report(t)
    jsonschema.validate(report, SCHEMA)
    mode = next(iter(report["modes"]))
    return report["modes"][mode]


def test_tail_repeats_head():
    assert tail_repeats_head([3, 1, 4, 0, 2, 3, 1]) == 2
    assert tail_repeats_head([3, 1, 3, 1]) == 2
    assert tail_repeats_head([0, 1, 2]) == 0
    assert tail_repeats_head([0, 1, 1, 0]) is None
    assert tail_repeats_head([0, 1, 2, 1]) is None


def test_sampler_padding():
    # DistributedSampler, N=9, W=2, no shuffle: order 0..8 padded with 0 -> rank 0 takes
    # [0,2,4,6,8], rank 1 [1,3,5,7,0]. Batch 3.
    e = report_of(trace("sampler", 9, 3, 2, [[[[0, 2, 4], [6, 8]], [[1, 3, 5], [7, 0]]]],
                        SAMPLER))["epochs"][0]
    assert e["duplicates"] == [{"id": 0, "count": 2, "reason": "sampler-padding"}]
    assert e["duplicates_explained"] and e["missing"] == []


def test_even_batches_fill_and_gather_for_metrics_from_remainder():
    # accelerate, N=10, B=3, W=2: r0 [[0,1,2],[6,7,8]], r1 [[3,4,5],[9,0,1]] (checked on real ranks);
    # remainder 10 % 6 = 4: gather_for_metrics keeps 4 of the last step's 6 -> exactly 10.
    m = report_of(trace("prepared", 10, 3, 2, [[[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]],
                        PREPARED, remainder=[4, 4]))
    e = m["epochs"][0]
    assert {d["reason"] for d in e["duplicates"]} == {"even-batches-fill"}
    assert e["duplicates_explained"]
    assert e["gathered_for_metrics_count"] == 10 and e["gather_for_metrics_exact"] is True
    assert m["broken_promises"] == []


def test_shard_fill():
    # IterableDatasetShard, stream 0..4, B=2, W=2: global batches of 4: [0,1|2,3] [4,0|1,2]
    e = report_of(trace("prepared", 5, 2, 2, [[[[0, 1], [4, 0]], [[2, 3], [1, 2]]]],
                        STREAM_SHARD))["epochs"][0]
    assert {d["reason"] for d in e["duplicates"]} == {"shard-fill"} and e["duplicates_explained"]


def test_replication_with_drop_last_is_explained():
    # Not sharded, drop_last, N=10, B=3: both ranks walk the same 9 samples.
    ranks = [[[6, 5, 4], [0, 8, 9], [2, 1, 3]]] * 2
    m = report_of(trace("replicated", 10, 3, 2, [ranks], PLAIN, drop_last=True))
    e = m["epochs"][0]
    assert {d["reason"] for d in e["duplicates"]} == {"replication"}
    assert e["duplicates_explained"] and e["missing"] == [7]
    assert e["missing_reason"] == "drop-last" and e["missing_explained"]
    assert m["broken_promises"] == []


def test_replication_in_an_audit_fails_two_verdicts():
    ranks = [[[0, 1], [2, 3]]] * 2
    m = report_of(trace("audit", 4, 2, 2, [ranks], PLAIN))
    failed = {v["verdict"] for v in m["verdicts"] if not v["ok"]}
    assert failed == {"no-unexplained-duplicates", "no-silent-replication"}


def test_audit_expect_replicated_with_drop_last_passes():
    ranks = [[[6, 5, 4], [0, 8, 9], [2, 1, 3]]] * 2
    m = report_of(trace("audit", 10, 3, 2, [ranks], PLAIN, drop_last=True, expect="replicated"))
    assert all(v["ok"] for v in m["verdicts"]), m["verdicts"]


def test_double_split_and_ranks_disagree():
    # Worked out in tests/unit/test_truth_inprocess.py::test_double_split_literal.
    e = report_of(trace("double-split", 10, 2, 2, [[[[0, 2], [8, 0]], [[5, 7], [3, 5]]]],
                        DOUBLE))["epochs"][0]
    assert e["missing"] == [1, 4, 6, 9] and e["missing_reason"] == "double-split"
    assert {d["reason"] for d in e["duplicates"]} == {"double-split"}
    # Two ranks, each its own permutation of 0..3, each takes its half: overlap and holes.
    e = report_of(trace("unseeded", 4, 2, 2, [[[[0, 1]], [[1, 3]]]], PREPARED,
                        hint="ranks-disagree"))["epochs"][0]
    assert e["missing"] == [2] and e["missing_reason"] == "ranks-disagree"
    assert e["duplicates"] == [{"id": 1, "count": 2, "reason": "ranks-disagree"}]


def test_unexplained_duplicates_and_missing_break_promises():
    # A "sharded" loader whose rank 1 repeats rank 0's first batch: not the tail of the order.
    m = report_of(trace("audit", 6, 2, 2, [[[[0, 1], [2, 3]], [[0, 1], [4, 5]]]], SAMPLER))
    e = m["epochs"][0]
    assert {d["reason"] for d in e["duplicates"]} == {"sampler-padding"}
    assert not e["duplicates_explained"]
    assert {v["verdict"] for v in m["verdicts"] if not v["ok"]} == {"no-unexplained-duplicates"}
    m = report_of(trace("sampler", 6, 2, 2, [[[[0, 1]], [[2, 3]]]], SAMPLER))
    assert m["epochs"][0]["missing"] == [4, 5] and m["epochs"][0]["missing_reason"] is None
    assert any("never seen" in p for p in m["broken_promises"])


def test_drop_last_beyond_a_global_batch_is_not_explained():
    # drop_last can drop less than one global batch (W x B = 4); 5 missing is something else.
    m = report_of(trace("sampler", 9, 2, 2, [[[[0, 1]], [[2, 3]]]],
                        {"distributed_sampler": True, "drop_last": True}, drop_last=True))
    assert m["epochs"][0]["missing_reason"] == "drop-last"
    assert m["epochs"][0]["missing_explained"] is False
    assert m["broken_promises"]


def test_unequal_steps_and_ragged_batches():
    # split_batches without even_batches, N=22, B=4, W=2 (accelerate 1.16 on real ranks): rank 0 six batches of 2,
    # rank 1 five: a loop hangs at step 5; gather_for_metrics never reaches the last step.
    r0 = [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]]
    r1 = [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]
    m = report_of(trace("prepared", 22, 2, 2, [[r0, r1]], PREPARED_UNEVEN, remainder=[2, 2]))
    e = m["epochs"][0]
    assert e["hang_at_step"] == 5 and not e["steps_equal"]
    assert e["gathered_for_metrics_count"] is None
    assert any("unequal step counts" in p for p in m["broken_promises"])
    # Equal steps, different sizes at step 1 (no even_batches, N=7, B=2... worked: [0,1][4,5]
    # vs [2,3][6]): no hang, but a plain gather of step 1 would fail.
    e = report_of(trace("prepared", 7, 2, 2, [[[[0, 1], [4, 5]], [[2, 3], [6]]]],
                        PREPARED_UNEVEN, remainder=[3, 3]))["epochs"][0]
    assert e["steps_equal"] and e["ragged_steps"] == [1]
    assert e["gathered_for_metrics_count"] == 7 and e["gather_for_metrics_exact"]


def test_the_conclusion_says_when_it_lists_only_the_first_ragged_steps():
    # A batch sampler of sizes 1, 2, 3, 4, 5, 1, 2, ... over 0..29, dealt alternately to 2 ranks
    # (accelerate's BatchSamplerShard, worked by hand): rank 0 gets sizes 1, 3, 5, 2, 4, rank 1
    # sizes 2, 4, 1, 3, 5; every one of the 5 steps differs in size. With 3 of the 5 steps
    # ragged the list is whole; past 5 the conclusion shows 5 and says there are more.
    r0 = [[0], [3, 4, 5], [10, 11, 12, 13, 14], [16, 17], [21, 22, 23, 24]]
    r1 = [[1, 2], [6, 7, 8, 9], [15], [18, 19, 20], [25, 26, 27, 28, 29]]
    m = report_of(trace("prepared", 30, 5, 2, [[r0, r1]], PREPARED_UNEVEN, remainder=[10, 10]))
    assert m["epochs"][0]["ragged_steps"] == [0, 1, 2, 3, 4]
    assert "differ in size at step(s) [0, 1, 2, 3, 4]:" in m["conclusion"]
    # two more steps, ragged too: [30] vs [31, 32], [33, 34, 35] vs [36, 37, 38, 39]
    r0, r1 = r0 + [[30], [33, 34, 35]], r1 + [[31, 32], [36, 37, 38, 39]]
    m = report_of(trace("prepared", 40, 5, 2, [[r0, r1]], PREPARED_UNEVEN, remainder=[10, 10]))
    assert m["epochs"][0]["ragged_steps"] == [0, 1, 2, 3, 4, 5, 6]
    assert "differ in size at step(s) [0, 1, 2, 3, 4, ...]:" in m["conclusion"]


def test_order_verdict():
    same = [[[1, 0], [4, 6]], [[3, 2], [5, 7]]]  # shuffled (falls in the first batch), twice
    m = report_of(trace("audit", 8, 2, 2, [same, same], SAMPLER))
    assert [v["ok"] for v in m["verdicts"] if v["verdict"] == "order-changes-each-epoch"] == [False]


@pytest.mark.parametrize("shuffled,ok", [(False, True), (True, False), (None, True)])
def test_order_verdict_asks_a_new_order_only_of_a_sampler_that_shuffles(shuffled, ok):
    """torch's DistributedSampler(shuffle=False) over 11 samples on 2 ranks, batches of 2:
    rank 0 [0 2] [4 6] [8 10], rank 1 [1 3] [5 7] [9 0] (padded with sample 0, so rank 1's ids
    fall once, inside its last batch), the same both epochs. The sampler says it does not
    shuffle: the same order is by design. A sampler that shuffles owes a new order; one that
    says nothing is read from the ids, and a walk in order but for one fall back inside the
    last batch is the padding (or accelerate's fill) of an unshuffled walk."""
    epoch = [[[0, 2], [4, 6], [8, 10]], [[1, 3], [5, 7], [9, 0]]]
    m = report_of(trace("audit", 11, 2, 2, [epoch, epoch], {**SAMPLER, "shuffled": shuffled}))
    assert [v["ok"] for v in m["verdicts"] if v["verdict"] == "order-changes-each-epoch"] == [ok]


@pytest.mark.parametrize("epoch,ok", [
    # a stream sharded in order, its last global batch filled from the start (accelerate's
    # even_batches fill): rank 1 falls once, inside its last batch
    ([[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]], True),
    # one fall, but before the last batch: not a fill
    ([[[0, 1, 2], [6, 7, 8]], [[4, 5, 3], [9, 10, 11]]], False),
    # two falls inside the last batch
    ([[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1, 0]]], False),
    # a fall between batches, into the last one: the fill starts a batch
    ([[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [0, 1, 2]]], True),
])
def test_the_order_of_a_loader_that_says_nothing_is_read_from_its_ids(epoch, ok):
    """A loader whose sampler does not say whether it shuffles (a stream): the same order
    twice is a fault only where the ids show a shuffle, not where they are in order but for
    the one fall back that a fill or padding makes inside a rank's last batch."""
    m = report_of(trace("audit", 12, 3, 2, [epoch, epoch], {**SAMPLER, "shuffled": None}))
    assert [v["ok"] for v in m["verdicts"] if v["verdict"] == "order-changes-each-epoch"] == [ok]


@pytest.mark.parametrize("epochs", [[[[], []]], [[[[]], [[]]]]])
def test_empty_epochs(epochs):
    m = report_of(trace("audit", 3, 2, 2, epochs, SAMPLER, drop_last=True))
    assert m["epochs"][0]["seen"] == 0 and "received nothing" in m["conclusion"]


def test_a_loader_of_length_zero_has_a_known_length():
    """len(loader) == 0 is a length (walked per batch), not 'unknown' (which forces the
    per-epoch gather of a stream)."""
    from types import SimpleNamespace

    import torch

    from sharddemo.rank.walk import choose_gather

    alone = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    assert choose_gather(alone, [], "auto") == "batch"
    assert choose_gather(alone, iter([]), "auto") == "epoch"  # no len(): unknown


def test_auto_counts_a_large_dataset_however_few_its_steps():
    """Worked by hand from the documented rule: from 1,000,000 samples no id moves (the count
    path), even where an epoch has few steps (10 here: huge batches, each of which would
    otherwise be gathered to the main process whole); below it 10 steps go batch by batch and
    500 steps once per epoch."""
    from types import SimpleNamespace

    import torch

    from sharddemo.rank.walk import choose_gather

    alone = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    ten_steps, many_steps = [None] * 10, [None] * 500  # only their len() is read
    assert choose_gather(alone, ten_steps, "auto", n=1_000_000) == "count"
    assert choose_gather(alone, ten_steps, "auto", n=999_999) == "batch"
    assert choose_gather(alone, many_steps, "auto", n=999_999) == "epoch"
    assert choose_gather(alone, many_steps, "auto", n=1_000_000) == "count"


def test_counted_summary_above_15_ranks_worked_by_hand():
    """Past 15 ranks the reduced code per sample is uint16: ranks holding it + 256 x ranks
    holding it more than once. 17 ranks, N = 5: every rank got id 0 once (17); rank 0 got id 1
    twice and nobody else did (1 + 256 = 257); ids 2-4 came nowhere (0)."""
    import numpy as np

    from sharddemo.rank.counting import summarise

    code = np.array([17, 257, 0, 0, 0], dtype=np.uint16)
    ranks = [{"rank": r, "samples": 3 if r == 0 else 1, "repeats": [[1, 2]] if r == 0 else [],
              "repeats_total": 1 if r == 0 else 0, "out_of_range": []} for r in range(17)]
    record = summarise(0, code, 256, ranks)
    cov = record["coverage"]
    assert cov["missing"] == [2, 3, 4] and cov["missing_count"] == 3
    assert cov["duplicates"] == [(0, 17), (1, 2)] and cov["duplicate_count"] == 2
    assert cov["ranks_per_sample"] == [0, 1, 17] and cov["repeated_within_a_rank"] == 1
    assert cov["seen"] == 3 + 16 and cov["unique"] == 2
    assert cov["most_copies"] == 17 and cov["most_copies_exact"] is True  # id 0, 17 ranks


def test_count_codes_worked_by_hand():
    import numpy as np

    from sharddemo.rank.counting import encode

    # 0 copies -> 0, 1 -> 1, several -> 1 + shift
    code, shift = encode(np.array([1, 2, 0, 255], dtype=np.uint8), 17)
    assert shift == 256 and code.dtype == np.uint16 and code.tolist() == [1, 257, 0, 257]
    counts = np.array([1, 2, 0, 255], dtype=np.uint8)
    code, shift = encode(counts, 2)
    assert shift == 16 and code.tolist() == [1, 17, 0, 17] and code is counts
    # past 255 ranks 257 x 256 would not fit uint16: uint32, shift 65536
    code, shift = encode(np.array([1, 2, 0, 255], dtype=np.uint8), 256)
    assert shift == 65536 and code.dtype == np.uint32 and code.tolist() == [1, 65537, 0, 65537]


@pytest.mark.parametrize("world,dtype,several", [(2, "uint8", 17), (17, "uint16", 257)])
def test_count_codes_across_chunks_worked_by_hand(world, dtype, several):
    """The code is made a chunk of the counter at a time: values on both sides of a chunk's
    edge, and the last one, come out as 0 -> 0, 1 -> 1, more -> 1 + shift."""
    import numpy as np

    from sharddemo.rank.counting import CHUNK, encode

    counts = np.zeros(CHUNK + 3, dtype=np.uint8)
    counts[[0, CHUNK - 1, CHUNK, CHUNK + 1, CHUNK + 2]] = [3, 2, 1, 255, 2]
    code, _ = encode(counts, world)
    assert code.dtype == np.dtype(dtype)
    assert code[[0, 1, CHUNK - 1, CHUNK, CHUNK + 1, CHUNK + 2]].tolist() == \
        [several, 0, several, 1, several, several]
    assert int(np.count_nonzero(code)) == 5


def test_counted_summary_above_255_ranks_worked_by_hand():
    """300 ranks, N = 3: every rank got id 0 once (300); ranks 0 and 1 got id 1 twice each
    (2 + 2 x 65536 = 131074); id 2 came nowhere (0)."""
    import numpy as np

    from sharddemo.rank.counting import summarise

    code = np.array([300, 131074, 0], dtype=np.uint32)
    ranks = [{"rank": r, "samples": 3 if r < 2 else 1, "repeats": [[1, 2]] if r < 2 else [],
              "repeats_total": 1 if r < 2 else 0, "out_of_range": []} for r in range(300)]
    cov = summarise(0, code, 65536, ranks)["coverage"]
    assert cov["missing"] == [2] and cov["ranks_per_sample"] == [0, 2, 300]
    assert cov["duplicates"] == [(0, 300), (1, 4)] and cov["repeated_within_a_rank"] == 1
    assert cov["most_copies"] == 300


def test_most_copies_counts_a_ranks_own_repeats_worked_by_hand():
    """2 ranks (shift 16), N = 2: both ranks got id 0 and rank 0 got it 3 times: code
    (1 + 16) + 1 = 18; 4 copies, more than the 2 ranks holding it. Id 1: rank 1 once (1)."""
    import numpy as np

    from sharddemo.rank.counting import summarise

    code = np.array([18, 1], dtype=np.uint8)
    ranks = [{"rank": 0, "samples": 3, "repeats": [[0, 3]], "repeats_total": 1,
              "out_of_range": []},
             {"rank": 1, "samples": 2, "repeats": [], "repeats_total": 0, "out_of_range": []}]
    cov = summarise(0, code, 16, ranks)["coverage"]
    assert cov["duplicates"] == [(0, 4)]
    assert cov["most_copies"] == 4 and cov["most_copies_exact"] is True
    # A rank that repeated more ids than it lists (1,001 against 1,000): only a lower bound.
    ranks[0]["repeats_total"] = 1001
    cov = summarise(0, code, 16, ranks)["coverage"]
    assert cov["most_copies"] == 4 and cov["most_copies_exact"] is False


def _per_rank_counts():
    from hypothesis import strategies as st

    # counts up to 1 (a sharded epoch: no rank gets a sample twice) or up to 3
    return st.tuples(st.integers(1, 20), st.integers(1, 40), st.sampled_from([1, 3])).flatmap(
        lambda t: st.lists(st.lists(st.integers(0, t[2]), min_size=t[1], max_size=t[1]),
                           min_size=t[0], max_size=t[0]))


def test_counted_summary_is_the_plain_count_of_what_each_rank_received():
    """Property: for any per-rank counters (1-20 ranks, so every code width's layout up to
    uint16), the codes summed as the reduce sums them and summarised give what counting the
    copies directly gives (missing, duplicates with their copies, ranks per sample, samples
    repeated within a rank)."""
    import numpy as np
    from hypothesis import given, settings

    from sharddemo.rank.counting import encode, summarise

    @settings(max_examples=300, deadline=None)
    @given(_per_rank_counts())
    def check(per_rank):
        world, n = len(per_rank), len(per_rank[0])
        codes = [encode(np.array(c, dtype=np.uint8), world) for c in per_rank]
        shift = codes[0][1]
        total = np.sum([c for c, _ in codes], axis=0, dtype=np.int64).astype(codes[0][0].dtype)
        ranks = [{"rank": r, "samples": sum(c), "out_of_range": [],
                  "repeats": [[i, k] for i, k in enumerate(c) if k > 1],
                  "repeats_total": sum(k > 1 for k in c)} for r, c in enumerate(per_rank)]
        cov = summarise(0, total, shift, ranks)["coverage"]
        copies = [sum(c[i] for c in per_rank) for i in range(n)]
        holders = [sum(c[i] > 0 for c in per_rank) for i in range(n)]
        assert cov["missing"] == [i for i in range(n) if copies[i] == 0]
        assert cov["missing_count"] == len(cov["missing"])
        assert cov["duplicates"] == [(i, copies[i]) for i in range(n) if copies[i] > 1]
        assert cov["ranks_per_sample"] == sorted(set(holders))
        assert cov["repeated_within_a_rank"] == sum(any(c[i] > 1 for c in per_rank)
                                                    for i in range(n))
        assert cov["unique"] == sum(k > 0 for k in copies)
        assert cov["most_copies"] == max(copies) and cov["most_copies_exact"]

    check()


def test_an_id_outside_the_dataset_twice_is_named_not_counted_as_a_repeat():
    # N = 4, 2 ranks: each gets two of the four ids, then id 9 (outside the dataset). Seen 6,
    # unique 5 (0-3 and 9); no sample of the dataset repeats, so no "extra (repeated)" line.
    e = report_of(trace("sampler", 4, 2, 2, [[[[0, 1], [9]], [[2, 3], [9]]]], SAMPLER))
    assert e["epochs"][0]["seen"] == 6 and e["epochs"][0]["unique"] == 5
    assert e["epochs"][0]["most_copies"] == 1
    assert "extra (repeated)" not in e["conclusion"]
    assert "sampler epoch 0: ids outside the dataset: [9]" in e["broken_promises"]


# IterableDatasetShard in each of 2 DataLoader workers, world 2, B = 2 (a global batch of 4),
# worked by hand. Worker 0 streams 0 2 .. 24 (13 ids): [0 2 4 6] [8 10 12 14] [16 18 20 22]
# [24 | 0 2 4], a fill of 3 from its own start; worker 1 streams 1 3 .. 23 (12 ids): three
# whole global batches, no fill. Each global batch gives rank 0 its first half, rank 1 the
# second, and a rank's batches alternate between the workers.
SHARD_RANK0 = [[0, 2], [1, 3], [8, 10], [9, 11], [16, 18], [17, 19], [24, 0]]
SHARD_RANK1 = [[4, 6], [5, 7], [12, 14], [13, 15], [20, 22], [21, 23], [2, 4]]
SHARD_MADE_BY = [0, 1, 0, 1, 0, 1, 0]


def test_fill_per_worker_from_whole_batches_worked_by_hand():
    from sharddemo.analysis.views import fill_per_worker, worker_orders

    ranks = [SHARD_RANK0, SHARD_RANK1]
    orders = worker_orders(ranks, [SHARD_MADE_BY, SHARD_MADE_BY])
    assert orders[0] == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 0, 2, 4]
    assert fill_per_worker(orders, 4) == 3
    assert fill_per_worker(orders, 3) is None  # a fill is less than one global batch


def _shard_record(rank1_last=None):
    """The counted record of the epoch above: 3 batches kept at each end of 7."""
    ranks = []
    for r, batches in enumerate([SHARD_RANK0, SHARD_RANK1]):
        batches = list(batches)
        if r == 1 and rank1_last is not None:
            batches[-1] = rank1_last
        ranks.append({"rank": r, "steps": 7, "samples": 14, "head": batches[:3],
                      "head_workers": SHARD_MADE_BY[:3], "tail": batches[4:],
                      "tail_workers": SHARD_MADE_BY[4:],
                      "workers": {"0": [4, 8], "1": [3, 6]}})
    return {"ranks": ranks}


def test_fill_per_worker_from_the_kept_ends_worked_by_hand():
    from sharddemo.analysis.views import CountedEpoch

    def fill_per_worker(record, limit):
        return CountedEpoch({"epoch": 0, "coverage": {}, **record}, 25).fill_per_worker(limit)

    # worker 0: first global batch [0 2 4 6], last [24 0 2 4]: its last 3 repeat its start.
    # worker 1: first [1 3 5 7], last [17 19 21 23]: no fill.
    assert fill_per_worker(_shard_record(), 4) == 3
    # A last batch that does not end with the start of the first: not this loader's fill.
    assert fill_per_worker(_shard_record(rank1_last=[2, 5]), 4) is None
    # Without the workers of the kept batches (an older record) nothing is claimed.
    record = _shard_record()
    for r in record["ranks"]:
        del r["head_workers"]
    assert fill_per_worker(record, 4) is None


def test_a_subset_loader_is_checked_against_its_own_ids():
    # A prepared loader over a Subset of 4 of the 6 ids (describe_loader: domain 4), B=2, W=2:
    # rank 0 [5, 1], rank 1 [0, 2]: the 4 ids it deals, each once; 3 and 4 are not its data.
    sub = {**PREPARED, "domain": 4}
    m = report_of(trace("audit", 6, 2, 2, [[[[5, 1]], [[0, 2]]]], sub))
    e = m["epochs"][0]
    assert e["missing"] == [3, 4] and e["missing_reason"] == "subset" and e["missing_explained"]
    assert all(v["ok"] for v in m["verdicts"]) and not m["broken_promises"]
    assert "the other 2 are not its data" in e["reasons"]["subset"]
    # The same loader losing one of its own 4 (rank 1 got [0] alone: 3 distinct, 0, 2, ... no 2)
    m = report_of(trace("audit", 6, 2, 2, [[[[5, 1]], [[0]]]], sub))
    e = m["epochs"][0]
    assert e["missing"] == [2, 3, 4] and not e["missing_explained"]
    assert "but 1 of the 4 it deals never came: NOT explained" in e["reasons"]["subset"]
    assert [v["verdict"] for v in m["verdicts"] if not v["ok"]] == ["no-missing-samples"]
    # Each rank's part drawn apart (random_split seeded by rank): rank 0 [5, 1], rank 1 [1, 3]:
    # each clean, 1 on both, 3 distinct of 4: the ranks dealt from different data.
    m = report_of(trace("audit", 6, 2, 2, [[[[5, 1]], [[1, 3]]]], sub))
    e = m["epochs"][0]
    assert e["missing_reason"] == "ranks-disagree"
    assert {v["verdict"] for v in m["verdicts"] if not v["ok"]} == {
        "no-missing-samples", "no-unexplained-duplicates"}


def test_an_eval_subset_counts_its_own_samples_once():
    # An eval loader (not prepared) over a Subset of 3 of 10 ids: ranks got [7, 2] and [9]: its
    # 3 samples once each: eval-counts-each-sample-once holds; losing one (rank 1 nothing) not.
    sub = {"prepared": False, "domain": 3}
    for ranks, ok in (([[[7, 2]], [[9]]], True), ([[[7, 2]], []], False)):
        t = trace("audit", 10, 2, 2, [ranks], sub)
        t["modes"]["audit"]["role"] = "eval"
        m = report_of(t)
        got = {v["verdict"]: v["ok"] for v in m["verdicts"]}
        assert got["eval-counts-each-sample-once"] is ok, m["verdicts"]


def test_a_sampler_with_replacement_explains_its_repeats_unless_every_rank_draws_it_all():
    # WeightedRandomSampler(replacement=True), 4 draws of 4 ids (describe_loader: draws), B=2,
    # W=2, prepared: rank 0 [1, 1], rank 1 [3, 0]: 2 not drawn, 1 twice, by design.
    draws = {"sampler": "WeightedRandomSampler", "replacement": True, "count": 4}
    m = report_of(trace("audit", 4, 2, 2, [[[[1, 1]], [[3, 0]]]], {**PREPARED, "draws": draws}))
    e = m["epochs"][0]
    assert e["missing"] == [2] and e["missing_reason"] == "sampler-draws"
    assert {d["reason"] for d in e["duplicates"]} == {"sampler-draws"}
    assert all(v["ok"] for v in m["verdicts"])
    # Not prepared: both ranks draw the same 4 ([1, 1], [3, 0] each): 8 > 4 draws + a round of
    # fill (4): every rank walked the same sequence, replication.
    same = [[1, 1], [3, 0]]
    m = report_of(trace("audit", 4, 2, 2, [[same, same]], {**PLAIN, "draws": draws}))
    got = {v["verdict"]: v["ok"] for v in m["verdicts"]}
    assert got["no-silent-replication"] is False


def test_a_sampler_with_replacement_on_each_rank_with_its_own_seed_is_its_draws():
    """Each of 2 ranks has its own WeightedRandomSampler(8 draws of 8 ids, replacement) seeded
    with its rank (torch's own samplers draw the batches, B=4), not prepared: every repeat,
    within and across the ranks, is the draws' (each rank drew its own 8: 16 an epoch, said in
    the conclusion), no fault. The same seed on both ranks is replication."""
    from torch.utils.data import WeightedRandomSampler

    def drawn(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        ids = list(WeightedRandomSampler([1.0] * 8, num_samples=8, replacement=True,
                                         generator=g))
        return [ids[:4], ids[4:]]

    draws = {"sampler": "WeightedRandomSampler", "replacement": True, "count": 8}
    loader = {**PLAIN, "draws": draws}
    own = [drawn(0), drawn(1)]
    assert own[0] != own[1]
    m = report_of(trace("audit", 8, 4, 2, [own], loader))
    assert all(v["ok"] for v in m["verdicts"]), m["verdicts"]
    assert {d["reason"] for d in m["epochs"][0]["duplicates"]} <= {"sampler-draws"}
    assert "each rank drew its own 8 (num_samples) from the whole dataset" in m["conclusion"]
    m = report_of(trace("audit", 8, 4, 2, [[drawn(0), drawn(0)]], loader))
    got = {v["verdict"]: v["ok"] for v in m["verdicts"]}
    assert got["no-silent-replication"] is False


def test_indices_that_repeat_a_sample_explain_its_repeats_not_others():
    # SubsetRandomSampler([5, 5, 7, 11]) over 12 ids, prepared, B=2, W=2 (describe_loader:
    # domain 3, draws of 4 with repeated indices): rank 0 [5, 11], rank 1 [7, 5]: 5 twice and
    # the 9 others not its data, by design.
    draws = {"sampler": "SubsetRandomSampler", "replacement": False, "count": 4,
             "repeated_indices": True}
    loader = {**PREPARED, "domain": 3, "draws": draws}
    m = report_of(trace("audit", 12, 2, 2, [[[[5, 11]], [[7, 5]]]], loader))
    e = m["epochs"][0]
    assert {d["reason"] for d in e["duplicates"]} == {"sampler-draws"}
    assert e["missing_reason"] == "subset" and e["missing_explained"]
    assert ("deals 4 indices an epoch that name 3 distinct samples"
            in e["reasons"]["sampler-draws"])
    assert all(v["ok"] for v in m["verdicts"]), m["verdicts"]
    # The same loader, 7 lost (rank 1 got [5, 5]: 3 copies of 5 in 4 draws): still a loss.
    m = report_of(trace("audit", 12, 2, 2, [[[[5, 11]], [[5, 5]]]], loader))
    got = {v["verdict"]: v["ok"] for v in m["verdicts"]}
    assert got["no-missing-samples"] is False


def test_an_audit_whose_ids_are_not_positions_stops_with_one_error(monkeypatch):
    """1-based ids for a dataset of 4, worked by hand: rank 0 receives [1, 2], rank 1 [3, 4].
    Id 4 lies outside the positions 0..3 and id 0 never comes, so the report would call
    sample 0 missing for no reason; `audit` stops with one Error line instead (the launch is
    replaced by this trace: only the parent's side is under test here)."""
    import sharddemo.commands.audit as C
    from sharddemo.options import AuditOptions
    from sharddemo.errors import UsageError

    one_based = trace("audit", 4, 2, 2, [[[[1, 2]], [[3, 4]]]], SAMPLER)
    monkeypatch.setattr(C, "run_launch", lambda *args, **kwargs: one_based)
    factories = str(Path(__file__).resolve().parents[1] / "support" / "factories.py")
    with pytest.raises(UsageError, match=r"^the loader delivered ids outside 0\.\.3, the "
                       r"positions of its 4 samples \(4\): --id-field id must hold"):
        C.audit_run(AuditOptions(target=f"{factories}:plain_40", id_field="id"))
    in_range = trace("audit", 4, 2, 2, [[[[0, 1]], [[2, 3]]]], SAMPLER)
    monkeypatch.setattr(C, "run_launch", lambda *args, **kwargs: in_range)
    assert C.audit_run(AuditOptions(target=f"{factories}:plain_40", id_field="id"))["modes"]


def test_a_double_split_over_a_part_counts_its_losses_within_the_part():
    """Worked by hand: 8 samples, the loader deals a part of 6 (a Subset of ids 0-5), with a
    DistributedSampler that accelerate shards again on 2 ranks, so rank 0 receives [0] and
    rank 1 [2]. Never seen: 1, 3, 4, 5 (the part's, lost to the double split) and 6, 7 (not
    the loader's data). The report said "6 sample(s) were never seen (the loader was split
    twice)"; 2 of those 6 were never its to deal."""
    m = report_of(trace("audit", 8, 1, 2, [[[[0]], [[2]]]], {**DOUBLE, "domain": 6}))
    e = m["epochs"][0]
    assert e["missing"] == [1, 3, 4, 5, 6, 7] and e["missing_reason"] == "double-split"
    assert ("but 4 of the 6 sample(s) it deals were never seen (the loader was split twice); "
            "the other 2 are not its data (it reads a subset)") in m["conclusion"]
    assert "4 of the 6 samples it deals were lost that way, and the other 2 of the 8 are not " \
        "its data" in e["reasons"]["double-split"]
    detail = [v["detail"] for v in m["verdicts"] if v["verdict"] == "no-missing-samples"]
    assert detail == ["4 of the 6 samples it deals never seen (and 2 not its data): "
                      "[1, 3, 4, 5, 6, 7]"]
    # the same loss over the whole data: no part to set apart
    m = report_of(trace("audit", 6, 1, 2, [[[[0]], [[2]]]], DOUBLE))
    assert "but 4 sample(s) were never seen (the loader was split twice)" in m["conclusion"]


def test_a_frameworks_note_reaches_the_report_and_its_table():
    """A mode's `note` (what a framework changed of the loader the user wrote) is kept in the
    report and printed above the mode's epochs, in the table and in markdown."""
    from sharddemo.render import render

    t = trace("audit", 4, 2, 2, [[[[0, 1]], [[2, 3]]]], SAMPLER)
    t["modes"]["audit"]["note"] = "the framework shuffles it"
    report = build_report(t)
    jsonschema.validate(report, SCHEMA)
    assert report["modes"]["audit"]["note"] == "the framework shuffles it"
    assert "  note: the framework shuffles it" in render(report, "table").splitlines()
    assert "Note: the framework shuffles it" in render(report, "markdown").splitlines()

