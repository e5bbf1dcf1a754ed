"""The parent side of each command: one module per command's orchestration (compare,
audit, resume). Each parses nothing (cli.py does), starts the launches (launch.py), turns
traces into reports (sharddemo.analysis) and hands them back to the CLI to render."""

from __future__ import annotations

from typing import Optional

from sharddemo.analysis import build_report
from sharddemo.launch import Launch
from sharddemo.options import RunOptions, command_line


def report_of(launch: Launch, trace: Optional[dict], keys: Optional[dict] = None,
              key_field: Optional[str] = None) -> dict:
    """The trace -> the report; {} on a node whose machine rank 0 reports instead. `keys`:
    the names of a trace whose samples are keys (analysis.keys.number_keys)."""
    if not trace:
        return {}
    return build_report(trace, launch_command=launch.display(), config_file=launch.config_file,
                        keys=keys, key_field=key_field)


def run_args(opts: RunOptions) -> list[str]:
    """`sharddemo run`'s flags for these options, as a person would type them."""
    return ["--modes", ",".join(opts.modes), *command_line(opts)]
