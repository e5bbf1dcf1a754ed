"""Packed rows (several samples a row, as SFT packing deals them): an id field whose rows are
lists of ids, or a 2-D tensor padded with -1, is read as the batch's samples, and a sample
split across two consecutive rows of a rank counts once (docs/watch.md, "Packed rows").

In one process: the reading rule against a flatten written here by hand (hypothesis), for the
watch's id_field and `audit --id-field` alike. On real ranks (torchrun, gloo; tests/packed_loop.py):
coverage, splits, the lineage and two planted packer faults, against the rows each rank's
loop logged and torch's own DistributedSampler; then `sharddemo audit` on the same packer."""

from __future__ import annotations

import json
import sys
from typing import Optional

import pytest
import torch
from click.testing import CliRunner
from conftest import ROOT, audit, free_port, run_cmd, verdicts
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from sharddemo import watch

LOOP = str(ROOT / "tests" / "packed_loop.py")
N, SEED = 24, 7  # (tests/packed_loop.py's)
WATCH_SCHEMA = json.loads((ROOT / "docs" / "watch.schema.json").read_text())


def by_hand(batches: list[list[list[int]]]) -> tuple[list[list[int]], int]:
    """One rank's batches of rows -> each batch's sample ids and the samples split, by the
    rule in docs/watch.md: the -1s that end a row are padding; an id that ends a row and
    begins the next row (the next batch's first row too) is one sample, counted once, however
    many rows it runs over."""
    out, split, last, continued = [], 0, None, False
    for batch in batches:
        ids: list[int] = []
        for row in batch:
            row = list(row)
            while row and row[-1] == -1:
                row.pop()
            merged = bool(row) and last is not None and row[0] == last
            if merged and not continued:
                split += 1
            ids += row[1:] if merged else row
            continued = merged and len(row) == 1
            last = row[-1] if row else None
        out.append(ids)
    return out, split


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


# -- real ranks ----------------------------------------------------------------------------------

def dealt(rank: int, epoch: int, world: int = 2) -> list[int]:
    """torch's DistributedSampler's order for `rank` (the samples the packer packs, in order)."""
    sampler = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def lineage_step(folder, step: int, rank: int) -> Optional[list[int]]:
    from sharddemo.cli import cli

    with pytest.MonkeyPatch.context() as env:  # (the CLI as a user runs it: no rank's env)
        env.delenv("RANK", raising=False)
        env.delenv("WORLD_SIZE", raising=False)
        result = CliRunner().invoke(cli, ["lineage", str(folder), "--step", str(step), "--rank",
                                          str(rank), "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["batches"][0]["ids"]


def test_packed_rows_on_two_ranks_coverage_splits_lineage_and_faults(tmp_path):
    """2 ranks (torchrun), each packing its DistributedSampler's 12 samples into rows (one
    12-token sample over three rows), 4 steps of 2 rows: every case checked against the rows
    each loop logged, flattened by hand, and torch's sampler."""
    import jsonschema

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), LOOP, str(tmp_path)]
    proc = run_cmd(cmd, timeout=120)
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    entries = [json.loads(line) for line in (tmp_path / "report.jsonl").read_text().splitlines()]
    for entry in entries:
        jsonschema.validate(entry, WATCH_SCHEMA)
    entry = {(e["loader"], e["epoch"]): e for e in entries}
    for case in ("lists", "padded"):
        for epoch in range(2):
            flat = [by_hand(logs[r][case][epoch]) for r in range(2)]
            # the packer kept torch's order, each sample once: the rule gives it back
            for r in range(2):
                assert sum(flat[r][0], []) == dealt(r, epoch)
            e = entry[(case, epoch)]
            split = flat[0][1] + flat[1][1]
            assert split == 6  # (3 a rank: a split across batches, one within, one over 3 rows)
            assert (e["seen"], e["unique"], e["split_samples"], e["ok"]) == (N, N, split, True)
            assert e["steps"] == [len(logs[r][case][epoch]) for r in range(2)]
            assert (f"sharddemo: epoch {epoch} {case}: {N} of {N} samples once ({split} split "
                    "across two packed rows, each counted once) across 2 ranks, "
                    f"{e['steps'][0]} steps each") in proc.stdout
    # the lineage: each step's samples, a split one at the step it began
    steps = len(logs[0]["lists"][0])
    for r in range(2):
        per_step = [ids for epoch in range(2) for ids in by_hand(logs[r]["lists"][epoch])[0]]
        for step in (0, 1, 2, steps + 1):
            assert lineage_step(tmp_path / "lineage", step, r) == per_step[step]
    # a packer that lost a sample: the one torch dealt rank 1 fifth
    e = entry[("drop", 0)]
    got = by_hand(logs[1]["drop"][0])[0] + by_hand(logs[0]["drop"][0])[0]
    lost = sorted(set(range(N)) - set(sum(got, [])))
    assert lost == [dealt(1, 0)[4]]
    assert e["missing"]["ids"] == lost and not e["ok"]
    said = {v["verdict"]: v for v in e["verdicts"] if not v["ok"]}
    assert f"[{lost[0]}]" in said["no-missing-samples"]["detail"]
    # a packer that packed a sample again in a row not next to its first: a duplicate
    e = entry[("repeat", 0)]
    rows = [row for batch in logs[0]["repeat"][0] for row in batch]
    twice = dealt(0, 0)[1]
    where = [k for k, row in enumerate(rows) if twice in row]
    assert len(where) == 2 and where[1] - where[0] > 1  # (not consecutive rows: no split)
    assert e["duplicated"]["ids"] == [twice] and e["duplicated"]["count"] == 1
    assert "no-unexplained-duplicates" in {v["verdict"] for v in e["verdicts"] if not v["ok"]}
    assert e["split_samples"] == by_hand(logs[0]["repeat"][0])[1] + by_hand(
        logs[1]["repeat"][0])[1]


def test_audit_reads_packed_rows_by_the_same_rule(tmp_path):
    """`sharddemo audit --id-field ids` on the same packer (2 ranks, 1 epoch): each rank's
    batches are its samples, by hand from the rows torch's sampler gives the packer."""
    sys.path.insert(0, str(ROOT / "tests"))
    from packed_loop import Packer, as_lists

    proc = audit("tests/packed_loop.py:make_loader", "--id-field", "ids", "--epochs", "1")
    report, said = verdicts(proc)
    assert proc.returncode == 0, proc.stderr
    assert all(said.values()) and said
    epoch = report["modes"]["audit"]["epochs"][0]
    assert (epoch["seen"], epoch["unique"]) == (N, N)
    for r in range(2):
        packer = Packer(r, 2)
        packer.set_epoch(0)
        rows = [as_lists(b)["ids"] for b in DataLoader(packer, batch_size=2, collate_fn=list)]
        batches, _ = by_hand(rows)
        assert epoch["ranks"][r]["batches"] == batches
        assert sum(batches, []) == dealt(r, 0)
