"""The cases that trip real users, on 2 and 3 real gloo ranks: every loader option, pitfall
and source. What each rank received is checked against torch's, accelerate's and datasets'
own objects for that rank, and the report's verdict is checked too."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from support.launch import accelerate_launch
from support.oracle import Case, IdStream, all_ranks
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from sharddemo.analysis import build_report

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "report.schema.json")
                    .read_text())


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def scenarios(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"sc{request.param}") / "scenarios.json"
    accelerate_launch(["tests/scripts/rank_scenarios.py", str(out)], nproc=request.param)
    data = json.loads(out.read_text())
    assert data["world"] == request.param
    return data["world"], data["scenarios"]


def got(case) -> list:
    """[epoch][rank] -> batches, as the real ranks received them."""
    return [[r["batches"] for r in e["ranks"]] for e in case["trace"]["epochs"]]


def simulated(case, world: int) -> list:
    """[epoch][rank] -> batches: torch's, accelerate's and datasets' own objects computing, in
    this process, what that rank should receive (tests/support/oracle.py, no sharddemo code)."""
    o = case["options"]
    return all_ranks(Case(mode=case["mode"], n=o["dataset_size"], b=o["batch_size"],
                          world=world, shuffle=o["shuffle"], drop_last=o["drop_last"],
                          even_batches=o["even_batches"], split_batches=o["split_batches"],
                          num_workers=o["num_workers"], set_epoch=o["set_epoch"],
                          seed=o["seed"], epochs=o["epochs"], source=o["source"],
                          shards=o["shards"]))


def report_of(case, world, validate=False):
    o = case["options"]
    trace = {"world_size": world, "backend": "gloo", "dataset_size": o["dataset_size"],
             "batch_size": o["batch_size"], "epochs": o["epochs"], "seed": o["seed"],
             "source": o["source"], "options": o, "modes": {case["mode"]: case["trace"]}}
    report = json.loads(json.dumps(build_report(trace)))
    if validate:
        import jsonschema

        jsonschema.validate(report, SCHEMA)
    return report["modes"][case["mode"]]


def chunks(ids, b, drop_last=False):
    out = [ids[i:i + b] for i in range(0, len(ids), b)]
    return [c for c in out if len(c) == b] if drop_last else out


SIMULATED = ["drop-last/prepared", "drop-last/sampler", "drop-last/replicated",
             "no-shuffle/prepared", "no-shuffle/sampler", "no-even-batches/prepared",
             "split-batches/prepared", "workers0/sampler", "workers0/prepared",
             "no-set-epoch/sampler", "double-split", "unseeded", "toy/prepared", "toy/sampler",
             "toy/replicated", "hf/prepared", "hf/sampler", "hf/replicated", "hf/split",
             "iterable/prepared-shard", "iterable/replicated", "hf-stream/split",
             "hf-stream/replicated"]


@pytest.mark.parametrize("name", SIMULATED)
def test_real_ranks_receive_what_the_libraries_compute(scenarios, name):
    world, cases = scenarios
    assert got(cases[name]) == simulated(cases[name], world), name


def test_drop_last_against_the_library_objects(scenarios):
    world, cases = scenarios
    n, b = 10, 3
    sampler = got(cases["drop-last/sampler"])[0]
    for r in range(world):
        ref = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=5,
                                 drop_last=True)
        assert sampler[r] == chunks(list(ref), b, drop_last=True)
    for name in ("drop-last/prepared", "drop-last/sampler", "drop-last/replicated"):
        report = report_of(cases[name], world)
        for e in report["epochs"]:
            assert e["missing_reason"] in ("drop-last", None)
            assert e["missing_explained"], name
        assert report["broken_promises"] == [], name
        assert "drop_last dropped" in report["conclusion"] or not report["epochs"][0]["missing"]
    prepared = report_of(cases["drop-last/prepared"], world)["epochs"][0]
    # complete rounds only: gather_for_metrics has nothing to drop, it equals gather
    assert prepared["gather_for_metrics_equals_gather"] is True
    assert prepared["duplicates"] == []
    assert prepared["seen"] == (n // b) // world * world * b


def test_no_shuffle_strided_and_round_robin(scenarios):
    world, cases = scenarios
    sampler = got(cases["no-shuffle/sampler"])[0]
    prepared = got(cases["no-shuffle/prepared"])[0]
    for r in range(world):
        ref = DistributedSampler(range(10), num_replicas=world, rank=r, shuffle=False)
        assert sampler[r] == chunks(list(ref), 3)
        shard = BatchSamplerShard(BatchSampler(SequentialSampler(range(10)), 3, False),
                                  num_processes=world, process_index=r)
        assert prepared[r] == list(shard)
    if world == 2:
        assert sampler == [[[0, 2, 4], [6, 8]], [[1, 3, 5], [7, 9]]]
        assert prepared == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]


def test_no_even_batches_never_hangs_and_is_flagged(scenarios):
    world, cases = scenarios
    report = report_of(cases["no-even-batches/prepared"], world)
    e = report["epochs"][0]
    assert e["missing"] == [] and e["duplicates"] == []
    steps = [r["steps"] for r in e["ranks"]]
    if world == 2:  # K = 3 batches of N = 7: ranks take 2 and 1 steps
        assert steps == [2, 1] and e["steps_equal"] is False
        assert any("DDP would hang" in p for p in report["broken_promises"])
    else:  # 1 step each, but the last rank's batch holds 1 sample: padded for the gather
        assert steps == [1, 1, 1] and e["gather"] == "batch"
        assert sorted(e["gathered"]) == list(range(7))


def test_split_batches_slices_each_global_batch(scenarios):
    world, cases = scenarios
    e = got(cases["split-batches/prepared"])[0]
    assert all(len(batch) == 6 // world for batches in e for batch in batches)


def test_dispatch_rank0_reads_and_slices(scenarios):
    world, cases = scenarios
    e = got(cases["dispatch/prepared"])[0]
    # Each step rank 0 reads W batches of 3 and every rank gets its slice of them, in rank
    # order; a short last round is filled from the start of the epoch (even_batches).
    batches = chunks(list(range(10)), 3)
    rounds = [sum(batches[i:i + world], []) for i in range(0, len(batches), world)]
    for step, ids in enumerate(rounds):
        got_step = sum((e[r][step] for r in range(world)), [])
        assert got_step[:len(ids)] == ids, f"step {step}"
        assert got_step[len(ids):] == list(range(len(got_step) - len(ids))), f"step {step}"
    if world == 2:
        assert e == [[[0, 1, 2], [6, 7]], [[3, 4, 5], [8, 9]]]


def test_num_workers_do_not_change_the_ids(scenarios):
    world, cases = scenarios
    assert got(cases["workers2/sampler"]) == got(cases["workers0/sampler"])
    assert got(cases["workers2/prepared"]) == got(cases["workers0/prepared"])


def test_no_set_epoch_repeats_the_order_and_the_report_says_so(scenarios):
    world, cases = scenarios
    epochs = got(cases["no-set-epoch/sampler"])
    assert epochs[0] == epochs[1]
    report = report_of(cases["no-set-epoch/sampler"], world)
    assert report["epochs"][1]["order_changed"] is False
    assert "the order does NOT change between epochs" in report["conclusion"]


def test_double_split_loses_samples(scenarios):
    world, cases = scenarios
    report = report_of(cases["double-split"], world)
    e = report["epochs"][0]
    if world == 2:  # transformers issue 34365: 1, 4, 6 and 9 are never seen
        assert e["missing"] == [1, 4, 6, 9]
    assert e["missing"] and e["missing_reason"] == "double-split"
    assert any("never seen" in p for p in report["broken_promises"])


def test_unseeded_ranks_disagree(scenarios):
    world, cases = scenarios
    report = report_of(cases["unseeded"], world)
    e = report["epochs"][0]
    assert e["missing"] and e["duplicates"]
    assert e["missing_reason"] == "ranks-disagree"
    assert e["duplicates"][0]["reason"] == "ranks-disagree"
    assert report["broken_promises"]


def test_hf_dataset_shards_like_the_toy_dataset(scenarios):
    world, cases = scenarios
    for mode in ("prepared", "sampler", "replicated"):
        assert got(cases[f"hf/{mode}"]) == got(cases[f"toy/{mode}"]), mode


def test_datasets_split_map_style_contiguous_no_padding(scenarios):
    world, cases = scenarios
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node

    e = got(cases["hf/split"])[0]
    for r in range(world):
        shard = split_dataset_by_node(Dataset.from_dict({"id": list(range(10))}), rank=r,
                                      world_size=world)
        assert sorted(sum(e[r], [])) == [int(x["id"]) for x in shard]
    report = report_of(cases["hf/split"], world)
    assert report["epochs"][0]["duplicates"] == [] and report["epochs"][0]["missing"] == []
    steps = [r["steps"] for r in report["epochs"][0]["ranks"]]
    if world == 3:  # 4, 3, 3 samples in batches of 3: 2, 1, 1 steps
        assert steps == [2, 1, 1] and not report["epochs"][0]["steps_equal"]
        assert any("DDP would hang" in p for p in report["broken_promises"])


def test_datasets_split_stream_whole_shards_or_every_wth(scenarios):
    world, cases = scenarios
    e = got(cases["hf-stream/split"])[0]
    ids = [sum(batches, []) for batches in e]
    if world == 2:  # 4 shards of 3 divide by 2: whole files per rank
        assert ids == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]
    else:  # 4 shards do not divide by 3: every 3rd example
        assert ids == [list(range(r, 12, 3)) for r in range(3)]


def test_iterable_shard_loops_around_and_duplicates_survive_gather_for_metrics(scenarios):
    world, cases = scenarios
    e = got(cases["iterable/prepared-shard"])[0]
    for r in range(world):
        shard = IterableDatasetShard(IdStream(10), batch_size=3, num_processes=world,
                                     process_index=r)
        assert sum(e[r], []) == list(shard)
    report = report_of(cases["iterable/prepared-shard"], world)["epochs"][0]
    assert report["duplicates"] and report["duplicates"][0]["reason"] == "shard-fill"
    assert report["duplicates_explained"] is True
    assert report["gather_for_metrics_exact"] is False  # a stream has no length to cut to


SHARD_WORKERS = ["iterable/shard-workers2", "long/iterable-shard-workers2"]


@pytest.mark.parametrize("name", SHARD_WORKERS)
def test_iterable_shard_in_each_worker_fills_once_per_worker(scenarios, name):
    """accelerate wraps a stream in IterableDatasetShard; with 2 DataLoader workers each worker
    runs its own copy over its half of the stream and fills its own last global batch: the
    loader's own padding, twice. Expected batches from prepare_data_loader (tests/support/oracle.py),
    duplicates counted here from them; both paths must say the fill explains them."""
    world, cases = scenarios
    case = cases[name]
    expected = simulated(case, world)
    assert got(case) == expected
    if name == "iterable/shard-workers2" and world == 2:
        # By hand: worker 0 streams 0 2 4 6 8, worker 1 streams 1 3 5 7 9; a global batch is
        # 2 x 3 = 6, so each worker fills one id from its own start: 0 and 1.
        assert expected[0] == [[[0, 2, 4], [1, 3, 5]], [[6, 8, 0], [7, 9, 1]]]
    for report in (report_of(case, world, validate=True),
                   report_of(_with_counted(case), world, validate=True)):
        assert report["broken_promises"] == []
        for e, ranks in zip(report["epochs"], expected, strict=True):
            counts = Counter(i for batches in ranks for batch in batches for i in batch)
            assert e["duplicate_count"] == sum(1 for c in counts.values() if c > 1) > 0
            assert {d["id"]: d["count"] for d in e["duplicates"]} == \
                {i: c for i, c in counts.items() if c > 1}
            assert {d["reason"] for d in e["duplicates"]} == {"shard-fill"}
            assert e["duplicates_explained"] is True and list(e["reasons"]) == ["shard-fill"]


def test_a_stream_every_worker_reads_whole_is_not_taken_for_the_shard_fill(scenarios):
    """The same shard over a stream that ignores its workers: each worker yields all 203 ids,
    so every rank receives its share twice. The shard's fill is there too, but it does not
    explain the copies: worker replication, a broken promise, on both paths."""
    world, cases = scenarios
    case = cases["long/unsplit-shard-workers2"]
    expected = simulated(case, world)
    assert got(case) == expected
    for report in (report_of(case, world, validate=True),
                   report_of(_with_counted(case), world, validate=True)):
        e = report["epochs"][0]
        counts = Counter(i for batches in expected[0] for batch in batches for i in batch)
        assert e["seen"] - e["unique"] == sum(counts.values()) - len(counts) > 203
        assert e["duplicates_explained"] is False
        assert "worker-replication" in e["reasons"]
        assert {d["reason"] for d in e["duplicates"]} == {"worker-replication"}
        assert any("duplicates the loader's own padding" in p for p in report["broken_promises"])


def test_dispatched_copies_from_two_workers_are_worker_replication(scenarios):
    """dispatch_batches: rank 0's loader makes every batch. Its 2 workers each yield the whole
    stream (0..10, in batches of 2), and accelerate's dispatcher concatenates one batch per rank
    and slices it. By hand, on 2 ranks: w0 [0 1] + w1 [0 1] -> rank 0 [0 1], rank 1 [0 1], and
    so on to w0 [10] + w1 [10]: every rank receives 0..10 once, each from its own worker. That
    is the workers' doing (worker replication), not an unsharded loader, on both paths."""
    world, cases = scenarios
    case = cases["dispatch/unsplit-workers2"]
    for report in (report_of(case, world, validate=True),
                   report_of(_with_counted(case), world, validate=True)):
        assert report["broken_promises"]
        if world != 2:
            continue  # 3 ranks share the 2 workers' batches: no rank has a worker to itself
        e = report["epochs"][0]
        assert e["seen"] == 22 and e["unique"] == 11
        assert {d["id"]: d["count"] for d in e["duplicates"]} == {i: 2 for i in range(11)}
        assert {d["reason"] for d in e["duplicates"]} == {"worker-replication"}
        assert list(e["reasons"]) == ["worker-replication"]
        assert e["duplicates_explained"] is False
    if world == 2:
        batches = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10]]
        assert got(case)[0] == [batches, batches]


