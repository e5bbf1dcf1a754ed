"""Packed rows on real ranks (torchrun, gloo; tests/scripts/packed_loop.py): coverage, splits,
the lineage and two planted packer faults, against the rows each rank's loop logged and torch's
own DistributedSampler; then `sharddemo audit` on the same packer."""

from __future__ import annotations

import json
import sys
from typing import Optional

import pytest
from click.testing import CliRunner
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from support.launch import ROOT, audit, torchrun, verdicts
from support.packs import by_hand

LOOP = str(ROOT / "tests" / "scripts" / "packed_loop.py")
N, SEED = 24, 7  # (tests/scripts/packed_loop.py's)
WATCH_SCHEMA = json.loads((ROOT / "docs" / "watch.schema.json").read_text())


rows = st.lists(st.integers(-1, 6), max_size=5)  # (small ids: a row often begins as the last ended)


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

    proc = torchrun([LOOP, tmp_path], nproc=2, timeout=120)
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
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from packed_loop import Packer, as_lists

    proc = audit("tests/scripts/packed_loop.py:make_loader", "--id-field", "ids", "--epochs", "1")
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
