"""What a watched run leaves, read back as the tests read it: the report's entries, each
validated against docs/watch.schema.json, the checks the resume tests share, and the lineage
through `sharddemo lineage` run in this process."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from support.launch import ROOT

from sharddemo.cli import cli

WATCH_SCHEMA = json.loads((ROOT / "docs" / "watch.schema.json").read_text())


def entries(path) -> list[dict]:
    """The report file's lines, each validated against docs/watch.schema.json."""
    import jsonschema

    out = [json.loads(line) for line in path.read_text().splitlines()]
    for entry in out:
        jsonschema.validate(entry, WATCH_SCHEMA)
    return out


def whole_train_epochs(report) -> list[dict]:
    """The report's entries of whole train epochs (no eval, no partial part)."""
    return [e for e in entries(report) if e["loader"] == "train" and not e.get("partial")]


def said_unknown_before(report, output: str, missing: str) -> None:
    """A 2-epoch run (N = 40, 2 ranks, 5 steps an epoch) stopped at step 3 with a checkpoint
    that lacks the watch's state (`missing`), then resumed: epoch 0's part after the restart,
    16 samples in 2 steps a rank, judged with what came before unknown; epoch 1 whole."""
    train = whole_train_epochs(report)
    assert [e["epoch"] for e in train] == [0, 1]
    resumed = train[0]
    assert resumed["resume"]["unknown_before"] and resumed["missing"] is None
    assert resumed["seen"] == 16 and resumed["steps"] == [2, 2] and resumed["ok"]
    assert f"holds no {missing}" in output
    assert train[1]["ok"] and train[1]["seen"] == 40


def lineage_cli(*args: str):
    """The command as a user runs it: outside a rank (the CLI treats a process with RANK and
    WORLD_SIZE set, which the simulated ranks here set, as one of a launch's ranks)."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("RANK", raising=False)
        env.delenv("WORLD_SIZE", raising=False)
        return CliRunner().invoke(cli, ["lineage", *map(str, args)])


def cli_json(*args: str) -> dict:
    result = lineage_cli(*args, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def entry(run, tag: str, case: str, epoch: int, partial: bool = False) -> dict:
    """The report's entry for the epoch, with the line the main process printed for it.

    `run`: a launched loop's {"entries": {tag: [entry, ...]}, "lines": {tag: [line, ...]}}."""
    found = [e for e in run["entries"][tag] if e["loader"] == case and e["epoch"] == epoch
             and bool(e.get("partial")) == partial]
    assert len(found) == 1, (tag, case, epoch, run["entries"][tag])
    head = f"sharddemo: epoch {epoch} {case}{' (partial)' if partial else ''}:"
    said = [line for line in run["lines"][tag] if line.startswith(head)]
    assert len(said) == 1, (head, run["lines"][tag])
    return {**found[0], "line": said[0]}


def launch_cases(loop: str, out, launches, env=None) -> dict:
    """The launches of a loop that runs several cases a launch (tests/scripts/loader_state_loop.py,
    stream_state_loop.py, litdata_loop.py): `launches` (tag, ranks, cases), each `torchrun LOOP
    OUT TAG CASES...`; what they left: each rank's logged ids (`OUT/ids.TAG.R.json`), the report's
    entries (validated), the `sharddemo:` lines and the stderr, by tag."""
    from support.launch import torchrun

    run: dict = {"logs": {}, "entries": {}, "lines": {}, "stderr": {}, "out": out}
    for tag, nproc, cases in launches:
        proc = torchrun([loop, out, tag, *cases], nproc=nproc, timeout=180, env=env)
        run["lines"][tag] = [line for line in proc.stdout.splitlines()
                             if line.startswith("sharddemo:")]
        run["stderr"][tag] = proc.stderr
        run["logs"][tag] = [json.loads((out / f"ids.{tag}.{r}.json").read_text())
                            for r in range(nproc)]
        run["entries"][tag] = entries(out / f"report.{tag}.jsonl")
    return run


def received(run: dict, tags: str, case: str, rank: int) -> dict[int, list[int]]:
    """Each epoch's ids rank `rank` received in `case` (launch_cases' logs), over the launches
    `tags` (one letter each), in order; a launch without that rank adds nothing."""
    out: dict[int, list[int]] = {}
    for tag in tags:
        if rank >= len(run["logs"][tag]):
            continue
        for p in run["logs"][tag][rank].get(case, {"passes": []})["passes"]:
            out.setdefault(p["epoch"], []).extend(i for b in p["batches"] for i in b)
    return out
