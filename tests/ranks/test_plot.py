"""Pictures, the terminal grid and progress of a real launch: the PNG is a valid image of the
documented size and draws what the report says; the grid marks each sample's rank; one
progress bar on a terminal, none where the output is not one."""

from __future__ import annotations

import json
import struct
import sys

import pytest
from support.launch import sharddemo

from sharddemo.plot import HEADER_PX, PANEL_PX, WIDTH_PX, plot_report


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plot")
    png, out = tmp / "split.png", tmp / "report.json"
    proc = sharddemo(["compare", "--dataset-size", "10", "--batch-size", "3", "--plot", str(png),
                      "--output", str(out)])
    return proc, png, json.loads(out.read_text())


def test_compare_writes_a_png_of_the_documented_size(small_report):
    _, png, report = small_report
    assert png_size(png) == (WIDTH_PX, HEADER_PX + PANEL_PX * len(report["modes"]))


def test_the_picture_draws_the_report(small_report, tmp_path):
    _, _, report = small_report
    drawn = plot_report(report, str(tmp_path / "again.png"))
    for mode, data in report["modes"].items():
        for shown, e in zip(drawn[mode], data["epochs"]):
            assert shown["placed"] == {r["rank"]: r["samples"] for r in e["ranks"]}
            assert shown["missing"] == len(e["missing"])
            assert shown["duplicated"] == len(e["duplicates"])
    # N = 10, B = 3 on 2 ranks: the even-batches fill repeats 2 samples; replication all 10.
    assert drawn["prepared"][0]["duplicated"] == 2 and drawn["replicated"][0]["duplicated"] == 10


def test_terminal_grid_shows_the_split(small_report):
    from sharddemo.render import render

    _, _, report = small_report
    out = render(report, "table")  # what compare prints without --output
    assert "ids    0123456789" in out
    grids = [line.split()[1] for line in out.splitlines() if line.strip().startswith("rank   ")]
    assert len(grids) == 6  # 3 modes x 2 epochs
    prepared, sampler, replicated = grids[0], grids[2], grids[4]
    assert set(replicated) == {"+"}
    assert set(sampler) <= {"0", "1", "+"} and "-" not in sampler
    assert prepared.count("+") == 2  # the two samples the even-batches fill repeats


def test_no_progress_when_output_is_not_a_terminal(small_report):
    proc, _, _ = small_report
    assert "sharddemo-progress" not in proc.stdout + proc.stderr
    assert "step/s" not in proc.stderr and "it/s" not in proc.stderr


def test_one_progress_bar_on_a_terminal():
    """On a (pseudo-)terminal a long run shows one bar, fed by the main rank."""
    import os
    import pty
    import select
    import subprocess
    import time

    from support.launch import ROOT, launch_env

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "sharddemo", "compare", "--dataset-size",
                             "4000000", "--modes", "sampler", "--epochs", "1", "--batch-size",
                             "64"], stdout=subprocess.DEVNULL, stderr=slave,
                            stdin=subprocess.DEVNULL, cwd=ROOT, env=launch_env())
    os.close(slave)
    data, deadline = b"", time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    assert proc.returncode == 0
    frames = [f for f in data.decode("utf-8", "replace").replace("\r", "\n").splitlines()
              if "%|" in f]
    assert frames, "no progress bar was drawn"
    assert {f.split(":")[0] + ":" + f.split(":")[1] for f in frames} == {"sampler:epoch0"}
    assert all("/31250" in f for f in frames)  # 4,000,000 / 2 ranks / 64: the main rank's steps
    # 4,000,000 samples: the count path, which counts the main rank's samples (64 a step)
    assert any("samples on rank 0" in f for f in frames)
