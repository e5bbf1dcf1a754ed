"""Layer 2: real gloo ranks on CPU. What each rank received is checked against torch's and
accelerate's own sampler objects, built in this process for the same rank."""

from __future__ import annotations

import json

import pytest
from accelerate.data_loader import BatchSamplerShard
from conftest import accelerate_launch
from oracle import Case, all_ranks
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from sharddemo.report import build_report


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def grid(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"grid{world}") / "grid.json"
    accelerate_launch(["tests/rank_grid.py", str(out)], nproc=world)
    results = json.loads(out.read_text())
    assert results, "the grid run wrote no results"
    return world, results


def chunks(ids, b):
    return [ids[i:i + b] for i in range(0, len(ids), b)]


def ranks_of(record):
    return [r["batches"] for r in record["ranks"]]


def test_real_ranks_form_one_gloo_group(grid):
    world, results = grid
    assert {r["world"] for r in results} == {world}
    assert {r["backend"] for r in results} == {"gloo"}


def test_sampler_mode_matches_distributed_sampler(grid):
    world, results = grid
    for case in (c for c in per_batch(results) if c["mode"] == "sampler"):
        for record in case["trace"]["epochs"]:
            for r, batches in enumerate(ranks_of(record)):
                ref = DistributedSampler(range(case["n"]), num_replicas=world, rank=r,
                                         shuffle=case["shuffle"], seed=3)
                ref.set_epoch(record["epoch"])
                assert batches == chunks(list(ref), case["b"]), (
                    f"N={case['n']} B={case['b']} shuffle={case['shuffle']} rank {r} "
                    f"epoch {record['epoch']}: real rank got {batches}")


def test_prepared_mode_matches_accelerates_shards(grid):
    world, results = grid
    for case in (c for c in per_batch(results) if c["mode"] == "prepared"):
        n, b = case["n"], case["b"]
        if case["shuffle"]:
            # Same seed, same generator: accelerate's prepare_data_loader for this rank
            # in-process (tests/oracle.py), no sharddemo code.
            per_epoch = all_ranks(Case("prepared", n, b, world, seed=3))
            expected = [[per_epoch[e][r] for e in range(2)] for r in range(world)]
        else:
            expected = [[list(BatchSamplerShard(BatchSampler(SequentialSampler(range(n)), b, False),
                                                num_processes=world, process_index=r))] * 2
                        for r in range(world)]
        for record in case["trace"]["epochs"]:
            got = ranks_of(record)
            for r in range(world):
                assert got[r] == expected[r][record["epoch"]], (
                    f"N={n} B={b} shuffle={case['shuffle']} rank {r} epoch {record['epoch']}")
            # gather_for_metrics (called for real on the ranks) drops exactly the even_batches
            # fill: the dataset, once.
            assert sorted(record["gathered_for_metrics"]) == list(range(n)), f"N={n} B={b}"


def test_replicated_mode_every_rank_sees_everything(grid):
    world, results = grid
    for case in (c for c in results if c["mode"] == "replicated"):  # both gather strategies
        for record in case["trace"]["epochs"]:
            for batches in ranks_of(record):
                assert sorted(sum(batches, [])) == list(range(case["n"]))


def per_batch(results):
    return [c for c in results if c.get("gather", "batch") == "batch"]


def _report(case, world):
    trace = {"world_size": world, "backend": "gloo", "dataset_size": case["n"],
             "batch_size": case["b"], "epochs": 2, "seed": 3, "modes": {case["mode"]: case["trace"]}}
    return build_report(trace)["modes"][case["mode"]]


def test_epoch_gather_agrees_with_per_batch_gathers(grid):
    world, results = grid
    batch = {(c["n"], c["b"], c["mode"]): c for c in per_batch(results) if c["shuffle"]}
    epoch_cases = [c for c in results if c.get("gather") == "epoch"]
    assert len(epoch_cases) == len(batch)
    for case in epoch_cases:
        twin = batch[(case["n"], case["b"], case["mode"])]
        for mine, theirs in zip(_report(case, world)["epochs"], _report(twin, world)["epochs"]):
            assert mine["gather"] == "epoch" and theirs["gather"] == "batch"
            assert mine["ranks"] == theirs["ranks"], f"{case['mode']} N={case['n']} B={case['b']}"
            assert mine["gathered_count"] == len(theirs["gathered"])
            # gather_for_metrics: called for real per batch, read from accelerate's remainder
            # once per epoch; accelerate's promise holds both ways: the dataset, exactly once.
            if case["mode"] == "prepared":
                assert mine["gathered_for_metrics_count"] == len(theirs["gathered_for_metrics"])
                assert mine["gather_for_metrics_exact"] is theirs["gather_for_metrics_exact"] is True


def test_reference_observations(grid):
    """The reference's finding: N=8, B=4 sharded modes split each epoch (disjoint, all 8,
    8/W per rank); replicated gives every rank all 8 and W*8 in total; set_epoch moves."""
    world, results = grid
    for case in (c for c in per_batch(results) if c["n"] == 8 and c["b"] == 4 and c["shuffle"]):
        trace = {"world_size": world, "backend": "gloo", "dataset_size": 8, "batch_size": 4,
                 "epochs": 2, "seed": 3, "modes": {case["mode"]: case["trace"]}}
        report = build_report(trace)["modes"][case["mode"]]
        for e in report["epochs"]:
            if case["mode"] == "replicated":
                assert e["seen"] == 8 * world and e["missing"] == []
                assert all(r["samples"] == 8 for r in e["ranks"])
            else:
                per_rank = [r["samples"] for r in e["ranks"]]
                if world == 2:
                    assert e["seen"] == 8 and e["unique"] == 8 and e["duplicates"] == []
                    assert per_rank == [4, 4]
                elif case["mode"] == "sampler":  # ceil(8/3) = 3 each, one index padded
                    assert per_rank == [3, 3, 3] and e["seen"] == 9
                else:  # one full batch of 4 each, 4 filled from the epoch's start
                    assert per_rank == [4, 4, 4] and e["seen"] == 12
                assert e["missing"] == [] and e["unique"] == 8
        if case["mode"] == "sampler":
            assert report["epochs"][1]["order_changed"] is True
