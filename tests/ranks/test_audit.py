"""sharddemo audit and sharddemo.testing on 2 and 3 real gloo ranks."""

from __future__ import annotations

import json
import re

import pytest
from support.launch import FACTORIES, ROOT, SCHEMA, audit, sharddemo, verdicts
from torch.utils.data import DistributedSampler

from sharddemo.testing import assert_shards


@pytest.mark.parametrize("example,failing,nproc", [
    ("good", set(), 2),
    # (On 2 real ranks the double split is a scenario of test_scenarios.py, against the libraries.)
    # On 3 ranks the double split deals each rank's third round-robin again: still holes.
    ("double_split", {"no-missing-samples"}, 3),
    ("no_set_epoch", {"order-changes-each-epoch"}, 3),
])
def test_examples_give_the_right_verdicts(example, failing, nproc):
    proc = audit(f"examples/{example}.py:make_loader", nproc=nproc)
    report, got = verdicts(proc)
    assert report["world_size"] == nproc
    assert {name for name, ok in got.items() if not ok} == failing
    assert proc.returncode == (1 if failing else 0)
    if failing:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and errors[0].startswith("Error: verdict(s) failed: ")
        assert all(name in errors[0] for name in failing)


def test_set_epoch_flag_fixes_the_forgotten_set_epoch():
    proc = audit("examples/no_set_epoch.py:make_loader", "--set-epoch")
    assert proc.returncode == 0, proc.stderr


def test_recorded_indices_with_workers_are_the_samplers(tmp_path):
    proc = audit(f"{FACTORIES}:sampler_with_workers", "--set-epoch")
    report, got = verdicts(proc)
    assert all(got.values()), got
    for e in report["modes"]["audit"]["epochs"]:
        for r in e["ranks"]:
            ref = DistributedSampler(range(60), num_replicas=2, rank=r["rank"], shuffle=True, seed=3)
            ref.set_epoch(e["epoch"])
            ids = list(ref)
            assert r["batches"] == [ids[i:i + 4] for i in range(0, len(ids), 4)]
    # An audit takes no seed of its own: the header shows the sampler's (torch's own object).
    from sharddemo.render import render

    seed = DistributedSampler(range(60), num_replicas=2, rank=0, seed=3).seed
    assert report["fingerprint"]["seed"] == seed
    head = render(report, "table").splitlines()[0]
    assert head.endswith(f"| sampler seed {seed}")
    # the loader's own batch size (DataLoader(batch_size=4)), not a largest batch seen
    assert report["batch_size_seen"] is False and "| per-rank batch 4 |" in head


def test_a_dataset_that_fetches_a_whole_batch_per_call_is_recorded_batch_by_batch():
    """batch_size=None over a BatchSampler (of a DistributedSampler) given as `sampler`: one
    __getitem__ per batch with a list of indices. The audit crashed on it (int() of a list);
    --set-epoch reaches the DistributedSampler inside the BatchSampler."""
    from torch.utils.data import BatchSampler

    proc = audit(f"{FACTORIES}:batch_fetched", "--set-epoch", "--epochs", "2")
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    for e in report["modes"]["audit"]["epochs"]:
        for r in e["ranks"]:
            ref = DistributedSampler(range(40), num_replicas=2, rank=r["rank"], seed=0)
            ref.set_epoch(e["epoch"])
            assert r["batches"] == [list(b) for b in BatchSampler(ref, 4, False)]


def test_an_unshuffled_loader_keeps_its_order_by_design():
    """DistributedSampler(shuffle=False) over 11 samples on 2 ranks: torch pads rank 1's share
    with sample 0, so its ids decrease once (9, then 0). The audit took that for a shuffled
    order repeated ("set_epoch is never called", with --set-epoch given); the sampler itself
    says it does not shuffle."""
    proc = audit(f"{FACTORIES}:unshuffled_distributed_11", "--set-epoch", "--epochs", "2")
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    data = report["modes"]["audit"]
    assert data["loader"]["shuffled"] is False
    for e in data["epochs"]:
        for r in e["ranks"]:
            ids = list(DistributedSampler(range(11), num_replicas=2, rank=r["rank"], shuffle=False))
            assert r["batches"] == [ids[i:i + 2] for i in range(0, len(ids), 2)]
    assert data["epochs"][1]["order_changed"] is False


