"""`sharddemo audit`: launch the user's factory on real ranks, then the report and verdicts."""

from __future__ import annotations

from typing import Optional

from sharddemo.commands import report_of
from sharddemo.errors import UsageError
from sharddemo.launch import LaunchSettings, make_launch, run_launch
from sharddemo.options import RunOptions

def audit_run(opts, settings: LaunchSettings = LaunchSettings(), debug: bool = False,
              progress: bool = False) -> dict:
    """`sharddemo audit`: launch the user's factory on real ranks, then the report + verdicts."""
    from sharddemo.audit import precheck_target

    precheck_target(opts.target, opts.framework)
    launch = make_launch(settings, opts.to_run_args(), command="audit-rank")
    trace = run_launch(launch, RunOptions(epochs=opts.epochs, timeout=opts.timeout),
                       debug=debug, timeout=opts.max_time, progress=progress)
    report = report_of(launch, trace)
    refuse_ids_outside(report, opts.id_field)
    return report


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