@pytest.mark.parametrize("name", ["hf-stream/unequal-files", "hf-stream/unequal-files-prepared"])
def test_stream_files_of_unequal_size_give_unequal_steps(scenarios, name):
    """13 ids in 4 files of 4, 4, 4 and 1 (docs/scenarios.md), split by the user
    (split_dataset_by_node) or by accelerate's prepare without dispatch. The ranks' step counts
    and the hang come from what datasets and accelerate give each rank (tests/support/oracle.py). By
    hand on 2 ranks: 2 whole files each, 8 and 5 ids, 4 and 3 steps."""
    world, cases = scenarios
    case = cases[name]
    expected = simulated(case, world)
    assert got(case) == expected
    steps = [len(b) for b in expected[0]]
    if world == 2:
        assert steps == [4, 3]
    report = report_of(case, world)
    e = report["epochs"][0]
    assert [r["steps"] for r in e["ranks"]] == steps
    assert e["hang_at_step"] == (min(steps) if len(set(steps)) > 1 else None)
    assert any("unequal step counts" in p for p in report["broken_promises"]) == \
        (len(set(steps)) > 1)


def test_iterable_dispatch_covers_the_stream(scenarios):
    world, cases = scenarios
    for name in ("iterable/prepared", "hf-stream/prepared"):
        report = report_of(cases[name], world)
        e = report["epochs"][0]
        assert e["missing"] == [], name
        assert e["steps_equal"], name


