"""What the watch says and writes, on the main process: an entry's line (printed, none with
on_violation="ignore") and the entry itself (one JSON object a line, appended to the report
file), each stamped with its run."""

from __future__ import annotations

import datetime
import json
import os
import uuid

RUN: dict = {}


def run_stamp() -> dict:
    """This process's run, in every entry: an id (random, 12 hex digits) and when its first
    watch started (UTC, ISO 8601), so that the lines of two runs appended to one report can be
    told apart. A resumed run is a new launch, with a new id."""
    if not RUN:
        RUN["run_id"] = uuid.uuid4().hex[:12]
        RUN["run_started"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds")
    return dict(RUN)


def publish(entry: dict, on_violation: str, report) -> None:
    """The main process's line (none with on_violation="ignore") and report entry, each
    entry stamped with its run (two runs may append to one file)."""
    entry.update(run_stamp())
    if on_violation != "ignore":
        say(entry["line"])
    if report:
        append_entry(report, entry)


def say(line: str) -> None:
    """The line on the main process's stdout, flushed at once."""
    print(line, flush=True)


def append_entry(path: str, entry: dict) -> None:
    """One JSON object per line, written with one call (a reader never sees half a line)."""
    data = json.dumps({k: v for k, v in entry.items() if k != "line"}) + "\n"
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(data)
        handle.flush()
