"""`sharddemo check` as docs/watch.md shows it: the pytest there, its watched loop on 2
real ranks, gated by `sharddemo check`; which epochs fail comes from the pitfall the example
plants. The gate's own cases in one process: tests/unit/test_check.py."""

from __future__ import annotations


import pytest
from click.testing import CliRunner
from support.launch import accelerate_launch, ended_or_aborted_at_teardown

from sharddemo.cli import cli


def invoke(args):
    return CliRunner().invoke(cli, args)


@pytest.mark.parametrize("pitfall,code", [("none", 0), ("replicated", 1)])
def test_the_gate_of_docs_watch_md(tmp_path, pitfall, code):
    """docs/watch.md's pytest: train a few steps on 2 ranks (examples/watch_accelerate.py: 2
    epochs of 5 steps), then gate on the report. A prepared loader passes; the replicated
    pitfall (not prepared, no sampler: every rank walks all 40) fails the gate."""
    report = tmp_path / "watch.jsonl"
    proc = accelerate_launch(["examples/watch_accelerate.py", "--pitfall", pitfall,
                              "--report", str(report)], check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    gate = invoke(["check", str(report)])
    assert gate.exit_code == code, gate.output
    if code:
        assert all("no-silent-replication" in line for line in gate.stdout.splitlines())
        assert len(gate.stdout.splitlines()) == 2  # both epochs
