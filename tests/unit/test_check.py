"""`sharddemo check REPORT.jsonl`, the CI gate over a watch report, in one process: exit 0
when every entry held, 1 with each failed entry printed, 2 with one `Error:` line for a file
that is not a watch report. The reports are written by real watched loops in this process;
which epochs fail is worked out by hand from the loader (a sampler that deals 0, 1, 2 twice and
3, 4, 5 never). The gate on the pytest that docs/watch.md shows, on 2 ranks:
tests/ranks/test_check.py."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader, TensorDataset

from sharddemo import watch
from sharddemo.cli import cli


def invoke(args):
    return CliRunner().invoke(cli, args)


class Twice(torch.utils.data.Sampler):
    """0, 1, 2 twice and 3, 4, 5 never: no-missing-samples fails (by hand)."""

    def __iter__(self):
        return iter([0, 1, 2, 0, 1, 2])

    def __len__(self):
        return 6


def watched_report(path, *, failing: bool) -> None:
    """Two epochs of a 6-sample loader, appended to `path` by the watch itself."""
    data = TensorDataset(torch.arange(6))
    loader = watch(DataLoader(data, batch_size=3, sampler=Twice() if failing else None),
                   report=str(path), name="bad" if failing else "good", on_violation="ignore")
    for _ in range(2):
        list(loader)


def test_a_report_whose_entries_all_held_passes(tmp_path):
    report = tmp_path / "w.jsonl"
    watched_report(report, failing=False)
    result = invoke(["check", str(report)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"sharddemo check: {report}: every entry held (2 entries)\n"
    assert result.stderr == ""


def test_a_failed_entry_is_printed_and_exits_1(tmp_path):
    report = tmp_path / "w.jsonl"
    watched_report(report, failing=False)
    watched_report(report, failing=True)  # both epochs fail: 3, 4, 5 never (by hand)
    result = invoke(["check", str(report)])
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    run = json.loads(report.read_text().splitlines()[-1])["run_id"]
    for epoch, line in enumerate(lines):
        assert line.startswith(f"FAIL bad epoch {epoch}, run {run} started ")
        assert "no-missing-samples" in line
    assert result.stderr == f"Error: 2 of 4 entries of {report} failed\n"


def test_a_last_line_cut_by_a_crash_is_skipped_with_a_warning(tmp_path):
    report = tmp_path / "w.jsonl"
    watched_report(report, failing=False)
    whole = report.read_text()
    last = whole.splitlines()[-1]
    report.write_text(whole + last[: len(last) // 2])  # a third entry, half written
    result = invoke(["check", str(report)])
    assert result.exit_code == 0, result.output
    assert result.stderr == (f"Warning: {report} line 3 is cut short (the run stopped while it "
                             "was written): skipped\n")
    assert "every entry held (2 entries)" in result.stdout


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    ("", "is not a watch report: it holds no entry"),
    ("epoch 0: ok\n", "is not a watch report: line 1 is not JSON (Expecting value, column 1)"),
    # a report of `compare --format json`: one object over many lines
    ('{\n  "schema": "sharddemo.report/1"\n}\n', "is not a watch report: line 1 is not JSON"),
    ('{"schema": "sharddemo.report/1", "ok": true, "verdicts": []}\n',
     "is not a watch report: line 1 is not a watch entry (schema 'sharddemo.report/1'"),
    ('[1, 2]\n', "is not a watch report: line 1 is a JSON list, not an object"),
    ('{"schema": "sharddemo.watch/1"}\n', "line 1 is not a watch entry (no ok or verdicts)"),
    # a line cut short in the middle of the file is not a crash's last line
    ('{"schema": "sharddemo.wa\n{"schema": "sharddemo.watch/1", "ok": true, "verdicts": []}\n',
     "is not a watch report: line 1 is not JSON"),
])
def test_a_file_that_is_not_a_watch_report_is_one_error_line(tmp_path, content, message):
    report = tmp_path / "w.jsonl"
    if content is not None:
        report.write_text(content)
    result = invoke(["check", str(report)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {report}"), result.output
    assert message in lines[0]


def test_a_folder_is_refused(tmp_path):
    result = invoke(["check", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output == f"Error: {tmp_path} is a folder: give the watch's report file (a .jsonl)\n"


def test_a_failed_window_is_named_by_its_steps_not_printed_as_json(tmp_path):
    """A window (a check within the epoch, on several ranks) that failed is named by its steps
    in words: the trial saw `window {"first_step": 0, ...}` printed as a raw JSON object. The
    entry is a window's as docs/watch.md gives it, written by hand."""
    report = tmp_path / "w.jsonl"
    entry = {"schema": "sharddemo.watch/1", "loader": "train", "epoch": 1, "ok": False,
             "run_id": "0123456789ab", "run_started": "2026-12-05T20:00:00+00:00",
             "window": {"first_step": 51, "last_step": 150, "checked_at": 152},
             "verdicts": [{"verdict": "no-silent-replication", "epoch": 1, "ok": False,
                           "detail": "3 samples on 2 ranks"}]}
    report.write_text(json.dumps(entry) + "\n")
    result = invoke(["check", str(report)])
    assert result.exit_code == 1
    assert result.stdout == ("FAIL train epoch 1 steps 51-150 (checked at step 152), run "
                             "0123456789ab started 2026-12-05T20:00:00+00:00: "
                             "no-silent-replication: 3 samples on 2 ranks\n")
