"""The launches the commands start, and what their traces become: a launch of the audit's
rank command (audit_launch), the report's size told before it (notice_size), the trace made a
report (report_of) with the flags that rerun it by hand (run_args), and an audit's report
refused where its ids are not the samples' positions (refuse_ids_outside)."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional, cast

from sharddemo.analysis import build_report
from sharddemo.analysis.types import Trace
from sharddemo.errors import UsageError
from sharddemo.launch import Launch, LaunchSettings, make_launch
from sharddemo.options import AuditOptions, RunOptions, command_line


def report_of(launch: Launch, trace: Optional[dict], keys: Optional[dict] = None,
              key_field: Optional[str] = None) -> dict:
    """The trace -> the report; {} on a node whose machine rank 0 reports instead. `keys`:
    the names of a trace whose samples are keys (analysis.keys.number_keys)."""
    if not trace:
        return {}
    return build_report(cast(Trace, trace), launch_command=launch.display(),
                        config_file=launch.config_file, keys=keys, key_field=key_field)


def run_args(opts: RunOptions) -> list[str]:
    """`sharddemo run`'s flags for these options, as a person would type them."""
    return ["--modes", ",".join(opts.modes), *command_line(opts)]


def audit_launch(settings: LaunchSettings, opts: AuditOptions, command: str = "audit-rank",
                 **more):
    """A launch of the audit's rank command with these options (and `more` beside them in the
    options file: a resume's plan, phase and checkpoint)."""
    if opts.keys is not None:  # the ranks read it too, wherever they run
        opts = dataclasses.replace(opts, keys=os.path.abspath(opts.keys))
    return make_launch(settings, {"audit": dataclasses.asdict(opts), **more},
                       opts.command_line(), command=command)


def notice_size(size_notice: Optional[Callable[[int, int], None]], opts: AuditOptions,
                launch) -> None:
    """Tell `size_notice` how large the audit's JSON report will be (reportsize), on the node
    that writes it."""
    if size_notice is not None and launch.machine_rank == 0:
        from sharddemo.reportsize import audit_report_bytes

        size_notice(audit_report_bytes(opts, launch.num_processes), launch.num_processes)


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
