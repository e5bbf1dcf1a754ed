"""A chain of launches of tests/scripts/resume_chain_loop.py (a watched accelerate loop that
stops and resumes) sharing one report, one folder of logged ids and the checkpoints."""

from __future__ import annotations

import json
import shutil

from support.launch import accelerate_launch, ended_or_aborted_at_teardown

LOOP = "tests/scripts/resume_chain_loop.py"


class Chain:
    """Launches of the loop sharing one report, one folder of logged ids, checkpoints."""

    def __init__(self, tmp_path) -> None:
        self.tmp = tmp_path
        self.ids = tmp_path / "ids"
        self.ids.mkdir()
        self.report = tmp_path / "watch.jsonl"
        self.launches = 0
        self.outputs: list[str] = []

    def launch(self, nproc: int, *args: str) -> None:
        self.launches += 1
        proc = accelerate_launch([LOOP, "--ids", str(self.ids), "--launch", str(self.launches),
                                  "--report", str(self.report), *args], nproc=nproc,
                                 check=False)
        assert ended_or_aborted_at_teardown(proc), proc.stderr
        self.outputs.append(proc.stdout + proc.stderr)

    def copy(self, tmp_path) -> "Chain":
        """This chain's launches so far (their report, logged ids, checkpoints and outputs)
        copied into `tmp_path`, for a test to go on with: a prefix that several tests share
        runs once (the fixtures below)."""
        other = type(self)(tmp_path)
        shutil.copytree(self.tmp, tmp_path, dirs_exist_ok=True)
        other.launches, other.outputs = self.launches, list(self.outputs)
        return other

    def last_batch(self, launch: int, epoch: int, rank: int) -> list[int]:
        """The last batch rank `rank` of `launch` received in `epoch`."""
        got = json.loads((self.ids / f"launch{launch}_rank{rank}.json").read_text())
        return [ids for e, ids in got if e == epoch][-1]

    def received(self, launch: int, epoch: int) -> list[int]:
        """Every id the ranks of `launch` received in `epoch`, all ranks together."""
        out = []
        for path in sorted(self.ids.glob(f"launch{launch}_rank*.json")):
            out += [i for e, ids in json.loads(path.read_text()) if e == epoch for i in ids]
        return out
