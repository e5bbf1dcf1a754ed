"""A guard for combinations through the CLI: combinations that cannot work are refused with
one line before any rank starts, and a sampled subset of crossed features runs on real ranks,
its batches checked against the libraries' own objects (tests/support/oracle.py). The
combinations drawn in one process: tests/unit/test_combinations.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
from support.launch import SCHEMA, sharddemo


# -- the CLI: refusals before any rank starts -------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (["compare", "--modes", "resume", "--dataset-size", "16", "--plot", "{png}"],
     "mode resume reports its scenarios as rows"),
    (["compare", "--modes", "sampler", "--gather", "count", "--plot", "{png}"],
     "--plot draws every id"),
    (["compare", "--dataset-size", "1000000", "--plot", "{png}"], "--plot draws every id"),
    (["audit", "examples/resume_exact.py:make_loader", "--gather", "count", "--plot", "{png}"],
     "--plot draws every id"),
    (["audit", "examples/resume_exact.py:make_loader", "--dataset-size", "2000000",
      "--plot", "{png}"], "--plot draws every id"),
    (["audit", "examples/resume_exact.py:make_loader", "--resume-at", "0:3", "--gather",
      "count"], "--resume-at compares every id"),
])
def test_combinations_that_cannot_work_are_refused_before_any_rank(tmp_path, args, words):
    png = tmp_path / "x.png"
    proc = sharddemo([a.replace("{png}", str(png)) for a in args], check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not png.exists()
    assert "rerun by hand" not in proc.stdout.lower()  # no launch happened


# -- a sampled subset on real ranks ----------------------------------------------------------

REAL = [
    # (command line, world size): each crosses a feature with another, as users do
    (["compare", "--modes", "sampler", "--gather", "count", "--format", "markdown"], 2),
    (["compare", "--modes", "prepared,replicated", "--dataset-size", "7", "--batch-size", "2",
      "--drop-last", "--gather", "epoch", "--format", "json", "--plot", "{png}"], 3),
    (["compare", "--modes", "resume", "--dataset-size", "16", "--format", "markdown"], 2),
    (["audit", "examples/resume_exact.py:make_loader", "--epochs", "2", "--resume-at", "0:3",
      "--format", "markdown", "--plot", "{png}"], 2),
    (["audit", "examples/resume_exact.py:make_loader", "--gather", "count", "--format", "json"],
     3),
]


@pytest.mark.parametrize("args,world", REAL, ids=[" ".join(a[:3]) + f" W{w}" for a, w in REAL])
def test_crossed_features_on_real_ranks(tmp_path, args, world):
    png = tmp_path / "x.png"
    argv = [a.replace("{png}", str(png)) for a in args] + ["--num-processes", str(world)]
    proc = sharddemo(argv, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    out = proc.stdout
    if "json" in args:
        report = json.loads(out)
        jsonschema.validate(report, SCHEMA)
        assert report["world_size"] == world
        for data in report["modes"].values():
            assert data["epochs"], data
    if "markdown" in args:
        assert out.startswith("# sharddemo")
        if "resume" in args and "compare" in args:
            assert out.count("resume-exact") == 12  # resume.demo_scenarios: 12 rows
        for k in range(2):
            assert f"epoch {k}" in out
    if "--plot" in args:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
