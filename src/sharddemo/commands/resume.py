"""`sharddemo audit --resume-at` and `sharddemo compare --modes resume`: the launches that
stop and save, run uninterrupted, and load and resume; then the comparison
(sharddemo.analysis.resume)."""

from __future__ import annotations

from typing import Callable, Optional, cast

from sharddemo.analysis.keys import holds_keys
from sharddemo.commands.launches import (audit_launch, notice_size, refuse_ids_outside,
                                         report_of, run_args)
from sharddemo.errors import UsageError
from sharddemo.launch import LaunchSettings, make_launch, run_launch
from sharddemo.options import LAST, AuditOptions, ResumePlan, RunOptions, validate_audit


def resume_audit_run(opts: AuditOptions, plan: ResumePlan,
                     settings: LaunchSettings = LaunchSettings(), *, plot: bool = False,
                     keep_checkpoint: Optional[str] = None, debug: bool = False,
                     progress: bool = False,
                     size_notice: Optional[Callable[[int, int], None]] = None) -> dict:
    """`sharddemo audit --resume-at`: the uninterrupted audit, a launch that stops and saves,
    and for each stop of the chain a fresh launch (on its own world size) that loads and
    resumes; the uninterrupted run again on each other world size the chain ran on; the audit
    report with a `resume` object and the `resume-exact` verdict. The checkpoints (one folder
    per stop) go to a temporary folder removed afterwards (`keep_checkpoint` keeps it); no
    launch leaves processes behind (run_launch)."""
    import dataclasses
    import shutil
    import tempfile

    from sharddemo.targets import validate_target
    from sharddemo.analysis.resume import compare_chain, explain

    opts = validate_audit(opts, plot=plot, resume=plan, keep_checkpoint=keep_checkpoint)
    validate_target(opts.target, opts.framework)
    if keep_checkpoint:
        _validate_checkpoint_dir(keep_checkpoint)
    checkpoint = keep_checkpoint or tempfile.mkdtemp(prefix="sharddemo-checkpoint-")
    stateful = plan.strategy == "stateful"
    last = plan.stops[-1]
    # the last launch finishes the epoch it resumes in and walks one more
    final_epoch = last.epoch + (2 if last.step == LAST else 1)
    reference_opts = dataclasses.replace(opts, epochs=max(opts.epochs, final_epoch + 1),
                                         stateful=stateful)
    phase_opts = dataclasses.replace(opts, stateful=False)

    def phase(where: LaunchSettings, name: str, index: int, **more) -> Optional[dict]:
        launch = audit_launch(where, phase_opts, "resume-rank", plan=dataclasses.asdict(plan),
                              phase=name, checkpoint=checkpoint, launch=index, **more)
        if index == 0:  # before the first launch: the report is the uninterrupted run's
            notice_size(size_notice, reference_opts, launch)
        launch.display_args += ["--resume-at", plan.text(), "--resume-strategy", plan.strategy]
        return run_launch(launch, timeout=opts.timeout, debug=debug, max_time=opts.max_time)

    def uninterrupted(where: LaunchSettings, show: bool = False):
        launch = audit_launch(where, reference_opts)
        return launch, run_launch(launch, timeout=opts.timeout, debug=debug,
                                  max_time=opts.max_time, progress=progress and show)

    launches: list[Optional[dict]] = []
    others: dict[int, dict] = {}
    try:
        # The first stopping launch first: a STEP past the epoch's end or a loader that cannot
        # save its state fails there, after one launch.
        launches.append(phase(settings, "stop", 0))
        launch, reference = uninterrupted(settings, show=True)
        # An epoch that a launch on another world size finished is compared with the
        # uninterrupted run on that size too: its own even_batches fill is fill, not a repeat.
        # Run before the restarts: each later stop is checked against its epoch's steps on
        # the world size of the launch that reaches it before any restart's ranks start.
        if reference and launches[0]:
            world = reference["world_size"]
            sizes = {stop.num_processes or world for stop in plan.stops}
            for size in sorted(sizes - {world}):
                others[size] = uninterrupted(dataclasses.replace(settings,
                                                                 num_processes=size))[1]
            if launches[0]["stop"].get("steps") is not None and all(others.values()):
                epochs = {world: reference["modes"]["audit"]["epochs"]}
                epochs.update({size: trace["modes"]["audit"]["epochs"]
                               for size, trace in others.items()})
                validate_later_stops(plan, epochs, world)
        for index, stop in enumerate(plan.stops, start=1):
            if not launches[-1]:
                break
            where = dataclasses.replace(settings, num_processes=stop.num_processes
                                        or settings.num_processes)
            launches.append(phase(where, "resume", index, resume_from=launches[-1]["stop"],
                                  final_epoch=final_epoch))
    finally:
        if not keep_checkpoint:
            shutil.rmtree(checkpoint, ignore_errors=True)
    if reference and holds_keys(reference):
        raise UsageError(f"--resume-at: --id-field {opts.id_field} holds keys (str), and the "
                         "resume audit compares integer ids only so far; audit the resume "
                         "with a field of integer ids, or leave --id-field out")
    report = report_of(launch, reference)
    if not report or not all(launches) or not all(others.values()):
        return {}  # a node whose machine rank 0 reports instead
    refuse_ids_outside(report, opts.id_field)
    audit = report["modes"]["audit"]
    references = {reference["world_size"]: reference["modes"]["audit"]["epochs"]}
    references.update({size: trace["modes"]["audit"]["epochs"] for size, trace in others.items()})
    # (every launch gave its trace: a node whose machine rank 0 reports returned above)
    resume = compare_chain(plan, references, reference["world_size"], cast(list, launches))
    resume["explanation"] = explain(resume)
    audit["resume"] = resume
    ok = resume["resume_exact"]
    detail = "" if ok else resume["explanation"]
    audit["verdicts"].append({"verdict": "resume-exact", "epoch": plan.first.epoch, "ok": ok,
                              "detail": detail})
    if not ok:
        broken = f"resume-exact (epoch {plan.first.epoch}): {detail}"
        audit["broken_promises"].append(broken)
        report["broken_promises"].append(broken)
    return report


