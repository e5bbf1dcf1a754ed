"""Pictures and progress without a launch: a large N is binned and marks missing samples, the
PNG without matplotlib is one clear error, and the progress bar follows the main rank's lines.
The PNG, the terminal grid and the bar of a real launch: tests/ranks/test_plot.py."""

from __future__ import annotations

import struct
import sys

from click.testing import CliRunner

from sharddemo.cli import cli
from sharddemo.plot import HEADER_PX, PANEL_PX, WIDTH_PX, plot_report


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


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


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = CliRunner().invoke(cli, ["compare", "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert result.output.strip() == ("Error: --plot needs matplotlib, which is not installed; "
                                     "install the extra: pip install 'sharddemo[plot]' (from a "
                                     "checkout: pip install -e '.[plot]')")


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
