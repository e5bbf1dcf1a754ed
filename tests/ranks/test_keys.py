"""Samples named by keys (str, bytes) on real ranks: `audit --id-field KEY [--keys FILE]`,
expected values from accelerate's own prepare_data_loader for each rank (tests/support/sim.py),
or worked out by hand; forced 64-bit collisions through tests/support/collideplugin."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from support.launch import ROOT, sharddemo
from torch.utils.data import DataLoader

SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


# -- real ranks ---------------------------------------------------------------------------------

def audit_json(tmp_path, factory: str, *args: str, nproc: int = 2, field: str = "key") -> dict:
    out = tmp_path / f"{factory}.json"
    proc = sharddemo(["audit", f"tests/support/factories.py:{factory}", "--id-field", field,
                      "--num-processes", str(nproc), "--output", str(out), "--format", "json",
                      *args], check=False)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(out.read_text())
    jsonschema.validate(report, SCHEMA)
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_a_keyed_prepared_loader_on_real_ranks(tmp_path, world):
    """Expected: accelerate's own prepare_data_loader for each rank (tests/support/sim.py), seeded as
    the factory seeds, walked for 2 epochs, its keys read from its batches."""
    from support.factories import Keyed
    from support.sim import SimAccelerator

    report = audit_json(tmp_path, "keyed_prepared", nproc=world)
    expected = []  # [rank][epoch] -> batches of keys
    for rank in range(world):
        torch.manual_seed(7)
        loader = SimAccelerator(world, rank).prepare(DataLoader(Keyed(), batch_size=4,
                                                                shuffle=True))
        expected.append([[b["key"] for b in loader] for _ in range(2)])
    for e in report["modes"]["audit"]["epochs"]:
        batches = [expected[r][e["epoch"]] for r in range(world)]
        assert [r["batches"] for r in e["ranks"]] == batches
        seen = [k for rank in batches for b in rank for k in b]
        assert (e["seen"], e["unique"], e["missing_count"]) == (len(seen), 22, 0)
        assert sorted(d["id"] for d in e["duplicates"]) == sorted(
            {k for k in seen if seen.count(k) > 1})
    assert report["keys"]["seen"] == 22 and not report["keys"]["known"]
    assert all(v["ok"] for v in report["modes"]["audit"]["verdicts"])


def test_a_keyed_stream_names_its_missing_key_only_where_the_keys_are_known(tmp_path):
    """KeyedStream sends "s-000".."s-020" split by rank (bytes keys), never "s-021" (by
    hand). With --keys the missing one is named; with --dataset-size it is counted only."""
    keys = tmp_path / "keys.txt"
    keys.write_text("".join(f"s-{i:03d}\n" for i in range(22)))
    named = audit_json(tmp_path, "keyed_stream", "--keys", str(keys))
    counted = audit_json(tmp_path, "keyed_stream", "--dataset-size", "22")
    for report, missing in ((named, ["s-021"]), (counted, [])):
        for e in report["modes"]["audit"]["epochs"]:
            assert (e["seen"], e["unique"], e["missing_count"]) == (21, 21, 1)
            assert e["missing"] == missing
            assert e["ranks"][0]["batches"][0] == ["s-000", "s-002", "s-004"]
    assert named["keys"]["known"] and not counted["keys"]["known"]


def test_keyed_replication_is_caught(tmp_path):
    report = audit_json(tmp_path, "keyed_replicated")
    failed = {v["verdict"] for v in report["modes"]["audit"]["verdicts"] if not v["ok"]}
    assert "no-silent-replication" in failed
    e = report["modes"]["audit"]["epochs"][0]
    assert e["seen"] == 44 and e["duplicate_count"] == 22  # every key on both ranks (by hand)


def test_keys_that_cannot_be_audited_so_say_one_line(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("s-000\n")
    cases = [
        (["--gather", "count", "--dataset-size", "22"],
         "the count path numbers keys by the set of all keys, which is not known here; pass "
         "--keys FILE listing every sample's key, or --gather epoch"),
        (["--keys", str(keys)], "that --keys"),
    ]
    for args, message in cases:
        proc = sharddemo(["audit", "tests/support/factories.py:keyed_stream", "--id-field", "key",
                          *args], check=False)
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and message in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr
    proc = sharddemo(["audit", "tests/support/factories.py:tuple_ids", "--keys", str(keys)], check=False)
    assert proc.returncode == 2 and "pass --id-field too" in proc.stderr


def test_a_string_id_column_of_a_datasets_table(tmp_path):
    """A datasets.Dataset with a string id column, prepared: expected from accelerate's own
    prepare_data_loader over the same table for each rank (tests/support/sim.py)."""
    from datasets import Dataset
    from support.factories import KEYED
    from support.sim import SimAccelerator

    out = tmp_path / "hf.json"
    proc = sharddemo(["audit", "tests/support/factories.py:hf_question_ids", "--id-field", "qid",
                      "--output", str(out), "--format", "json"], check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    jsonschema.validate(report, SCHEMA)
    table = Dataset.from_dict({"qid": [f"q{i:04d}" for i in range(KEYED)],
                               "x": [float(i) for i in range(KEYED)]}).with_format("torch")
    expected = []
    for rank in range(2):
        torch.manual_seed(3)
        loader = SimAccelerator(2, rank).prepare(DataLoader(table, batch_size=4, shuffle=True))
        expected.append([[list(b["qid"]) for b in loader] for _ in range(2)])
    for e in report["modes"]["audit"]["epochs"]:
        assert [r["batches"] for r in e["ranks"]] == [expected[r][e["epoch"]] for r in range(2)]
        assert e["unique"] == KEYED and e["missing_count"] == 0
    assert report["dataset_size"] == KEYED and report["keys"]["seen"] == KEYED


# -- the count path over keys: 64-bit hashes, collisions kept apart -----------------------------


COLLIDE_PLUGIN = str(ROOT / "tests" / "support" / "collideplugin")


def collide_env(spec: str) -> dict:
    import os

    from support.launch import launch_env

    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [COLLIDE_PLUGIN, env.get("PYTHONPATH")]))
    env["SHARDDEMO_TEST_COLLIDE"] = spec
    return env


def test_the_count_path_counts_keys_apart_when_their_hashes_collide(tmp_path):
    """KeyedStream sends s-000..s-020 split by rank, batches of 3, never s-021 (by hand). On
    the count path, with s-004 forced onto s-003's 64-bit hash in every rank, each is still
    counted once: 21 unique, no duplicate, s-021 missing and named, the collision reported.
    Merged, s-003 would count twice and s-004 never."""
    keys = tmp_path / "keys.txt"
    keys.write_text("".join(f"s-{i:03d}\n" for i in range(22)))
    out = tmp_path / "counted.json"
    proc = sharddemo(["audit", "tests/support/factories.py:keyed_stream", "--id-field", "key",
                      "--gather", "count", "--keys", str(keys), "--format", "json",
                      "--output", str(out)], check=False, env=collide_env("s-004=s-003"))
    assert proc.returncode == 1, proc.stderr  # no-missing-samples: s-021
    report = json.loads(out.read_text())
    jsonschema.validate(report, SCHEMA)
    assert report["keys"]["hashed"] and report["keys"]["known"]
    assert report["keys"]["collisions"] == {"known": [["s-003", "s-004"]], "delivered": [],
                                            "delivered_count": 0}
    for e in report["modes"]["audit"]["epochs"]:
        assert e["gather"] == "count"
        assert (e["seen"], e["unique"], e["duplicate_count"]) == (21, 21, 0)
        assert e["missing"] == ["s-021"] and e["missing_count"] == 1
        assert e["ranks"][0]["first_batches"][0] == ["s-000", "s-002", "s-004"]
        assert e["ranks"][1]["first_batches"][0] == ["s-001", "s-003", "s-005"]
        assert [r["samples"] for r in e["ranks"]] == [11, 10]


def test_a_delivered_key_that_collides_with_a_known_one_is_not_merged(tmp_path):
    """The file leaves out s-020, which the loader delivers; s-020 is forced onto s-005's
    64-bit hash. Merged, it would pass as a second s-005; kept apart, it is a key the file
    does not hold: one Error line naming it (as without the collision)."""
    keys = tmp_path / "keys.txt"
    keys.write_text("".join(f"s-{i:03d}\n" for i in range(22) if i != 20))
    for env in (collide_env("s-020=s-005"), None):
        proc = sharddemo(["audit", "tests/support/factories.py:keyed_stream", "--id-field", "key",
                          "--gather", "count", "--keys", str(keys)], check=False, env=env)
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "delivered 1 key(s)" in errors[0] and "'s-020'" in errors[0]


@pytest.mark.parametrize("world", [2, 3])
def test_the_count_path_over_keys_with_workers_agrees_with_the_sampler(tmp_path, world):
    """A DistributedSampler (shuffled, seed 5) over the 22 keyed samples, 2 workers: expected
    from torch's own DistributedSampler for each rank, the keys of the indices it yields."""
    from torch.utils.data import DistributedSampler

    from support.factories import Keyed

    keys = tmp_path / "keys.txt"
    keys.write_text("".join(f"s-{i:03d}\n" for i in range(22)))
    report = audit_json(tmp_path, "keyed_sampled_workers", "--gather", "count", "--keys",
                        str(keys), "--set-epoch", nproc=world)
    assert report["keys"]["hashed"]
    for e in report["modes"]["audit"]["epochs"]:
        order = []
        for rank in range(world):
            sampler = DistributedSampler(Keyed(), num_replicas=world, rank=rank, shuffle=True,
                                         seed=5)
            sampler.set_epoch(e["epoch"])
            order.append([f"s-{i:03d}" for i in sampler])
        got = e["ranks"]
        assert [r["samples"] for r in got] == [len(o) for o in order]
        assert [r["first_batches"][0] for r in got] == [o[:4] for o in order]
        seen = [k for o in order for k in o]
        assert (e["seen"], e["unique"], e["missing_count"]) == (len(seen), 22, 0)
        assert e["duplicate_count"] == len(seen) - 22  # the sampler's own padding
    assert all(v["ok"] for v in report["modes"]["audit"]["verdicts"])


