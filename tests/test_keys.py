"""Samples named by keys (str, bytes): `audit --id-field KEY [--keys FILE]`.

In one process: the rank side's key table and exchange format, the parent's numbering, and a
report built from a hand-made trace. On real ranks: keyed loaders audited, expected values from
accelerate's own prepare_data_loader for each rank (tests/sim.py), or worked out by hand."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from conftest import ROOT, sharddemo
from torch.utils.data import DataLoader

SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


# -- one process --------------------------------------------------------------------------------

def test_key_values_reads_str_bytes_and_arrays_and_leaves_numbers():
    from sharddemo.errors import UsageError
    from sharddemo.rank.keys import key_values

    assert key_values(["a", "b"]) == ["a", "b"]
    assert key_values((b"a", b"\xff")) == ["a", "\\xff"]  # undecodable: a backslash escape
    assert key_values(np.array(["x", "y"])) == ["x", "y"]
    assert key_values("solo") == ["solo"]
    assert key_values(torch.tensor([1, 2])) is None and key_values([1, 2]) is None
    assert key_values(np.array([1, 2])) is None
    with pytest.raises(UsageError, match="mixes keys"):
        key_values(["a", 3])


def test_the_key_table_and_its_exchange_as_in_the_module_docstring():
    """Rank 0 sees [["a", "b"], ["c"]], rank 1 [["b"], ["d", "a"]] (by hand, rank.keys)."""
    from sharddemo.rank.keys import KeyTable, decode, name_record

    tables, records = [], []
    for batches in ([["a", "b"], ["c"]], [["b"], ["d", "a"]]):
        table = KeyTable("key")
        records.append([table.lookup(b).tolist() for b in batches])
        tables.append(decode(bytes(table.encode().numpy().tobytes())))
    assert records == [[[0, 1], [2]], [[0], [1, 2]]]
    assert tables == [["a", "b", "c"], ["b", "d", "a"]]
    record = {"epoch": 0, "gather": "batch",
              "ranks": [{"rank": r, "batches": b, "workers": []} for r, b in enumerate(records)],
              # what the per-batch gathers returned, step by step in rank order, cut at 4
              "gathered_for_metrics": [0, 1, 0, 2]}
    named = name_record(record, tables)
    assert [r["batches"] for r in named["ranks"]] == [[["a", "b"], ["c"]], [["b"], ["d", "a"]]]
    assert named["gathered_for_metrics"] == ["a", "b", "b", "c"] and named["ids_are_keys"]
    # keys that are not plain ASCII travel whole
    table = KeyTable("key")
    table.lookup(["naïve", "日本", "a\nb"])
    assert decode(bytes(table.encode().numpy().tobytes())) == ["naïve", "日本", "a\nb"]


def keyed_trace(batches_per_rank: list[list[list[str]]], size: int = 0) -> dict:
    """A trace as audit's ranks write it for one epoch of keyed batches (an epoch gather)."""
    world = len(batches_per_rank)
    record = {"epoch": 0, "gather": "epoch", "ids_are_keys": True,
              "gathered_for_metrics": None, "remainder": [None] * world,
              "ranks": [{"rank": r, "batches": b, "workers": [-1] * len(b)}
                        for r, b in enumerate(batches_per_rank)]}
    return {"world_size": world, "backend": "gloo", "dataset_size": size, "batch_size": 2,
            "global_batch": 2 * world, "epochs": 1, "seed": 0,
            "options": {"audit": {"expect": "sharded"}, "drop_last": False},
            "modes": {"audit": {"description": "keyed", "epochs": [record], "role": "train",
                                "prepared": False, "loader": {"drop_last": False},
                                "sizes": {"dataset_size": size, "batch_size": 2,
                                          "global_batch": 2 * world}}}}


