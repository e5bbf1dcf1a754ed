"""sharddemo audit and sharddemo.testing on 2 and 3 real gloo ranks."""

from __future__ import annotations

import json
import re

import pytest
from conftest import ROOT, sharddemo
from torch.utils.data import DistributedSampler

from sharddemo.testing import assert_shards

FACTORIES = str(ROOT / "tests" / "factories.py")


SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


def audit(target, *args, check=True, nproc=2):
    """`sharddemo audit TARGET --format json`; every report it prints must validate."""
    import jsonschema

    proc = sharddemo(["audit", target, "--num-processes", str(nproc), "--format", "json", *args],
                     check=False)
    if check and proc.returncode not in (0, 1):
        pytest.fail(f"audit exited {proc.returncode}\n{proc.stderr}")
    if proc.returncode in (0, 1) and proc.stdout.strip():
        jsonschema.validate(json.loads(proc.stdout), SCHEMA)
    return proc


def verdicts(proc):
    report = json.loads(proc.stdout)
    out = {}
    for v in report["modes"]["audit"]["verdicts"]:
        out[v["verdict"]] = out.get(v["verdict"], True) and v["ok"]
    return report, out


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


@pytest.mark.parametrize("target,field", [("hf_with_id_field", "sample_id"), ("tuple_ids", "0")])
def test_id_field(target, field):
    proc = audit(f"{FACTORIES}:{target}", "--id-field", field, nproc=3)
    report, got = verdicts(proc)
    assert all(got.values()), got
    e = report["modes"]["audit"]["epochs"][0]
    assert e["missing"] == [] and report["dataset_size"] == 60
    import jsonschema

    jsonschema.validate(report, json.loads((ROOT / "docs" / "report.schema.json").read_text()))


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
    import factories

    report = assert_shards(factories.everyone_everything, expect="replicated")
    verdicts = report["modes"]["audit"]["verdicts"]
    assert report["world_size"] == 2 and verdicts
    assert all(v["ok"] for v in verdicts if v["verdict"] == "every-rank-sees-everything")


@pytest.mark.parametrize("how", ["audit", "compare", "resume"])
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
    else:  # the resume demo builds its report apart from the modes
        mode = "prepared" if how == "compare" else "resume"
        proc = sharddemo(["compare", "--modes", mode, "--split-batches", "--batch-size", "8",
                          "--dataset-size", "40", "--num-processes", "2", "--format", "json"])
    report = json.loads(proc.stdout)
    assert report["global_batch"] == per_rank * 2
    head = render(report, "table").splitlines()[0]
    assert f"| per-rank batch {per_rank} | global batch {per_rank * 2} |" in head


# Loaders whose own objects deal part of the dataset or repeat ids by design (a random_split
# part, a sampler that draws with replacement): the truth is what those objects deal, and a
# real loss or a replication still fails. Expected values from torch's and accelerate's objects.
def _received(e) -> set:
    return {i for r in e["ranks"] for b in r["batches"] for i in b}


def test_a_random_split_part_is_audited_against_its_own_data():
    """On 3 ranks and the count path (the ids path: the train/test split of datasets below,
    and tests/test_report_units.py)."""
    from factories import split_parts

    train, held = split_parts()  # torch's random_split, seeded as the factory seeds it
    proc = audit(f"{FACTORIES}:random_split_train", "--epochs", "1", "--gather", "count",
                 nproc=3)
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    e = report["modes"]["audit"]["epochs"][0]
    assert e["missing_count"] == len(held) and e["unique"] == len(train)
    assert e["missing"] == sorted(held.indices)  # the held-out part, and nothing else
    assert e["missing_reason"] == "subset" and e["missing_explained"]
    # accelerate's gather_for_metrics cuts the last step by len(dataset) = len(train)
    assert e["gathered_for_metrics_count"] == len(train) and e["gather_for_metrics_exact"]
    assert report["modes"]["audit"]["loader"]["domain"] == len(set(train.indices))


