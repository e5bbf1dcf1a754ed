"""The refusals that need more than one option: every entry point (the CLI, the command
functions, sharddemo.testing) refuses them with the same line, before any rank starts."""

from __future__ import annotations

import dataclasses
from typing import Optional

from sharddemo.errors import UsageError
from sharddemo.options.audit import AuditOptions
from sharddemo.options.gather import counted, counter_bytes
from sharddemo.options.resume import ResumePlan
from sharddemo.options.run import RunOptions

COUNTED_NO_PLOT = ("--plot draws every id a rank received, and this run was counted (the count "
                   "path keeps no id lists; it is chosen from 1,000,000 samples on): pass "
                   "--gather epoch to draw it")
NO_EPOCHS_TO_PLOT = ("--plot draws each mode's epochs, and mode resume reports its scenarios as "
                     "rows, not epochs: drop --plot (the table, markdown and JSON show every "
                     "scenario)")


def parse_size(text: str, option: str) -> int:
    """'512MB', '2GB', '1.5G', '300' (MB) -> bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", text.upper())
    if not match:
        raise UsageError(f"{option} {text!r} is not a size; write it like 512MB or 2GB")
    value, unit = float(match.group(1)), match.group(2) or "M"
    return int(value * 1024 ** "KMGT".index(unit) * 1024)


def validate_memory(opts: RunOptions, world: Optional[int], limit: int) -> None:
    """One Error line before any rank starts when the ids would not fit in `limit` bytes."""
    n = opts.dataset_size
    is_counted = counted(opts.gather, n)
    if is_counted:
        need = counter_bytes(n, world or 1)
        what, where = f"the count path's counter of {n:,} samples", "per rank"
    else:
        # Replicated modes send every rank's whole epoch: up to W x N ids.
        need = 40 * n * (world or 2)
        what, where = f"every id of an epoch of {n:,} samples (--gather {opts.gather})", "on rank 0"
    if need > limit:
        hint = "" if is_counted else "; --gather count holds 1 byte per sample"
        raise UsageError(f"--max-memory {limit / 2**20:,.0f} MB is less than {what} needs, about "
                         f"{need / 2**20:,.0f} MB {where}: raise --max-memory or lower "
                         f"--dataset-size{hint}")


def refuse_counted_plot(gather: str, n: Optional[int]) -> None:
    """--plot draws every id: refuse, before any rank starts, a run that would be counted."""
    if gather == "count" or counted(gather, n):
        raise UsageError(COUNTED_NO_PLOT)


def validate_compare(opts: RunOptions, *, world: Optional[int] = None, plot: bool = False,
                  max_memory: Optional[str] = None) -> None:
    """What `compare` refuses beyond RunOptions.validate: --max-memory too small, --plot of a
    resume demo or of a counted run."""
    if max_memory is not None:
        validate_memory(opts, world, parse_size(max_memory, "--max-memory"))
    if plot:
        if "resume" in opts.modes:
            raise UsageError(NO_EPOCHS_TO_PLOT)
        refuse_counted_plot(opts.gather, opts.dataset_size)


def validate_audit(opts: AuditOptions, *, plot: bool = False,
                resume: Optional[ResumePlan] = None, keep_checkpoint: Optional[str] = None,
                resume_num_processes: Optional[str] = None) -> AuditOptions:
    """What `audit` refuses beyond AuditOptions.validate; returns the options the launch runs
    with (--plot and --resume-at need every id: `auto` then keeps them at any size)."""
    if plot:
        refuse_counted_plot(opts.gather, opts.dataset_size)
        opts = dataclasses.replace(opts, keep_ids=True)
    if opts.mesh is not None:
        if resume is not None:
            raise UsageError("--resume-at does not run on a mesh yet: leave --mesh (or "
                             "--resume-at) out")
        # the peers' batches are compared id by id: `auto` keeps them at any size
        opts = dataclasses.replace(opts, keep_ids=True)
    if resume is None:
        if resume_num_processes is not None or keep_checkpoint is not None:
            raise UsageError("--resume-num-processes and --keep-checkpoint go with --resume-at "
                             "EPOCH:STEP")
        return opts
    if opts.keys is not None:
        raise UsageError("--keys names the samples of an --id-field of keys, which the resume "
                         "audit does not compare yet; leave --keys (or --resume-at) out")
    if opts.framework is not None:
        # (the resume audit stops and restarts a loop of sharddemo's over the factory's loader;
        # the Trainer and Lightning resume through their own loops and checkpoints, which the
        # watch follows as they run)
        who, callback = {"trainer": ("Trainer", "TrainerWatch"),
                         "lightning": ("Lightning fit", "LightningWatch")}[opts.framework]
        raise UsageError(f"--resume-at audits a make_loader factory; it does not go with "
                         f"--{opts.framework}: to check how your {who} resumes, train with "
                         f"callbacks=[{callback}()], stop and resume from its checkpoint "
                         "(docs/watch.md), or pass a make_loader FACTORY")
    if resume.strategy == "stateful":
        from sharddemo.extras import require

        require("torchdata", "--resume-strategy stateful")
    if opts.gather == "count":
        raise UsageError("--resume-at compares every id of the stopped, the resumed and the "
                         "uninterrupted run, and --gather count keeps none: pass --gather "
                         "epoch (or leave --gather out)")
    return dataclasses.replace(opts, keep_ids=True)

