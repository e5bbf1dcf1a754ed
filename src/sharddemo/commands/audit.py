"""`sharddemo audit`: launch the user's factory on real ranks, then the report and verdicts."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from sharddemo.analysis.keys import holds_keys, number_keys, source_keys_of
from sharddemo.commands.launches import audit_launch, notice_size, refuse_ids_outside, report_of
from sharddemo.commands.output import (validate_files, error, large_report_notice, show,
                                       wants_progress)
from sharddemo.errors import UsageError
from sharddemo.launch import LaunchSettings, run_launch
from sharddemo.options import AuditOptions, ResumeOptions, validate_audit, mesh_world
from sharddemo.targets import read_keys


def audit_command(opts: AuditOptions, settings: LaunchSettings, resume: ResumeOptions, *,
                  fmt: str, output: Optional[str], plot: Optional[str],
                  keep_checkpoint: Optional[str], debug: bool) -> int:
    """`sharddemo audit` from the command line: the files checked, the launches (the resume
    audit's with --resume-at), the report printed; exit 1 where a verdict failed."""
    from sharddemo.reportsize import what_it_lists

    validate_files(output, plot)
    plan = resume.plan(opts.epochs)
    what = lambda world: what_it_lists(opts.dataset_size or 0, world, opts.epochs, opts.gather)
    notice = large_report_notice(what, fmt, output, can_count=not plot and plan is None)
    if plan is None:
        result = audit_run(opts, settings, plot=bool(plot), keep_checkpoint=keep_checkpoint,
                           resume_num_processes=resume.resume_num_processes, debug=debug,
                           progress=wants_progress(fmt), size_notice=notice)
    else:
        from sharddemo.commands.resume import resume_audit_run

        result = resume_audit_run(opts, plan, settings, plot=bool(plot),
                                  keep_checkpoint=keep_checkpoint, debug=debug,
                                  progress=wants_progress(fmt), size_notice=notice)
    if not show(result, fmt, output, plot):
        return 0
    failed = failed_verdicts(result)
    if failed:
        error("verdict(s) failed: " + "; ".join(failed))
        return 1
    return 0


def failed_verdicts(report: dict) -> list[str]:
    """`name (epochs 0, 1)` for each failed verdict, in order."""
    failed: dict[str, list[int]] = {}
    for data in report["modes"].values():
        for v in data.get("verdicts", []):
            if not v["ok"]:
                failed.setdefault(v["verdict"], []).append(v["epoch"])
    return [f"{name} (epoch {', '.join(map(str, epochs))})" for name, epochs in failed.items()]


def audit_run(opts: AuditOptions, settings: LaunchSettings = LaunchSettings(), *,
              plot: bool = False, keep_checkpoint: Optional[str] = None,
              resume_num_processes: Optional[str] = None, debug: bool = False,
              progress: bool = False,
              size_notice: Optional[Callable[[int, int], None]] = None) -> dict:
    """`sharddemo audit`: launch the user's factory on real ranks, then the report + verdicts.
    Refuses what the CLI refuses (options.validate_audit) before any rank starts. `size_notice`:
    as compare_run's."""
    from sharddemo.targets import validate_target

    opts = validate_audit(opts, plot=plot, keep_checkpoint=keep_checkpoint,
                       resume_num_processes=resume_num_processes)
    validate_target(opts.target, opts.framework)
    if opts.mesh is not None:  # the mesh is the world (as compare_run)
        settings = dataclasses.replace(
            settings, num_processes=mesh_world(opts.mesh, settings.num_processes))
    known = read_keys(opts.keys, opts.dataset_size) if opts.keys else None
    launch = audit_launch(settings, opts)
    notice_size(size_notice, opts, launch)
    trace = run_launch(launch, timeout=opts.timeout, debug=debug, max_time=opts.max_time,
                       progress=progress)
    keys = number_trace_keys(trace, opts, known)
    report = report_of(launch, trace, keys, opts.id_field)
    if keys is not None:
        refuse_keys_outside(report, keys["from"])
    else:
        refuse_ids_outside(report, opts.id_field)
    return report


def number_trace_keys(trace: Optional[dict], opts, known: Optional[list[str]]):
    """Where the ranks' records name samples by key: the keys numbered 0..N-1 in the trace
    (analysis.keys), their names returned; None for integer ids. One Error line where the
    keys and N disagree, or where --keys was given for integer ids."""
    if not trace:
        return None
    if not holds_keys(trace):
        if known is not None:
            raise UsageError(f"--keys {opts.keys}: --id-field {opts.id_field} holds integer "
                             "ids, not keys; leave --keys out")
        return None
    size = opts.dataset_size or trace.get("dataset_size") or None
    where = f"--keys {opts.keys}" if known is not None else None
    source = source_keys_of(trace) if known is None else None
    if source is not None:
        known, where = source
        first: dict[str, int] = {}
        for row, key in enumerate(known):
            if first.setdefault(key, row) != row:
                raise UsageError(f"{where} holds the key {key!r} in rows {first[key]} and "
                                 f"{row}: keys that repeat cannot name samples; pass "
                                 "--id-field with a field unique to each sample, or --keys FILE")
        if opts.dataset_size is not None and opts.dataset_size != len(known):
            raise UsageError(f"{where} holds {len(known)} keys but --dataset-size is "
                             f"{opts.dataset_size}; leave --dataset-size out (the keys give N)")
    keys = number_keys(trace, known, size)
    if keys is None:  # (holds_keys said some record holds keys: number_keys numbers them)
        return None
    keys["from"] = where
    if known is None and size is not None and keys["seen"] > size:
        raise UsageError(f"the loader delivered {keys['seen']} different keys in "
                         f"--id-field {opts.id_field}, more than the {size} samples of the "
                         "dataset (--dataset-size, or its length); raise --dataset-size, or "
                         "pass --keys FILE listing every sample's key")
    return keys


def refuse_keys_outside(report: dict, where: Optional[str]) -> None:
    """One Error line where the loader delivered keys the known set (--keys FILE, or the
    dataset's own column) does not hold."""
    if where is None:
        return
    outside = sorted({k for data in report.get("modes", {}).values()
                      for e in data["epochs"] for k in e["out_of_range"]}, key=str)
    if outside:
        like = ", ".join(map(repr, outside[:3])) + (", ..." if len(outside) > 3 else "")
        fix = ("pass the file that lists every sample's key" if where.startswith("--keys")
               else "pass --keys FILE listing every sample's key")
        raise UsageError(f"the loader delivered {len(outside)} key(s) that {where} does "
                         f"not hold ({like}); {fix}")
