"""The truth grid on real ranks: a sampled subset of the grid and the known failures (split
batches without even_batches at N = 22, 21, 2, no even_batches past the per-batch limit,
replicated with drop_last) on 2 and 3 real gloo ranks,
through the real walk + collect path, gathered per batch and per epoch.

What each rank received is compared with tests/support/oracle.py (the libraries' own objects, built
here for that rank); the report's counts are recounted here from those batches; and what
accelerate's own gather_for_metrics returned, called for real on the ranks, is compared with
what the per-epoch path reads from accelerate's remainder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import json
from collections import Counter

import numpy as np
import pytest
import xxhash
from support.launch import accelerate_launch
from support.oracle import Case, all_ranks

from sharddemo.analysis import build_report


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def truth(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"truth{request.param}") / "truth.json"
    accelerate_launch(["tests/scripts/rank_truth.py", str(out)], nproc=request.param, timeout=240)
    data = json.loads(out.read_text())
    assert data["world"] == request.param and data["backend"] == "gloo"  # one real gloo group
    assert len(data["results"]) >= 50
    return data


def _full_report(result, world):
    """The report of one case, its header as a run with these options states it (split_batches
    slices the batch as given: the run's arithmetic), the mode's trace as the ranks made it."""
    case = Case(**result["case"])
    per_rank = case.b // world if case.split_batches else case.b
    trace = {"world_size": world, "backend": "gloo", "dataset_size": case.n,
             "batch_size": case.b, "global_batch": per_rank * world, "epochs": case.epochs,
             "seed": case.seed, "source": case.source,
             "options": {"split_batches": case.split_batches},
             "modes": {case.mode: result["trace"]}}
    return case, build_report(trace)


def _report(result, world):
    case, report = _full_report(result, world)
    return case, report["modes"][case.mode]


def test_every_case_ran_and_every_rank_received_what_the_libraries_give(truth):
    results = truth["results"]
    for result in results:
        case = Case(**result["case"])
        expected = all_ranks(case)
        got = [[r["batches"] for r in e["ranks"]] for e in result["trace"]["epochs"]]
        assert got == expected, f"{case} gather={result['gather']}"


def test_the_count_paths_reduce_sums_every_code_width(truth):
    """The per-sample codes of tests/scripts/rank_truth.py (COUNTS: rank 0 [0,1,2,1,0], rank 1
    [1,1,0,3,0], rank 2 [0,0,1,1,0]) reduced on the real ranks. A code is 0, 1, or 1 + shift
    for a sample received more than once; shift 16 (uint8), 256 (uint16) or 65536 (uint32),
    which gloo cannot sum as such (the wider ones go as int32/int64)."""
    world, codes = truth["world"], truth["codes"]
    # W2: rank 0 codes [0,1,1+s,1,0] + rank 1 [1,1,0,1+s,0] = [1,2,1+s,2+s,0]; W3 adds
    # rank 2's [0,0,1,1,0]: [1,2,2+s,3+s,0].
    expected = {2: {"2": ["uint8", [1, 2, 17, 18, 0]], "16": ["uint16", [1, 2, 257, 258, 0]],
                    "256": ["uint32", [1, 2, 65537, 65538, 0]]},
                3: {"2": ["uint8", [1, 2, 18, 19, 0]], "16": ["uint16", [1, 2, 258, 259, 0]],
                    "256": ["uint32", [1, 2, 65538, 65539, 0]]}}
    assert codes == expected[world]


def test_the_count_path_takes_each_readers_shift_off(truth):
    """tests/scripts/rank_truth.py's MIXED batches on every rank, read as the built-in sources are:
    tensors hold id + 1, {"id": ...} the ids. Worked by hand, each rank's ids are
    [0,1] [2,3] [4,0] [1] [2] [3]: ids 0-3 twice, 4 once, 5 never."""
    world, rec = truth["world"], truth["mixed"]
    ids = [0, 1, 2, 3, 4, 0, 1, 2, 3]
    # the order hash is xxh3-128 over the ids as int64 (not over the values)
    digest = xxhash.xxh3_128(np.array(ids, dtype=np.int64).tobytes()).hexdigest()
    for rank in rec["ranks"]:
        assert rank["head"] == [[0, 1], [2, 3], [4, 0]] and rank["tail"] == [[1], [2], [3]]
        assert rank["samples"] == 9 and rank["distinct"] == 5
        assert rank["repeats"] == [[0, 2], [1, 2], [2, 2], [3, 2]]
        assert rank["out_of_range_total"] == 0 and rank["order_hash"] == digest
    cov = rec["coverage"]
    assert cov["missing"] == [5] and cov["seen"] == 9 * world
    assert cov["duplicates"] == [[0, 2 * world], [1, 2 * world], [2, 2 * world],
                                 [3, 2 * world], [4, world]]


def test_the_id_path_takes_each_readers_shift_off(truth):
    """The same MIXED batches on every rank, walked on the id path (every id listed, gathered
    onto the main process at the epoch's end; the shift changes from batch to batch, so it
    cannot come off the whole epoch at once). Worked by hand as above, on every rank:
    [0,1] [2,3] [4,0] [1] [2] [3], plain ints."""
    world, rec = truth["world"], truth["mixed_ids"]
    assert rec["gather"] == "epoch" and len(rec["ranks"]) == world
    for r, rank in enumerate(rec["ranks"]):
        assert rank["rank"] == r and rank["workers"] == [-2] * 6  # a list: no worker known
        assert rank["batches"] == [[0, 1], [2, 3], [4, 0], [1], [2], [3]]


def test_the_id_path_gives_back_every_payload_whole(truth):
    """rank_truth.payload_walks: on the id path each rank's batches travel as runs (their
    first id) and listed ids, in the settling exchange where the payload fits its slot, else
    in one ragged gather of every rank's: every rank's runs (fits), every rank's ids shuffled
    (over), one rank each way (mixed, mixed-rev), ids past int32 on rank 1 (big), a rank with
    no batch (empty), and runs, short and empty batches and listed ones in one epoch on ranks
    of different lengths (uneven), and a last batch of two runs (wrapped); each twice, the second epoch with the first's runs at hand.
    The record holds, rank by rank, exactly the batches that rank's loop was given."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from rank_truth import PAYLOADS, payload_batches

    world, got = truth["world"], truth["payloads"]
    for scenario in PAYLOADS:
        for epoch in (0, 1):
            ranks = got[f"{scenario}/{epoch}"]
            assert len(ranks) == world
            for r in range(world):
                assert ranks[r] == payload_batches(scenario, r), (scenario, epoch, r)


