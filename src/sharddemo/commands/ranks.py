"""The commands a launched rank runs, and the parent's one door to the rank side.

`run` (the Accelerate script) and the hidden rank commands that `compare` and `audit` start
through accelerate launch (`audit-rank`, `resume-rank`, `resume-demo-rank`: each reads its
options from the one JSON file the launch wrote, options.read_rank_options), a failing rank's
word to its launcher, and the question `--version` asks torch. Every import of rank/ here is
inside a function, and no other module of the parent imports rank/ or the watch
(tests/unit/test_layout.py, LAZY_DOORS): --help and every refusal answer without torch."""

from __future__ import annotations

from typing import Callable, Optional

import click

from sharddemo.commands.output import validate_output
from sharddemo.errors import UsageError
from sharddemo.options import RunOptions, read_rank_options


def run_command(options_file: Optional[str], flag_options: Callable[[], RunOptions],
                device: str, trace_out: Optional[str], quiet: bool) -> None:
    """`sharddemo run` on this rank: each mode's loader walked (rank.run.run_trace) with the
    options of the options file a launch of `compare` or `trap` wrote, else those of the
    flags (`flag_options`, built and checked only then: with a file the flags do not apply)."""
    allow_alone = False
    if options_file:
        given = read_rank_options(options_file)
        opts, allow_alone = given["run"], bool(given.get("allow_alone"))
    else:
        opts = flag_options()
    if "resume" in opts.modes:
        raise UsageError("mode resume stops and restarts launches, which only compare can do: "
                         "sharddemo compare --modes resume --dataset-size 40")
    if trace_out:
        validate_output(trace_out, "--trace-out")
    from sharddemo.rank.run import run_trace

    run_trace(opts, device=device, trace_out=trace_out, allow_alone=allow_alone,
              say=None if quiet else (lambda line: click.echo(line)))


def resume_demo_rank_command(options_file: str, device: str, trace_out: Optional[str]) -> None:
    """The rank side of `sharddemo compare --modes resume` (phase, checkpoint, the run's
    options: from the options file)."""
    from sharddemo.rank.resume import demo_rank

    given = read_rank_options(options_file)
    demo_rank(given["run"], given["phase"], given["checkpoint"], device=device,
              trace_out=trace_out, stateful=given["stateful"])


def resume_rank_command(options_file: str, device: str, trace_out: Optional[str]) -> None:
    """The rank side of `sharddemo audit --resume-at`: one launch of the chain, from the start
    to the first stop, or from a saved stop to the next stop or the end."""
    from sharddemo.rank.resume import resume_rank

    given = read_rank_options(options_file)
    resume_rank(given["audit"], given["plan"], given["phase"], given["checkpoint"],
                index=given.get("launch", 0), resume_from=given.get("resume_from"),
                final_epoch=given.get("final_epoch"), device=device, trace_out=trace_out)


def audit_rank_command(options_file: str, device: str, trace_out: Optional[str]) -> None:
    """The rank side of `sharddemo audit`: the user's factory called and walked."""
    from sharddemo.rank.audit import audit_rank

    audit_rank(read_rank_options(options_file)["audit"], device=device, trace_out=trace_out)


def report_rank_failure(message: str, exc: BaseException, usage: bool = False) -> None:
    """A failing rank says so before it exits, in its status file (rank.session.rank_fail):
    the launcher stops the others as soon as one exits, so a rank that waited for another to
    speak could be killed with nothing said. `compare` groups ranks with the same message."""
    from sharddemo.rank.session import failure_kind, rank_fail

    rank_fail(message, failure_kind(exc, usage=usage))


def distributed_here() -> tuple[str, str]:
    """(torch's version, what a launch here would use), for `sharddemo --version`."""
    from sharddemo.rank.session import distributed_here as ask_torch

    return ask_torch()