def test_a_dispatched_stream_is_read_by_rank_0_alone(scenarios):
    """hf-stream through accelerator.prepare: dispatched by default (accelerate's
    DataLoaderDispatcher, whose _fetch_batches calls next() on process 0 only and broadcasts
    each rank its slice), so rank 0 reads all 4 files and the other ranks none; without
    dispatch (IterableDatasetShard) every rank reads the whole stream. The file count and
    rank 0's share per worker come from datasets' own stream."""
    from support.oracle import _json_stream

    from sharddemo.render import stream_line

    world, cases = scenarios
    for name, dispatch in (("hf-stream/prepared", True),
                           ("hf-stream/unequal-files-prepared", False)):
        o = cases[name]["options"]
        stream = _json_stream(o["dataset_size"], o["shards"])
        files = int(stream.num_shards)
        whole = len(stream._ex_iterable.split_shard_indices_by_worker(num_shards=1, index=0))
        report = report_of(cases[name], world)
        assert report["loader"]["dispatcher"] is dispatch, name
        streams = report["streams"]
        assert streams["dispatch_batches"] is dispatch
        if dispatch:
            assert streams["files_per_rank"] == [files] + [0] * (world - 1)
            assert streams["files_per_worker"] == [[whole]] + [[]] * (world - 1)
            assert stream_line(streams).startswith(
                f"stream of {files} file(s): rank 0 reads the whole stream and sends every rank "
                f"its slice (dispatch_batches); files per rank [{files}, 0")
        else:
            assert streams["files_per_rank"] == [files] * world
            assert "every rank reads the whole stream" in stream_line(streams)