def test_counts_follow_from_the_batches(truth):
    world, results = truth["world"], truth["results"]
    for result in results:
        case, report = _report(result, world)
        for e in report["epochs"]:
            ids = [i for r in e["ranks"] for b in r["batches"] for i in b]
            counts = Counter(ids)
            where = f"{case} gather={result['gather']} epoch {e['epoch']}"
            assert e["seen"] == len(ids) and e["unique"] == len(counts), where
            assert e["missing"] == sorted(set(range(case.n)) - set(counts)), where
            steps = [r["steps"] for r in e["ranks"]]
            assert e["steps_equal"] == (len(set(steps)) == 1), where


def test_gather_for_metrics_per_epoch_equals_the_real_call(truth):
    """The per-batch walk calls accelerate's gather_for_metrics for real; the per-epoch walk
    reads accelerate's remainder instead. Both must give the same count and verdict."""
    world, results = truth["world"], truth["results"]
    by_case = {}
    for result in results:
        if result["case"]["mode"] in ("prepared", "double-split", "unseeded"):
            by_case.setdefault(json.dumps(result["case"], sort_keys=True), {})[result["gather"]] = result
    assert by_case
    for key, pair in by_case.items():
        _, per_batch = _report(pair["batch"], world)
        _, per_epoch = _report(pair["epoch"], world)
        for a, b in zip(per_batch["epochs"], per_epoch["epochs"]):
            assert a["gathered_for_metrics_count"] == b["gathered_for_metrics_count"], key
            assert a["gather_for_metrics_exact"] == b["gather_for_metrics_exact"], key


def test_the_reproductions(truth):
    world, results = truth["world"], truth["results"]
    found = {}
    for result in results:
        case, report = _report(result, world)
        found.setdefault((case.mode, case.n, case.split_batches, case.drop_last), report)
    if world == 2:
        # split_batches, no even_batches, N=22, B=4, W=2 (worked out by hand): 5 full global
        # batches and one of 2; each global batch is sliced in two; the last slice of rank 1 is
        # empty, so accelerate gives rank 0 six batches and rank 1 five: a loop hangs at step 5.
        split22 = found[("prepared", 22, True, False)]["epochs"][0]
        assert [r["steps"] for r in split22["ranks"]] == [6, 5]
        assert split22["hang_at_step"] == 5 and split22["missing"] == []
        # N=2: one global batch of 2 -> rank 0 [0], rank 1 [1]... or nothing; both shown.
        assert found[("prepared", 2, True, False)]["epochs"][0]["seen"] == 2
    big = found[("prepared", 1006, False, False)]["epochs"][0]
    assert big["gather"] in ("batch", "epoch") and big["seen"] == 1006 and big["missing"] == []
    unseeded = found[("unseeded", 11, False, False)]["epochs"][0]
    assert unseeded["seen"] == 11
    if unseeded["missing"]:
        assert unseeded["missing_reason"] == "ranks-disagree"
    replicated = found[("replicated", 10, False, True)]
    # Each rank walks the same 9 kept samples (10 // 3 * 3): replication explains every repeat.
    for e in replicated["epochs"]:
        assert all(r["samples"] == 9 for r in e["ranks"])
        assert e["duplicates_explained"] and len(e["missing"]) == 1
    assert replicated["broken_promises"] == []