def test_keys_numbered_and_named_in_the_report():
    """The module docstring's case: three ranks saw "b", "a" / "c" / "a", N = 4 given: a -> 0,
    b -> 1, c -> 2; "a" came twice, 1 sample missing and not named (by hand)."""
    from sharddemo.analysis import build_report
    from sharddemo.analysis.keys import number_keys

    trace = keyed_trace([[["b", "a"]], [["c"]], [["a"]]])
    keys = number_keys(trace, size=4)
    assert keys["names"][:3] == ["a", "b", "c"] and keys["dataset_size"] == 4
    assert [r["batches"] for r in trace["modes"]["audit"]["epochs"][0]["ranks"]] == [
        [[1, 0]], [[2]], [[0]]]
    report = build_report(trace, keys=keys, key_field="key")
    jsonschema.validate(report, SCHEMA)
    e = report["modes"]["audit"]["epochs"][0]
    assert (e["seen"], e["unique"], e["missing_count"], e["missing"]) == (4, 3, 1, [])
    assert [(d["id"], d["count"]) for d in e["duplicates"]] == [("a", 2)]
    assert [r["batches"] for r in e["ranks"]] == [[["b", "a"]], [["c"]], [["a"]]]
    assert report["keys"] == {"field": "key", "known": False, "seen": 3, "dataset_size": 4,
                              "missing_named": False, "from": None, "hashed": False}
    failed = {v["verdict"]: v["detail"] for v in report["modes"]["audit"]["verdicts"]
              if not v["ok"]}
    assert "not named" in failed["no-missing-samples"]
    # with the keys known, the missing one is named: "d"; a key the file lacks is outside
    trace = keyed_trace([[["b", "a"]], [["c"]], [["zz"]]])
    keys = number_keys(trace, known=["a", "b", "c", "d"])
    report = build_report(trace, keys=keys, key_field="key")
    jsonschema.validate(report, SCHEMA)
    e = report["modes"]["audit"]["epochs"][0]
    assert (e["missing"], e["out_of_range"], report["dataset_size"]) == (["d"], ["zz"], 4)
    from sharddemo.render import render

    for fmt in ("table", "markdown", "json"):
        text = render(report, fmt)
        assert "zz" in text and '"d"' in text if fmt == "json" else "d" in text


def test_a_file_of_keys_is_read_or_refused_in_one_line(tmp_path):
    from sharddemo.targets import read_keys
    from sharddemo.errors import UsageError

    path = tmp_path / "keys.txt"
    path.write_bytes("a\r\nb\nc".encode())
    assert read_keys(str(path)) == ["a", "b", "c"]
    for text, message in (("", "is empty"), ("a\nb\na\n", "line 3 repeats the key 'a' of line 1")):
        path.write_text(text)
        with pytest.raises(UsageError, match=message):
            read_keys(str(path))
    path.write_text("a\nb\n")
    with pytest.raises(UsageError, match="lists 2 keys but --dataset-size is 3"):
        read_keys(str(path), 3)
    with pytest.raises(UsageError, match="cannot read it"):
        read_keys(str(tmp_path / "none.txt"))
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(UsageError, match="not UTF-8"):
        read_keys(str(path))


# -- real ranks ---------------------------------------------------------------------------------

def audit_json(tmp_path, factory: str, *args: str, nproc: int = 2, field: str = "key") -> dict:
    out = tmp_path / f"{factory}.json"
    proc = sharddemo(["audit", f"tests/factories.py:{factory}", "--id-field", field,
                      "--num-processes", str(nproc), "--output", str(out), "--format", "json",
                      *args], check=False)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(out.read_text())
    jsonschema.validate(report, SCHEMA)
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_a_keyed_prepared_loader_on_real_ranks(tmp_path, world):
    """Expected: accelerate's own prepare_data_loader for each rank (tests/sim.py), seeded as
    the factory seeds, walked for 2 epochs, its keys read from its batches."""
    from factories import Keyed
    from sim import SimAccelerator

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
        proc = sharddemo(["audit", "tests/factories.py:keyed_stream", "--id-field", "key",
                          *args], check=False)
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and message in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr
    proc = sharddemo(["audit", "tests/factories.py:tuple_ids", "--keys", str(keys)], check=False)
    assert proc.returncode == 2 and "pass --id-field too" in proc.stderr