def test_a_bucketing_batch_sampler_of_the_users_through_prepare():
    """A bucketing batch sampler of the user's (its own set_epoch and a batch_size of 4, batches
    of 4 or fewer) over 31 samples, passed through prepare, 2 ranks, --set-epoch. Expected from
    accelerate's own prepare_data_loader, built here the same way:
    - its DataLoaderShard.set_epoch does not pass the epoch on to that batch sampler, so both
      epochs deal the same: order-changes-each-epoch fails, and says the call did not reach
      what draws the order (it said "set_epoch is never called");
    - its BatchSamplerShard drops the rounds that end in a batch shorter than 4: the samples
      it never deals are missing, with the reason short-rounds (the report said "the sampler
      draws 9 of 31 samples ... -16 of the 9 it deals never came": it took the batch
      sampler's length, 9 batches, for a draw of 9 samples)."""
    from accelerate.data_loader import prepare_data_loader
    from support.factories import Buckets, _dataset
    from support.oracle import ACCELERATOR_RNG_TYPES, ensure_accelerator_state
    from torch.utils.data import DataLoader

    proc = audit(f"{FACTORIES}:bucketing_prepared_31", "--set-epoch", "--epochs", "2")
    report, got = verdicts(proc)
    assert proc.returncode == 1
    assert {name for name, ok in got.items() if not ok} == {"order-changes-each-epoch",
                                                             "no-missing-samples"}
    data = report["modes"]["audit"]
    order = [v["detail"] for v in data["verdicts"]
             if v["verdict"] == "order-changes-each-epoch" and not v["ok"]]
    assert order == ["the same shuffled order as the previous epoch, although set_epoch was "
                     "called before each epoch as the training loop does: the call does not "
                     "reach what draws the order (a sampler or batch sampler of its own needs "
                     "its own set_epoch call)"]
    assert data["loader"]["draws"] is None and data["loader"]["shard_batch_size"] == 4
    ensure_accelerator_state()
    dealt = {}
    for r in range(2):
        loader = prepare_data_loader(DataLoader(_dataset(31), batch_sampler=Buckets(31)),
                                     num_processes=2, process_index=r, put_on_device=False,
                                     rng_types=list(ACCELERATOR_RNG_TYPES))
        for epoch in range(2):
            loader.set_epoch(epoch)
            dealt[r, epoch] = [b[0].tolist() for b in loader]
        assert dealt[r, 0] == dealt[r, 1]  # accelerate's own loader: the same order both epochs
    for e in data["epochs"]:
        for r in range(2):
            assert e["ranks"][r]["batches"] == dealt[r, e["epoch"]]
        never = sorted(set(range(31)) - {i for r in range(2) for b in dealt[r, e["epoch"]]
                                         for i in b})
        assert never and e["missing"] == never and e["missing_reason"] == "short-rounds"


@pytest.mark.parametrize("target,field", [("hf_with_id_field", "sample_id"), ("tuple_ids", "0")])
def test_id_field(target, field):
    proc = audit(f"{FACTORIES}:{target}", "--id-field", field, nproc=3)
    report, got = verdicts(proc)
    assert all(got.values()), got
    e = report["modes"]["audit"]["epochs"][0]
    assert e["missing"] == [] and report["dataset_size"] == 60
    import jsonschema

    jsonschema.validate(report, SCHEMA)


def test_expect_replicated_flips_the_replication_check():
    # The other half, --expect replicated passing on this factory, is
    # test_testing_api_takes_a_function (the same audit through sharddemo.testing).
    proc = audit(f"{FACTORIES}:everyone_everything")
    _, got = verdicts(proc)
    assert got["no-silent-replication"] is False and proc.returncode == 1
    assert "every-rank-sees-everything" not in got


