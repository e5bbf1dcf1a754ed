"""Samples named by keys (str, bytes), in one process: the rank side's key table and exchange
format, the parent's numbering, a file of keys, hash collisions kept apart, and a report built
from a hand-made trace. Keyed loaders audited on real ranks: tests/ranks/test_keys.py."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from support.launch import ROOT

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


# -- the count path over keys: 64-bit hashes, collisions kept apart -----------------------------

def force(monkeypatch, pairs: dict):
    """Key A of `pairs` gets key B's 64-bit hash (its check stays its own), as two keys whose
    hashes agree by chance would."""
    import importlib.util

    import sharddemo.rank.keys as keys

    spec = importlib.util.spec_from_file_location(
        "collideplugin", ROOT / "tests" / "support" / "collideplugin" / "sitecustomize.py")
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
