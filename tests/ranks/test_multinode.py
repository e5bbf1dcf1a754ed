"""Two "machines" on this one machine over loopback: two `sharddemo compare` processes with
--num-machines 2 and machine ranks 0 and 1, 2 CPU ranks each (world size 4)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.launch import OUTER_TIMEOUT, ROOT, launch_env

from sharddemo.launch import free_port


def test_two_nodes_over_loopback(tmp_path):
    port = free_port()
    out = tmp_path / "report.json"
    common = ["--num-processes", "4", "--num-machines", "2", "--main-process-ip", "127.0.0.1",
              "--main-process-port", str(port), "--dataset-size", "8", "--batch-size", "2",
              "--epochs", "1", "--timeout", "30"]
    procs = [subprocess.Popen([sys.executable, "-m", "sharddemo", "compare", "--machine-rank",
                               str(rank), *common, *(["--output", str(out)] if rank == 0 else [])],
                              cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
             for rank in (1, 0)]
    results = []
    for proc in procs:
        try:
            results.append(proc.communicate(timeout=OUTER_TIMEOUT))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("the two-node launch did not finish")
    for proc, (stdout, stderr) in zip(procs, results):
        assert proc.returncode == 0, f"--- stdout\n{stdout}\n--- stderr\n{stderr}"
    assert "machine rank 0 prints and writes the report" in results[0][0]
    report = json.loads(out.read_text())
    assert report["world_size"] == 4 and report["backend"] == "gloo"
    assert report["nodes"] == {"0": [0, 1], "1": [2, 3]}
    assert [(p["rank"], p["local_rank"], p["node"]) for p in report["placement"]] == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    for mode, times in (("prepared", 1), ("sampler", 1), ("replicated", 4)):
        e = report["modes"][mode]["epochs"][0]
        assert e["seen"] == 8 * times and e["missing"] == [], mode
        assert e["by_node"] == {"0": 4 * times, "1": 4 * times}, mode
    assert "ranks by node: node 0" in results[1][0]