def _weighted_oracle(world: int, epochs: int, prepared: bool):
    """[epoch][rank] -> batches: the factory's DataLoader over WeightedRandomSampler(seed 5),
    built fresh per rank and, where prepared, through accelerate's prepare_data_loader."""
    import torch
    from accelerate.data_loader import prepare_data_loader
    from oracle import ACCELERATOR_RNG_TYPES, ensure_accelerator_state
    from torch.utils.data import DataLoader, WeightedRandomSampler

    from factories import N, _dataset

    out = [[None] * world for _ in range(epochs)]
    for rank in range(world):
        sampler = WeightedRandomSampler(torch.ones(N), N,
                                        generator=torch.Generator().manual_seed(5))
        loader = DataLoader(_dataset(), batch_size=4, sampler=sampler)
        if prepared:
            ensure_accelerator_state()
            loader = prepare_data_loader(loader, num_processes=world, process_index=rank,
                                         put_on_device=False,
                                         rng_types=list(ACCELERATOR_RNG_TYPES))
        for epoch in range(epochs):
            out[epoch][rank] = [[int(i) for i in ids] for ids, _ in loader]
    return out


def test_a_sampler_with_replacement_repeats_and_skips_by_design():
    """2 epochs on 3 ranks, the count path (the ids path: tests/test_report_units.py)."""
    nproc, gather = 3, "count"
    expected = _weighted_oracle(nproc, 2, prepared=True)
    proc = audit(f"{FACTORIES}:weighted_draws", "--gather", gather, nproc=nproc)
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    for e, ranks in zip(report["modes"]["audit"]["epochs"], expected):
        drawn = [i for batches in ranks for b in batches for i in b]
        assert e["seen"] == len(drawn) and e["unique"] == len(set(drawn))
        assert e["missing_count"] == 60 - len(set(drawn)) > 0
        assert [r["steps"] for r in e["ranks"]] == [len(batches) for batches in ranks]
        assert e["missing_reason"] == "sampler-draws" and e["duplicates_explained"]
        assert {d["reason"] for d in e["duplicates"]} == {"sampler-draws"}


def test_the_same_draw_on_every_rank_is_replication():
    expected = _weighted_oracle(2, 1, prepared=False)
    proc = audit(f"{FACTORIES}:weighted_draws_unprepared", "--epochs", "1")
    report, got = verdicts(proc)
    assert proc.returncode == 1 and not got["no-silent-replication"], got
    e = report["modes"]["audit"]["epochs"][0]
    assert [r["batches"] for r in e["ranks"]] == expected[0]
    assert expected[0][0] == expected[0][1]  # torch: the same sampler draws the same on each
    assert {d["reason"] for d in e["duplicates"]} == {"replication"}


def test_a_datasets_view_is_audited_by_its_table_rows():
    """train_test_split's train part: the positions the DataLoader asks for are mapped to the
    table's rows (its indices mapping), so the ids are the samples' own (sample_id = row) and
    the held-out quarter is the view's, not a loss. Expected from datasets' own split."""
    from factories import hf_ids

    parts = hf_ids().train_test_split(test_size=0.25, seed=0)
    proc = audit(f"{FACTORIES}:hf_train_test_split", "--epochs", "1")
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    e = report["modes"]["audit"]["epochs"][0]
    assert _received(e) == {int(i) for i in parts["train"]["sample_id"]}
    assert e["missing"] == sorted(int(i) for i in parts["test"]["sample_id"])
    assert e["missing_reason"] == "subset" and report["dataset_size"] == 60


def test_a_per_rank_datasets_split_needs_ids_and_is_right_with_them():
    """split_dataset_by_node on a map-style datasets.Dataset: by position, every rank's rows
    would look like the same samples (replication); the audit refuses, and with --id-field
    each rank received its own part, from datasets' own split."""
    from datasets.distributed import split_dataset_by_node
    from factories import hf_ids

    proc = audit(f"{FACTORIES}:hf_split_by_node", "--epochs", "1", check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "read different rows of a datasets.Dataset" in lines[0] and "--id-field" in lines[0]
    proc = audit(f"{FACTORIES}:hf_split_by_node", "--epochs", "1", "--id-field", "sample_id")
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    e = report["modes"]["audit"]["epochs"][0]
    for r in e["ranks"]:
        part = split_dataset_by_node(hf_ids(), rank=r["rank"], world_size=2)
        assert sorted(i for b in r["batches"] for i in b) == sorted(int(i) for i in part["sample_id"])
    assert report["dataset_size"] == 60 and e["times_dataset"] == 1
