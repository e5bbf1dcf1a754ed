"""A watch report (docs/watch.md) read as a gate for CI, for `sharddemo check REPORT.jsonl`
(commands/check.py) and for a gate of your own. No torch: it reads the JSON lines that
`sharddemo.watch` appended and says which entries failed.

    result = check_report("sharddemo-watch.jsonl")
    result.failed     # the entries whose "ok" is false, in the file's order
    result.warnings   # e.g. a last line cut short by a crash: skipped

The command prints each failed entry's line and exits 1 when any entry failed, 0 when every
entry held, and 2 (one `Error:` line, a UsageError) for a file that is not a watch report: a
path that does not exist or is a folder, an empty file, a line that is not JSON (other than a
last line cut short, which a crash while the main process appended it leaves: skipped with a
warning), or a line that is not a watch entry (another schema, or without `ok` and
`verdicts`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from sharddemo.errors import UsageError

SCHEMA_PREFIX = "sharddemo.watch/"  # (sharddemo.analysis.entry.WATCH_SCHEMA: /1 today)


@dataclass
class CheckResult:
    """What one watch report holds: its entries, the failed ones, and what was skipped."""

    path: str
    entries: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed


def check_report(path: str) -> CheckResult:
    """Read the watch report at `path`; UsageError (exit 2) where it is not one."""
    if not os.path.exists(path):
        raise UsageError(f"{path} does not exist: give the report a watched run wrote "
                         "(watch(..., report=...); default sharddemo-watch.jsonl)")
    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder: give the watch's report file (a .jsonl)")
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"{path} is not a watch report: it is not UTF-8 text (byte "
                         f"{error.start})") from None
    result = CheckResult(path)
    lines = text.split("\n")
    cut = not text.endswith("\n")  # the last line was not finished
    numbered = [(k + 1, line) for k, line in enumerate(lines) if line.strip()]
    for position, (number, line) in enumerate(numbered):
        last = position == len(numbered) - 1
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            if last and cut and line.lstrip().startswith("{"):
                result.warnings.append(f"{path} line {number} is cut short (the run stopped "
                                       "while it was written): skipped")
                continue
            raise UsageError(f"{path} is not a watch report: line {number} is not JSON "
                             f"({error.msg}, column {error.colno})") from None
        problem = not_an_entry(entry)
        if problem:
            raise UsageError(f"{path} is not a watch report: line {number} {problem}")
        result.entries.append(entry)
        if not entry["ok"]:
            result.failed.append(entry)
    if not result.entries:
        raise UsageError(f"{path} is not a watch report: it holds no entry (a watched run "
                         "appends one per loader and epoch)")
    return result


def not_an_entry(entry) -> str:
    """Why a parsed line is not a watch entry ('' where it is one)."""
    if not isinstance(entry, dict):
        return f"is a JSON {type(entry).__name__}, not an object"
    schema = entry.get("schema")
    if not isinstance(schema, str) or not schema.startswith(SCHEMA_PREFIX):
        return f"is not a watch entry (schema {schema!r}, not {SCHEMA_PREFIX}...)"
    if not isinstance(entry.get("ok"), bool) or not isinstance(entry.get("verdicts"), list):
        return "is not a watch entry (no ok or verdicts)"
    return ""


def entry_line(entry: dict) -> str:
    """A failed entry in one line: which run, loader and epoch, and each failed verdict."""
    where = f"{entry.get('loader', '?')} epoch {entry.get('epoch', '?')}"
    if entry.get("partial"):
        where += " (partial)"
    window = entry.get("window")
    if isinstance(window, dict):  # a check within the epoch: its steps
        where += (f" steps {window.get('first_step', '?')}-{window.get('last_step', '?')} "
                  f"(checked at step {window.get('checked_at', '?')})")
    run = entry.get("run_id")
    if run:
        where += f", run {run} started {entry.get('run_started', '?')}"
    failed = [v for v in entry["verdicts"] if isinstance(v, dict) and not v.get("ok", True)]
    said = "; ".join(f"{v.get('verdict', '?')}: {v.get('detail', '')}".rstrip(": ")
                     for v in failed)
    return f"FAIL {where}: {said or 'not ok'}"