@pytest.mark.parametrize("gather", ["auto", "count"])
def test_the_missing_keys_are_named_from_the_datasets_own_column(tmp_path, gather):
    """No --keys: the datasets.Dataset's string column is the set of keys. Prepared with
    drop_last=True: expected from accelerate's own prepare_data_loader for each rank; the
    questions it never yields are named, on the id path and the count path alike."""
    from datasets import Dataset
    from support.factories import KEYED
    from support.sim import SimAccelerator

    report = audit_json(tmp_path, "hf_question_ids_drop_last", "--gather", gather,
                        field="qid")
    table = Dataset.from_dict({"qid": [f"q{i:04d}" for i in range(KEYED)],
                               "x": [float(i) for i in range(KEYED)]}).with_format("torch")
    assert report["keys"]["known"] and report["keys"]["from"] == "the dataset's column 'qid'"
    assert report["keys"]["hashed"] == (gather == "count")
    for e in report["modes"]["audit"]["epochs"]:
        seen = set()
        for rank in range(2):
            torch.manual_seed(3)
            loader = SimAccelerator(2, rank).prepare(DataLoader(table, batch_size=4,
                                                                shuffle=True, drop_last=True))
            for epoch in range(e["epoch"] + 1):
                batches = [list(b["qid"]) for b in loader]
            seen |= {k for b in batches for k in b}
        missing = sorted(f"q{i:04d}" for i in range(KEYED) if f"q{i:04d}" not in seen)
        assert missing, "drop_last drops the short last round"
        assert sorted(e["missing"]) == missing and e["missing_count"] == len(missing)
        assert e["missing_reason"] == "drop-last"
