"""watch() written inside accelerator.prepare(...), as people write it, on real ranks
(tests/scripts/prepare_forms_loop.py): the watch follows the loader prepare() makes, with the
same figures as the README's two-line form, checked against the ids each rank's loop logged; a
form it cannot follow says so once, never stays silent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.launch import accelerate_launch, ended_or_aborted_at_teardown

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "prepare_forms_loop.py")


def launch(tmp_path: Path, form: str):
    report = tmp_path / "w.jsonl"
    proc = accelerate_launch([SCRIPT, "--form", form, "--report", str(report),
                              "--ids", str(tmp_path)], check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    logged = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    entries = ([json.loads(line) for line in report.read_text().splitlines()]
               if report.exists() else [])
    return proc, logged, entries


@pytest.mark.parametrize("form", ["inside-prepare", "inside-prepare-one"])
def test_a_watch_written_inside_prepare_checks_what_each_rank_received(tmp_path, form):
    proc, logged, entries = launch(tmp_path, form)
    assert [e["epoch"] for e in entries] == [0, 1], proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("sharddemo:")]
    assert len(lines) == 2
    for epoch, entry in enumerate(entries):
        ids = logged[0][epoch] + logged[1][epoch]  # what the two loops received
        assert (entry["seen"], entry["unique"]) == (len(ids), len(set(ids)))
        assert entry["steps"] == [len(logged[0][epoch]) // 4, len(logged[1][epoch]) // 4]
        assert entry["ok"] is True
    assert "was watched, but no pass" not in proc.stderr


def test_a_watch_the_loop_never_reaches_says_so_once(tmp_path):
    """accelerator.prepare_data_loader(watch(...)): the method is looked up before watch()
    runs, and the loader it makes is not the watched one; the main process says so at exit,
    once (the loop's batches still reach it: the run itself is untouched)."""
    proc, logged, entries = launch(tmp_path, "inside-prepare-data-loader")
    assert entries == []
    assert [len(epoch) for epoch in logged[0]] == [20, 20]  # 40 ids over 2 ranks, each epoch
    assert proc.stderr.count("'train' was watched, but no pass of it reached the loop") == 1