@pytest.mark.parametrize("args,promise", [
    # split batches without even_batches at N = 22: used to abort a rank (a gather of unequal shapes).
    (["--modes", "prepared", "--split-batches", "--no-even-batches", "--no-shuffle",
      "--epochs", "1", "--dataset-size", "22", "--batch-size", "4"],
     "prepared epoch 0: ranks take unequal step counts [6, 5] (DDP would hang)"),
    # replicated with drop_last: each rank walks the same 9 kept samples; no broken promise.
    (["--modes", "replicated", "--drop-last", "--dataset-size", "10", "--batch-size", "3"], None),
])
def test_compare_reproductions_through_the_cli(args, promise):
    import jsonschema
    from support.launch import ROOT, sharddemo

    proc = sharddemo(["compare", *args, "--format", "json", "--check"], check=False)
    report = json.loads(proc.stdout)
    jsonschema.validate(report, json.loads((ROOT / "docs" / "report.schema.json").read_text()))
    assert report["broken_promises"] == ([promise] if promise else []), proc.stderr
    assert proc.returncode == (1 if promise else 0), proc.stderr


def test_split_batches_leaves_a_loader_it_does_not_prepare_whole(truth):
    """--split-batches is accelerate's: the sampler and replicated loaders, which it does not
    prepare, hand every rank the whole batch. The per-rank batch and the steps the report
    states are those of the DataLoader the libraries build (tests/support/oracle.py), not the run's
    slice of it."""
    from support.oracle import _dataset, _distributed, _plain

    from sharddemo.render import render_table

    world, results = truth["world"], truth["results"]
    checked = set()
    for result in results:
        case, full = _full_report(result, world)
        if not case.split_batches or case.mode not in ("sampler", "replicated"):
            continue
        loaders = [_distributed(_dataset(case), case, r)[0] if case.mode == "sampler"
                   else _plain(_dataset(case), case, case.shuffle) for r in range(world)]
        b = loaders[0].batch_size
        report = full["modes"][case.mode]
        where = f"{case} gather={result['gather']}"
        assert report["global_batch"] == b * world, where
        assert f"per-rank batch {b} = global batch {b * world})" in report["conclusion"], where
        assert [r["steps"] for r in report["epochs"][0]["ranks"]] == [len(x) for x in loaders]
        assert f"this loader: per-rank batch {b}, global batch {b * world}" in render_table(full)
        checked.add(case.mode)
        if world == 2 and case.mode == "sampler":
            # By hand: DistributedSampler(17, 2, drop_last) gives each rank 17 // 2 = 8 ids;
            # batches of 6 with drop_last: one step each, 12 seen, 5 dropped.
            e = report["epochs"][0]
            assert [r["steps"] for r in e["ranks"]] == [1, 1] and e["seen"] == 12
            assert len(e["missing"]) == 5
    assert checked == {"sampler", "replicated"}


def test_the_mode_says_whether_its_dataloader_shuffles_as_its_objects_do(truth):
    """`prepared` and `replicated` are a plain DataLoader: the description's shuffle=True or
    shuffle=False must be what the loader holds on the ranks (a RandomSampler, or not), with
    --no-shuffle and for streams, which a DataLoader never shuffles."""
    results = truth["results"]
    told = set()
    for result in results:
        case = Case(**result["case"])
        if case.mode not in ("prepared", "replicated"):
            continue
        trace = result["trace"]
        shuffles = "RandomSampler" in trace["loader"]["classes"]
        says = "DataLoader(shuffle=True)" in trace["description"]
        assert says == shuffles and ("DataLoader(shuffle=False)" in trace["description"]) != says, \
            f"{case}: {trace['description']} / {trace['loader']['classes']}"
        told.add(says)
    assert told == {True, False}  # both kinds ran


def test_reference_observations(truth):
    """The reference's finding, N=8, B=4: the sharded modes split each epoch (at W=2: 4 each,
    disjoint, all 8, a new order each epoch); replicated gives every rank all 8, W x 8 in all."""
    world, results = truth["world"], truth["results"]
    for result in results:
        case, report = _report(result, world)
        if (case.n, case.b) != (8, 4):
            continue
        for e in report["epochs"]:
            per_rank = [r["samples"] for r in e["ranks"]]
            if case.mode == "replicated":
                assert per_rank == [8] * world and e["seen"] == 8 * world
            elif world == 2:
                assert per_rank == [4, 4] and e["seen"] == e["unique"] == 8
                assert e["duplicates"] == []
            elif case.mode == "sampler":  # ceil(8/3) = 3 each, one index padded
                assert per_rank == [3, 3, 3] and e["seen"] == 9
            else:  # one full batch of 4 each, 4 filled from the epoch's start
                assert per_rank == [4, 4, 4] and e["seen"] == 12
            assert e["missing"] == [] and e["unique"] == 8
        if case.mode in ("sampler", "prepared"):
            assert report["epochs"][1]["order_changed"] is True
