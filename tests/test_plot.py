"""Pictures, the terminal grid and progress: the PNG is a valid image of the documented size
and draws what the report says; the grid marks each sample's rank."""

from __future__ import annotations

import json
import struct
import sys

import pytest
from click.testing import CliRunner
from conftest import sharddemo

from sharddemo.cli import cli
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


def test_large_n_is_binned_and_marks_missing_samples(tmp_path):
    n = 100_000
    ranks = [{"rank": 0, "batches": [list(range(0, 50_000))]},
             {"rank": 1, "batches": [list(range(50_000, 99_000))]}]
    trace = {"world_size": 2, "backend": "gloo", "dataset_size": n, "batch_size": 50_000,
             "epochs": 1, "seed": 0, "modes": {"sampler": {"epochs": [
                 {"epoch": 0, "ranks": ranks, "gathered": None, "gather": "epoch",
                  "gathered_count": 99_000}]}}}
    from sharddemo.analysis import build_report

    report = build_report(trace)
    drawn = plot_report(report, str(tmp_path / "big.png"))
    assert drawn["sampler"][0] == {"epoch": 0, "placed": {0: 50_000, 1: 49_000},
                                   "missing": 1_000, "duplicated": 0}
    assert png_size(tmp_path / "big.png") == (WIDTH_PX, HEADER_PX + PANEL_PX)


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


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = CliRunner().invoke(cli, ["compare", "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert result.output.strip() == ("Error: --plot needs matplotlib, which is not installed; "
                                     "install the extra: pip install 'sharddemo[plot]' (from a "
                                     "checkout: pip install -e '.[plot]')")


def test_no_progress_when_output_is_not_a_terminal(small_report):
    proc, _, _ = small_report
    assert "sharddemo-progress" not in proc.stdout + proc.stderr
    assert "step/s" not in proc.stderr and "it/s" not in proc.stderr


def test_progress_comes_from_the_main_rank_only(monkeypatch):
    from types import SimpleNamespace

    from sharddemo.rank.walk import progress_reporter

    monkeypatch.setenv("SHARDDEMO_PROGRESS", "1")
    assert progress_reporter(SimpleNamespace(is_main_process=False), "x") is None
    assert progress_reporter(SimpleNamespace(is_main_process=True), "x") is not None
    monkeypatch.delenv("SHARDDEMO_PROGRESS")
    assert progress_reporter(SimpleNamespace(is_main_process=True), "x") is None


def test_progress_bar_follows_the_main_ranks_lines(tmp_path):
    from sharddemo.launch import ProgressBar

    log = tmp_path / "stdout.log"
    log.write_text("sharddemo-progress sampler:epoch0 10 100\nsharddemo-progress sampler:epoch0 40 100\n")
    bar = ProgressBar(str(log), delay=0)
    bar.update()
    assert bar.label == "sampler:epoch0" and bar.bar.n == 40 and bar.bar.total == 100
    with open(log, "a") as handle:
        handle.write("sharddemo-progress replicated:epoch0 5 ? 1280 all\n")
    bar.update()
    assert bar.label == "replicated:epoch0" and bar.bar.n == 5 and bar.bar.total is None
    assert bar.bar.postfix == "1,280 samples"  # the label's first line: no rate yet
    with open(log, "a") as handle:
        handle.write("sharddemo-progress replicated:epoch0 6 ? 1536 rank0\n")
    bar.update()
    assert bar.bar.postfix.startswith("1,536 samples on rank 0")
    bar.close()


def test_a_100_column_bar_keeps_the_samples_and_their_rate(tmp_path, monkeypatch):
    """tqdm cuts a line wider than the terminal: at 10^8 samples, B = 4096, on 100 columns the
    line still ends with the samples' rate (tqdm's own step rate would have pushed it off)."""
    import io
    import time

    from sharddemo.launch import ProgressBar

    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("LINES", "20")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    log = tmp_path / "stdout.log"
    # the main rank's first step, then 0.6 s later 50,000,000 samples: 12,000 of its 12,207
    # steps x 4096 (10^8 / 2 ranks, rounded up)
    log.write_text("sharddemo-progress prepared:epoch0 1 12207 4096 rank0\n")
    bar = ProgressBar(str(log), delay=0)
    bar.update()
    assert bar.bar.postfix == "4,096 samples on rank 0"  # no rate yet: nothing to measure it on
    time.sleep(0.6)
    with open(log, "a") as handle:
        handle.write("sharddemo-progress prepared:epoch0 12000 12207 50000000 rank0\n")
    bar.update()
    line = err.getvalue().split("\r")[-1].replace("\x1b[A", "")  # less tqdm's cursor-up
    bar.close()
    assert len(line.rstrip()) <= 100
    assert "12000/12207" in line and "50,000,000 samples on rank 0, " in line
    assert line.rstrip().endswith("/s]")
    # the rate is over the time between the two lines (0.6 s and a little more), not since
    # the bar appeared: at most (50,000,000 - 4,096) / 0.6 = 83,326,507 a second
    rate = int(line.rsplit(", ", 1)[1].split("/s")[0].replace(",", ""))
    assert (50_000_000 - 4_096) / 2.0 < rate <= 83_326_507


def test_one_progress_bar_on_a_terminal():
    """On a (pseudo-)terminal a long run shows one bar, fed by the main rank."""
    import os
    import pty
    import select
    import subprocess
    import time

    from conftest import ROOT, launch_env

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