def validate_later_stops(plan: ResumePlan, epochs: dict[int, list[dict]], world: int) -> None:
    """Every stop after the first against its epoch's steps per rank on the world size of the
    launch that reaches it (`epochs`: {world size: the uninterrupted run's epoch records}),
    counted as that launch counts them (resumed in the same epoch: skip and stateful go on from
    the previous stop's step, restart walks the whole epoch on from it). The same one line as
    the launch itself would raise, before any restart's ranks start. (The first stop is
    checked by the first launch, which runs first.)"""
    chain = plan.text()
    for previous, stop in zip(plan.stops, plan.stops[1:]):
        if stop.step == LAST:
            continue
        size = previous.num_processes or world
        records = [r for r in epochs.get(size, []) if r.get("epoch") == stop.epoch]
        if not records or not records[0].get("ranks"):
            continue
        # (an id record lists each rank's batches; a counted one, its steps)
        length = min(r["steps"] if "steps" in r else len(r.get("batches") or [])
                     for r in records[0]["ranks"])
        total = length
        if previous.epoch == stop.epoch and previous.step != LAST:
            total = (previous.step + length if plan.strategy == "restart"
                     else max(previous.step, length))
        if stop.step > total:
            raise UsageError(f"--resume-at {chain}: {stop.text()}: an epoch of this loader has "
                             f"{total} steps per rank on {size} rank(s) (stop at 0..{total}, or "
                             f"{stop.epoch}:last after its last step); stop at an earlier step")


def _validate_checkpoint_dir(path: str) -> None:
    import os

    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--keep-checkpoint {path} is a file; pass a folder for the checkpoint")
    parent = path if os.path.isdir(path) else (os.path.dirname(os.path.abspath(path)) or ".")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UsageError(f"--keep-checkpoint {path} cannot be written (the folder "
                         f"{parent} is missing or not writable); pick another folder")


def resume_demo_run(opts: RunOptions, settings: LaunchSettings = LaunchSettings(),
                    debug: bool = False) -> dict:
    """`compare --modes resume`: three launches (stop and save, uninterrupted, load and
    resume) run every scenario of resume.demo_scenarios; a report with a `resume` list."""
    import shutil
    import tempfile

    from sharddemo.analysis import REPORT_SCHEMA
    from sharddemo.analysis.resume import demo_report

    from sharddemo.extras import available, install_hint

    # the stateful strategy needs torchdata's StatefulDataLoader: without it, the others
    stateful = available("torchdata")
    checkpoint = tempfile.mkdtemp(prefix="sharddemo-checkpoint-")
    traces = {}
    try:
        for phase in ("stop", "reference", "resume"):
            launch = make_launch(settings, {"run": opts.to_dict(), "phase": phase,
                                            "checkpoint": checkpoint, "stateful": stateful},
                                 run_args(opts), command="resume-demo-rank",
                                 check=opts.validate_split_batches)
            traces[phase] = run_launch(launch, timeout=opts.timeout, debug=debug)
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
    if not traces.get("resume"):
        return {}
    ref = traces["reference"]
    return {"schema": REPORT_SCHEMA, "world_size": ref["world_size"],
            "backend": ref.get("backend", "gloo"), "distributed_type": ref.get("distributed_type"),
            "device": ref.get("device"), "dataset_size": opts.dataset_size,
            "batch_size": opts.batch_size,
            "global_batch": opts.per_rank_batch(ref["world_size"]) * ref["world_size"],
            "epochs": 3, "seed": opts.seed, "source": opts.source, "options": opts.to_dict(),
            "config_file": launch.config_file, "launch_command": None, "modes": {},
            "broken_promises": [],
            "resume": demo_report(ref, traces["stop"], traces["resume"], stateful),
            "resume_left_out": None if stateful else (
                "the stateful strategy (use_stateful_dataloader) needs torchdata's "
                "StatefulDataLoader, which is not installed; its 4 scenarios were left out: "
                + install_hint("torchdata"))}
