"""Packed rows (several samples a row, as SFT packing deals them), in one process: an id field
whose rows are lists of ids, or a 2-D tensor padded with -1, is read as the batch's samples by
one rule for the watch's id_field and `audit --id-field` alike, checked against a flatten
written by hand (hypothesis, tests/support/packs.py); a sample split across two consecutive rows
counts once (docs/watch.md, "Packed rows")."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from sharddemo import watch
from support.launch import ROOT
from support.packs import by_hand

LOOP = str(ROOT / "tests" / "scripts" / "packed_loop.py")
N, SEED = 24, 7  # (tests/scripts/packed_loop.py's)
WATCH_SCHEMA = json.loads((ROOT / "docs" / "watch.schema.json").read_text())


def as_tensor(batch: list[list[int]], extra: int) -> torch.Tensor:
    width = max([2, *map(len, batch)]) + extra  # (two columns or more: packed)
    out = torch.full((len(batch), width), -1, dtype=torch.int64)
    for k, row in enumerate(batch):
        out[k, :len(row)] = torch.tensor(row, dtype=torch.int64)
    return out


def readers():
    """The watch's reader and audit's, each with its own carry from batch to batch."""
    from sharddemo.rank.audit import id_reader
    from sharddemo.rank.ids import Packs
    from sharddemo.watching.recording import read_field

    packs = Packs()
    by_audit = id_reader(DataLoader(range(4)), "ids")
    return (lambda batch: read_field(batch, "ids", packs), lambda: packs.split), \
        (lambda batch: by_audit(batch, None), lambda: by_audit.packs.split)


rows = st.lists(st.integers(-1, 6), max_size=5)  # (small ids: a row often begins as the last ended)


@settings(max_examples=300, deadline=None)
@given(batches=st.lists(st.lists(rows, min_size=1, max_size=4), max_size=5),
       form=st.sampled_from(["lists", "tuples", "tensor"]), extra=st.integers(0, 2))
def test_packed_rows_read_as_their_samples_by_one_rule(batches, form, extra):
    expected, split = by_hand(batches)
    for read, splits in readers():
        got = []
        for batch in batches:
            field = (as_tensor(batch, extra) if form == "tensor"
                     else [tuple(r) for r in batch] if form == "tuples"
                     else [list(r) + [-1] * extra for r in batch])
            got.append(read({"ids": field}).tolist())
        assert got == expected
        assert splits() == split


def test_what_stays_as_it_was_and_what_is_refused():
    from sharddemo.watching.recording import read_field

    # a column of ids (B x 1) is one sample a row, as before: a repeat there is a repeat
    assert read_field({"ids": torch.tensor([[7], [7]])}, "ids").tolist() == [7, 7]
    # a -1 before real ids is an id (named by ids-in-range), not padding
    assert read_field({"ids": [[3, -1, 4], [-1, 5, -1]]}, "ids").tolist() == [3, -1, 4, -1, 5]
    # the default collate's transposed list of tensors: refused, with what to do
    with pytest.raises(ValueError, match="list of tensors: the DataLoader's default collate"):
        read_field({"ids": [torch.tensor([3, 12]), torch.tensor([7, -1])]}, "ids")
    with pytest.raises(ValueError, match="rows of rows"):
        read_field({"ids": [[[1, 2]], [[3]]]}, "ids")
    with pytest.raises(ValueError, match=r"packed rows of keys \(str, bytes\)"):
        read_field({"ids": [["a", "b"], ["c"]]}, "ids")


def test_one_process_counts_a_split_once_and_names_a_negative_id(tmp_path, capsys):
    """One process, 6 samples packed into rows of lists (a collate_fn), batches of 2 rows:
    sample 1 ends row 0 and begins row 1 (one batch), sample 2 ends row 1 and begins row 2 (the
    next batch), sample 4 runs over rows 2, 3 and 4: 6 samples once, 3 split (by hand). A
    second loader whose rows hold a -1 before real ids: that -1 is an id outside 0..N-1."""
    packs = [[0, 1], [1, 2], [2, 3, 4], [4], [4, 5]]
    report = tmp_path / "w.jsonl"
    loader = watch(DataLoader(packs, batch_size=2, collate_fn=lambda rows: {"ids": rows}),
                   id_field="ids", dataset_size=6, report=str(report), name="packed")
    assert [b["ids"] for b in loader] == [packs[:2], packs[2:4], packs[4:]]
    bad = watch(DataLoader([[0, 1, 2], [-1, 3, 4, 5]], batch_size=2,
                           collate_fn=lambda rows: {"ids": rows}),
                id_field="ids", dataset_size=6, report=str(report), name="bad",
                on_violation="ignore")
    list(bad)
    import jsonschema

    got = [json.loads(line) for line in report.read_text().splitlines()]
    for entry in got:
        jsonschema.validate(entry, WATCH_SCHEMA)
    assert (got[0]["seen"], got[0]["unique"], got[0]["split_samples"], got[0]["ok"]) == (
        6, 6, 3, True)
    printed = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("sharddemo: epoch 0 packed")]
    assert printed == ["sharddemo: epoch 0 packed: 6 of 6 samples once (3 split across two "
                       "packed rows, each counted once) across 1 rank, 3 steps each, order "
                       "changed: -: ok"]
    assert "split_samples" not in got[1]
    failed = [v for v in got[1]["verdicts"] if not v["ok"]]
    assert [v["verdict"] for v in failed] == ["ids-in-range"] and "(-1)" in failed[0]["detail"]


