"""`sharddemo check REPORT.jsonl`: the watch report read (sharddemo.check), each failed entry
printed in one line, and the exit code: 0 when every entry held, 1 when any failed."""

from __future__ import annotations

import click

from sharddemo.check import CheckResult, check_report, entry_line
from sharddemo.commands.output import error


def check_command(report: str) -> int:
    """`sharddemo check` from the command line: the warnings, the failed entries, the summary."""
    result = check_report(report)
    for warning in result.warnings:
        click.echo(f"Warning: {warning}", err=True)
    for entry in result.failed:
        click.echo(entry_line(entry))
    if result.failed:
        error(summary(result))
        return 1
    click.echo(summary(result))
    return 0


def summary(result: CheckResult) -> str:
    """The last line: every entry held, or how many of how many failed."""
    total = len(result.entries)
    if result.ok:
        return (f"sharddemo check: {result.path}: every entry held ({total} "
                f"{'entry' if total == 1 else 'entries'})")
    return (f"{len(result.failed)} of {total} {'entry' if total == 1 else 'entries'} of "
            f"{result.path} failed")