def test_replicated_streams_give_every_rank_everything(scenarios):
    world, cases = scenarios
    for name, n in (("iterable/replicated", 10), ("hf-stream/replicated", 12)):
        for batches in got(cases[name])[0]:
            assert sum(batches, []) == list(range(n)), name


# The count path (--gather count, and auto from 1,000,000 samples on) must tell the same story
# as the path that ships every id: the same loader, walked both ways in one launch.
COMPARED_EPOCH_FIELDS = ["seen", "unique", "missing", "missing_count", "missing_reason",
                         "missing_explained", "duplicate_count", "duplicates_explained",
                         "steps_equal", "hang_at_step", "ragged_steps", "times_dataset",
                         "gathered_for_metrics_count", "gather_for_metrics_exact",
                         "gather_for_metrics_equals_gather", "workers", "idle_workers",
                         "order_changed", "ranks_same_order", "same_ids_on_every_rank",
                         "reasons", "out_of_range", "most_copies", "most_copies_exact"]


def _with_counted(case):
    return {**case, "trace": case["counted"]}


@pytest.mark.parametrize("name", [
    "drop-last/prepared", "drop-last/sampler", "drop-last/replicated", "no-even-batches/prepared",
    "split-batches/prepared", "dispatch/prepared", "workers2/sampler", "workers2/prepared",
    "no-set-epoch/sampler", "double-split", "unseeded", "toy/replicated", "hf/split",
    "iterable/prepared", "iterable/prepared-shard", "hf-stream/split", "hf-stream/replicated",
    "long/prepared", "long/sampler", "long/no-even-batches", "long/drop-last",
    "long/split-batches", "long/replicated", "long/double-split", "long/worker-replication",
    "long/iterable-shard", *SHARD_WORKERS, "long/unsplit-shard-workers2",
    "dispatch/unsplit-workers2"])