def test_unequal_lengths_fail_with_the_step_counts():
    proc = audit(f"{FACTORIES}:unequal_lengths")
    report, got = verdicts(proc)
    assert got["equal-step-counts"] is False and proc.returncode == 1
    steps = [r["steps"] for r in report["modes"]["audit"]["epochs"][0]["ranks"]]
    assert steps == [31, 30]
    assert "equal-step-counts (epoch 0, 1)" in proc.stderr


@pytest.mark.parametrize("target,code,message", [
    (f"{FACTORIES}:stream_without_ids", 2,
     "Error: rank 0: the loader reads an iterable dataset, which has no indices to record; pass --id-field"),
    (f"{FACTORIES}:raises", 1,
     "Error: rank 0: the factory {t} raised RuntimeError: cannot open the shards"),
    (f"{FACTORIES}:nothing", 2, "Error: rank 0: {f} has no 'nothing'"),
    (f"{FACTORIES}:N", 2, "Error: rank 0: {f}:N is not a function but a int"),
    ("tests/no_such_file.py:f", 2, "Error: factory file tests/no_such_file.py does not exist"),
    ("no_such_module_xyz:f", 2, "Error: module no_such_module_xyz cannot be found"),
    ("not-a-target", 2, "Error: factory 'not-a-target' is not of the form"),
])
def test_bad_factories(target, code, message):
    proc = sharddemo(["audit", target], check=False, timeout=120)
    assert proc.returncode == code, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    # Every rank that fails says so; which ones manage before the launcher stops the rest
    # is a race, so the rank list may be "0", "1" or "0, 1" where all ranks fail alike.
    expected = message.format(t=target, f=FACTORIES)
    if expected.startswith("Error: rank 0"):
        assert re.match(r"Error: rank [0-9]+(, [0-9]+)*: ", lines[0]), lines[0]
        expected = expected.split(": ", 2)[2]
        assert lines[0].split(": ", 2)[2].startswith(expected), lines[0]
    else:
        assert lines[0].startswith(expected), lines[0]


def test_testing_api_fails_with_the_verdict():
    # (It passing: test_testing_api_takes_a_function.)
    with pytest.raises(AssertionError, match="order-changes-each-epoch"):
        assert_shards(str(ROOT / "examples" / "no_set_epoch.py") + ":make_loader")


def test_testing_api_takes_a_function():
    from support import factories

    report = assert_shards(factories.everyone_everything, expect="replicated")
    verdicts = report["modes"]["audit"]["verdicts"]
    assert report["world_size"] == 2 and verdicts
    assert all(v["ok"] for v in verdicts if v["verdict"] == "every-rank-sees-everything")


# (the resume demo's header: tests/ranks/test_resume.py::test_compare_resume_runs_every_scenario_side_by_side)
@pytest.mark.parametrize("how", ["audit", "compare"])
def test_the_header_states_the_per_rank_and_global_batch_of_split_batches(how):
    """With split_batches the batch as given (8 here) is sliced across the ranks: the header's
    per-rank batch is what accelerate's own prepared loader yields to a rank, and the global
    batch that times the ranks."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from sharddemo.render import render

    ref = prepare_data_loader(DataLoader(list(range(40)), batch_size=8), num_processes=2,
                              process_index=0, split_batches=True, put_on_device=False)
    per_rank = len(next(iter(ref)))
    if how == "audit":
        proc = audit(f"{FACTORIES}:split_batches_40")
        assert proc.returncode == 0, proc.stderr
    else:
        proc = sharddemo(["compare", "--modes", "prepared", "--split-batches", "--batch-size", "8",
                          "--dataset-size", "40", "--num-processes", "2", "--format", "json"])
    report = json.loads(proc.stdout)
    assert report["global_batch"] == per_rank * 2
    head = render(report, "table").splitlines()[0]
    assert f"| per-rank batch {per_rank} | global batch {per_rank * 2} |" in head
