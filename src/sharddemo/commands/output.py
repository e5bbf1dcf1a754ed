"""What a command writes for the person who ran it: the report printed (or written to
--output, with --plot's picture, and a summary printed), the files refused before any rank
starts where they could not be written, the large-report warning, the progress bar's switch,
and the one `Error:` line."""

from __future__ import annotations

import sys
from typing import Callable, Optional

import click

from sharddemo.errors import UsageError


def error(message: str) -> None:
    """The one `Error: ...` line on stderr (the CLI's error policy, and a command that fails
    after printing its report)."""
    click.echo(f"Error: {message}", err=True)


def validate_output(path: str, flag: str) -> None:
    """Refuse now, before any rank starts, a `flag` file that could not be written later."""
    from sharddemo.fileio import validate_writable

    try:
        validate_writable(path)
    except OSError as exc:
        raise UsageError(f"{flag} {path} cannot be written ({exc}); pick another path") from None


def validate_files(output: Optional[str], plot: Optional[str]) -> None:
    """Refuse now, before any rank starts, what could not be written later."""
    if output:
        validate_output(output, "--output")
    if plot:
        validate_output(plot, "--plot")
        from sharddemo.plot import validate_plot_available

        validate_plot_available()


def show(result: dict, fmt: str, output: Optional[str], plot: Optional[str] = None) -> bool:
    """Write the report (and the picture), then print it; False when another machine does.

    With --output the file is written first, whole or not at all, and a summary in `fmt`
    is printed in place of the report: a report can be hundreds of MB (every id of every
    batch), which a terminal takes longer to print than the ranks took to walk, and a
    stdout that fails (a closed pipe) must not cost the file."""
    if not result:
        click.echo("This node ran its ranks; machine rank 0 prints and writes the report.")
        return False
    from sharddemo.render import render, render_summary, write_report

    size = write_report(result, output) if output else None
    if plot:
        from sharddemo.plot import plot_report

        plot_report(result, plot)
    if output and size is not None:
        click.echo(render_summary(result, fmt, output, size), nl=False)
    else:
        click.echo(render(result, fmt), nl=False)
    return True


def large_report_notice(what: Callable[[int], str], fmt: str, output: Optional[str],
                can_count: bool) -> Callable[[int, int], None]:
    """What a command calls before its launch with the JSON report's estimated size and the
    world size: one `Warning:` line on stderr where that report, printed or written to
    --output, will be large (reportsize.size_warning), so that nobody waits on it unawares."""

    def notice(size: int, world: int) -> None:
        from sharddemo.reportsize import size_warning

        line = size_warning(size, what=what(world), output=output, fmt=fmt, can_count=can_count)
        if line:
            click.echo(f"Warning: {line}", err=True)

    return notice


def wants_progress(fmt: str) -> bool:
    """A progress bar only for people: a terminal, and not the JSON format."""
    return fmt != "json" and sys.stderr.isatty()
