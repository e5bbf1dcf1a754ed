"""`sharddemo audit`: launch the user's factory on real ranks, then the report and verdicts."""

from __future__ import annotations

import dataclasses
import os

from typing import Callable, Optional

from sharddemo.analysis.keys import holds_keys, number_keys, source_keys_of
from sharddemo.targets import read_keys
from sharddemo.commands import report_of
from sharddemo.errors import UsageError
from sharddemo.launch import LaunchSettings, make_launch, run_launch
from sharddemo.options import AuditOptions, check_audit


def audit_launch(settings: LaunchSettings, opts: AuditOptions, command: str = "audit-rank",
                 **more):
    """A launch of the audit's rank command with these options (and `more` beside them in the
    options file: a resume's plan, phase and checkpoint)."""
    if opts.keys is not None:  # the ranks read it too, wherever they run
        opts = dataclasses.replace(opts, keys=os.path.abspath(opts.keys))
    return make_launch(settings, {"audit": dataclasses.asdict(opts), **more},
                       opts.command_line(), command=command)


def audit_run(opts: AuditOptions, settings: LaunchSettings = LaunchSettings(), *,
              plot: bool = False, keep_checkpoint: Optional[str] = None,
              resume_num_processes: Optional[str] = None, debug: bool = False,
              progress: bool = False,
              size_notice: Optional[Callable[[int, int], None]] = None) -> dict:
    """`sharddemo audit`: launch the user's factory on real ranks, then the report + verdicts.
    Refuses what the CLI refuses (options.check_audit) before any rank starts. `size_notice`:
    as compare_run's."""
    from sharddemo.targets import precheck_target

    opts = check_audit(opts, plot=plot, keep_checkpoint=keep_checkpoint,
                       resume_num_processes=resume_num_processes)
    precheck_target(opts.target, opts.framework)
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


def notice_size(size_notice: Optional[Callable[[int, int], None]], opts: AuditOptions,
                launch) -> None:
    """Tell `size_notice` how large the audit's JSON report will be (reportsize), on the node
    that writes it."""
    if size_notice is not None and launch.machine_rank == 0:
        from sharddemo.reportsize import audit_report_bytes

        size_notice(audit_report_bytes(opts, launch.num_processes), launch.num_processes)


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
    if known is None and source_keys_of(trace) is not None:
        known, where = source_keys_of(trace)
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


def refuse_ids_outside(report: dict, id_field: Optional[str]) -> None:
    """One Error line where an audited loader delivered ids outside 0..N-1: the ids are then
    not the samples' positions (a 1-based or a database id, or a stream's --dataset-size too
    small), and every count of the report (missing, duplicated) would be meaningless."""
    for mode, data in (report or {}).get("modes", {}).items():
        n = data.get("dataset_size", report["dataset_size"])
        outside = sorted({i for e in data["epochs"] for i in e["out_of_range"]})
        if not outside:
            continue
        like = ", ".join(map(str, outside[:3])) + (", ..." if len(outside) > 3 else "")
        where = "" if mode == "audit" else f"{mode}: "
        field = f"--id-field {id_field}" if id_field is not None else "the ids"
        raise UsageError(f"{where}the loader delivered ids outside 0..{n - 1}, the positions "
                         f"of its {n} samples ({like}): {field} must hold each sample's "
                         "position 0..N-1, not a 1-based or database id (for a stream N is "
                         "--dataset-size: raise it if the ids are right); pass such a field, "
                         "or leave --id-field out to audit by the dataset's positions")