def test_the_count_path_gives_the_same_report(scenarios, name):
    world, cases = scenarios
    case = cases[name]
    assert all(e["gather"] == "count" for e in case["counted"]["epochs"])
    full = report_of(case, world, validate=True)
    counted = report_of(_with_counted(case), world, validate=True)
    if name in SIMULATED:
        # the count path against the libraries' own answer, not only against the id path
        n = case["options"]["dataset_size"]
        for e, ranks in zip(counted["epochs"], simulated(case, world), strict=True):
            ids = [i for batches in ranks for b in batches for i in b]
            copies = Counter(ids)
            assert (e["seen"], e["unique"], e["missing_count"], e["duplicate_count"]) == (
                len(ids), len(copies), n - len(copies), sum(c > 1 for c in copies.values()))
            assert [r["steps"] for r in e["ranks"]] == [len(b) for b in ranks]
            assert e["most_copies"] == max(copies.values(), default=0)
    assert counted["conclusion"] == full["conclusion"]
    assert counted["broken_promises"] == full["broken_promises"]
    for a, b in zip(full["epochs"], counted["epochs"], strict=True):
        for field in COMPARED_EPOCH_FIELDS:
            assert b.get(field) == a.get(field), (name, a["epoch"], field)
        assert [(d["id"], d["count"]) for d in b["duplicates"]] == \
            [(d["id"], d["count"]) for d in a["duplicates"]]
        assert {d["reason"] for d in b["duplicates"]} <= \
            {c for d in a["duplicates"] for c in [d["reason"], *d.get("causes", [])]}
        for ra, rb in zip(a["ranks"], b["ranks"], strict=True):
            assert (rb["steps"], rb["samples"], rb["ascending"]) == \
                (ra["steps"], ra["samples"], ra["ascending"])
            # What the count path keeps of each rank's batches is that rank's real first ones.
            assert rb["first_batches"] == ra["batches"][:len(rb["first_batches"])]