def test_a_string_id_column_of_a_datasets_table(tmp_path):
    """A datasets.Dataset with a string id column, prepared: expected from accelerate's own
    prepare_data_loader over the same table for each rank (tests/sim.py)."""
    from datasets import Dataset
    from factories import KEYED
    from sim import SimAccelerator

    out = tmp_path / "hf.json"
    proc = sharddemo(["audit", "tests/factories.py:hf_question_ids", "--id-field", "qid",
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

def force(monkeypatch, pairs: dict):
    """Key A of `pairs` gets key B's 64-bit hash (its check stays its own), as two keys whose
    hashes agree by chance would."""
    import importlib.util

    import sharddemo.rank.keys as keys

    spec = importlib.util.spec_from_file_location(
        "collideplugin", ROOT / "tests" / "collideplugin" / "sitecustomize.py")
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    real = keys.key_hashes
    monkeypatch.setattr(keys, "key_hashes", plugin.forcing(real, pairs))
    return real


def test_the_key_index_keeps_apart_keys_whose_hashes_collide(monkeypatch):
    """Known keys a, b, c, d are ids 0..3 (by hand). c is given b's 64-bit hash, and the
    unknown key x is given a's: c still counts as 2, and x is outside (4 + a's hash >> 2),
    recorded as a collision with a, not merged into it."""
    from sharddemo.errors import UsageError
    from sharddemo.rank.keys import KeyIndex

    real = force(monkeypatch, {"c": "b", "x": "a"})
    index = KeyIndex([["a", "b"], ["c", "d"]], "test")
    assert index.n == 4 and index.known_collisions == [[1, 2]]
    a_hash = int(real(["a"])[0][0])
    got = index.lookup(["c", "b", "x", "a", "d", "c"]).tolist()
    assert got == [2, 1, 4 + (a_hash >> 2), 0, 3, 2]
    events = index.events()
    assert events["collisions"] == [("x", 0)] and events["collision_count"] == 1
    assert events["outside"] == {4 + (a_hash >> 2): "x"}
    assert index.events()["collision_count"] == 0  # a fresh log each epoch
    # an unknown key whose hash nobody shares: outside, no collision
    y = index.lookup(["y"]).tolist()[0]
    assert y == 4 + (int(real(["y"])[0][0]) >> 2) and index.collision_count == 0
    with pytest.raises(UsageError, match="key 2 is key 0 again"):
        KeyIndex([["a", "b", "a"]], "test")


def test_three_known_keys_on_one_hash_are_three_samples(monkeypatch):
    """b and c forced onto a's 64-bit hash: the pairs (0, 1), (0, 2), (1, 2) are collisions
    (by hand), and each key still has its own id."""
    from sharddemo.rank.keys import KeyIndex

    force(monkeypatch, {"b": "a", "c": "a"})
    index = KeyIndex([["a", "b", "c", "d"]], "test")
    assert index.known_collisions == [[0, 1], [0, 2], [1, 2]]
    assert index.lookup(["c", "a", "b", "d"]).tolist() == [2, 0, 1, 3]
    assert index.events()["collision_count"] == 0


def test_key_hashes_are_the_xxh3_128_digest_halves():
    """The hash and check of "s-000": the low and high 8 bytes (little-endian) of xxhash's
    own xxh3_128 digest of its UTF-8 bytes."""
    import xxhash

    from sharddemo.rank.keys import key_hashes

    digest = xxhash.xxh3_128_digest(b"s-000")
    h, c = key_hashes(["s-000", "naïve"])
    assert int(h[0]) == int.from_bytes(digest[:8], "little")
    assert int(c[0]) == int.from_bytes(digest[8:], "little")
    assert int(h[1]) == int.from_bytes(xxhash.xxh3_128_digest("naïve".encode())[:8], "little")


COLLIDE_PLUGIN = str(ROOT / "tests" / "collideplugin")


def collide_env(spec: str) -> dict:
    import os

    from conftest import launch_env

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
    proc = sharddemo(["audit", "tests/factories.py:keyed_stream", "--id-field", "key",
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
        proc = sharddemo(["audit", "tests/factories.py:keyed_stream", "--id-field", "key",
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

    from factories import Keyed

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
    from factories import KEYED
    from sim import SimAccelerator

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
