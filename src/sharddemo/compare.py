"""`sharddemo compare`: one launch of every mode, then the report."""

from __future__ import annotations

from typing import Callable, Optional

from sharddemo.config import default_config_path, load_config
from sharddemo.errors import UsageError
from sharddemo.launch import Launch, LaunchSettings, run_launch
from sharddemo.options import RunOptions
from sharddemo.analysis import build_report


def make_launch(settings: LaunchSettings, run_args: list[str], command: str = "run",
                check: Optional[Callable[[int], object]] = None) -> Launch:
    """Settings from the command line + the config file -> the launch to run."""
    path = settings.config_file or default_config_path()
    config = load_config(path)
    if settings.num_processes is not None and settings.num_processes < 1:
        raise UsageError(f"--num-processes must be at least 1, got {settings.num_processes}")
    world = settings.num_processes or config.num_processes
    machines = settings.num_machines or config.num_machines
    rank = settings.machine_rank if settings.machine_rank is not None else int(
        config.raw.get("machine_rank", 0) or 0)
    ip, port = settings.main_process_ip, settings.main_process_port
    if machines > 1:
        # Every machine must agree: take the config's address and port unless given.
        ip = ip or config.raw.get("main_process_ip")
        port = port or config.raw.get("main_process_port")
        if not ip or not port:
            raise UsageError("a multi-node launch needs --main-process-ip and "
                             "--main-process-port, the same on every machine")
        if not 0 <= rank < machines:
            raise UsageError(f"--machine-rank must be 0..{machines - 1}, got {rank}")
        if world % machines:
            raise UsageError(f"--num-processes counts every rank on every machine: {world} does "
                             f"not divide by {machines} machines")
    elif rank:
        raise UsageError(f"--machine-rank {rank} needs a multi-node launch: pass --num-machines")
    if port is not None and not 0 < int(port) < 65536:
        raise UsageError(f"--main-process-port must be 1..65535, got {port}")
    if check is not None:
        check(world)
    # A config that says use_cpu stays on CPU even where GPUs are visible.
    device = "cpu" if config.raw.get("use_cpu") else "auto"
    return Launch(config_file=path, num_processes=world, run_args=run_args, device=device,
                  port=int(port) if port else None, command=command, num_machines=machines,
                  machine_rank=rank, main_process_ip=ip)


def compare_run(opts: RunOptions, settings: LaunchSettings = LaunchSettings(),
                debug: bool = False, progress: bool = False) -> dict:
    if opts.modes == ("resume",):
        return resume_demo_run(opts, settings, debug=debug)
    launch = make_launch(settings, opts.to_run_args(), check=opts.check_world)
    return _report(launch, run_launch(launch, opts, debug=debug, progress=progress))


def _report(launch: Launch, trace: dict) -> dict:
    """The trace -> the report; {} on a node whose machine rank 0 reports instead."""
    if not trace:
        return {}
    return build_report(trace, launch_command=launch.display(), config_file=launch.config_file)


def write_report(report: dict, path: str) -> None:
    from sharddemo.fileio import write_atomic
    from sharddemo.render import render_json

    write_atomic(path, render_json(report))


TRAP_FLAGS = ["--cpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def trap_run(opts: RunOptions, num_processes: int) -> str:
    """Run the `accelerate launch --cpu --num_processes N` trap for real and explain it."""
    from sharddemo.render import render_table

    launch = Launch(config_file=None, num_processes=num_processes, flags=TRAP_FLAGS,
                    run_args=opts.to_run_args() + ["--allow-alone"], device="cpu",
                    expect_world=False)
    trace = run_launch(launch, opts)
    report = build_report(trace, launch_command=launch.display())
    world, n = report["world_size"], opts.dataset_size
    seen = report["modes"]["prepared"]["epochs"][0]["seen"]
    lines = [
        f"You asked for {num_processes} processes: "
        f"accelerate launch --cpu --num_processes {num_processes} -m sharddemo run",
        f"What really ran: {world} process(es), DistributedType {report['distributed_type']}, "
        f"backend {report['backend']}.",
        f"It saw {seen} of {n} samples per epoch: the whole dataset, on one process. Nothing is "
        "sharded and nothing is faster, yet the program runs and prints as if all was well.",
        "How to recognise it: accelerator.num_processes is 1 (print it), every 'rank' prints "
        "the whole dataset, and an epoch takes as many steps as on one device.",
        "The fix: accelerate launch --config_file accelerate_configs/cpu2.yaml -m sharddemo run "
        "(torchrun starts the processes; the script builds Accelerator(cpu=True)).",
        "sharddemo run refuses such a launch unless told otherwise: 'Error: launched for "
        "several processes but this process is alone (world size 1)'.",
        "",
    ]
    return "\n".join(lines) + render_table(report)


def audit_run(opts, settings: LaunchSettings = LaunchSettings(), debug: bool = False,
              progress: bool = False) -> dict:
    """`sharddemo audit`: launch the user's factory on real ranks, then the report + verdicts."""
    from sharddemo.audit import precheck_target

    precheck_target(opts.target, opts.framework)
    launch = make_launch(settings, opts.to_run_args(), command="audit-rank")
    trace = run_launch(launch, RunOptions(epochs=opts.epochs, timeout=opts.timeout),
                       debug=debug, timeout=opts.max_time, progress=progress)
    report = _report(launch, trace)
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


def resume_audit_run(opts, plan, settings: LaunchSettings = LaunchSettings(),
                     keep_checkpoint: Optional[str] = None, debug: bool = False,
                     progress: bool = False) -> dict:
    """`sharddemo audit --resume-at`: the uninterrupted audit, a launch that stops and saves,
    and a fresh launch that loads and resumes; the audit report with a `resume` object and
    the `resume-exact` verdict. The checkpoint goes to a temporary folder removed afterwards
    (`keep_checkpoint` keeps it); no launch leaves processes behind (run_launch)."""
    import dataclasses
    import shutil
    import tempfile

    from sharddemo.audit import precheck_target
    from sharddemo.resume import compare_resume, explain

    precheck_target(opts.target, opts.framework)
    if keep_checkpoint:
        _check_checkpoint_dir(keep_checkpoint)
    checkpoint = keep_checkpoint or tempfile.mkdtemp(prefix="sharddemo-checkpoint-")
    stateful = plan.strategy == "stateful"
    reference_opts = dataclasses.replace(opts, epochs=max(opts.epochs, plan.epoch + 2),
                                         stateful=stateful)
    limits = RunOptions(epochs=reference_opts.epochs, timeout=opts.timeout)
    try:
        # The stopping launch first: a STEP past the epoch's end or a loader that cannot save
        # its state fails there, after one launch.
        phase_args = [*dataclasses.replace(opts, stateful=False).to_run_args(),
                      "--resume-at", f"{plan.epoch}:{plan.step}",
                      "--resume-strategy", plan.strategy, "--checkpoint", checkpoint]
        stop = run_launch(make_launch(settings, [*phase_args, "--phase", "stop"],
                                      command="resume-rank"),
                          limits, debug=debug, timeout=opts.max_time)
        launch = make_launch(settings, reference_opts.to_run_args(), command="audit-rank")
        reference = run_launch(launch, limits, debug=debug, timeout=opts.max_time,
                               progress=progress)
        after = dataclasses.replace(settings, num_processes=plan.num_processes
                                    or settings.num_processes)
        resumed = run_launch(make_launch(after, [*phase_args, "--phase", "resume"],
                                         command="resume-rank"),
                             limits, debug=debug, timeout=opts.max_time)
    finally:
        if not keep_checkpoint:
            shutil.rmtree(checkpoint, ignore_errors=True)
    report = _report(launch, reference)
    if not report:
        return report
    refuse_ids_outside(report, opts.id_field)
    audit = report["modes"]["audit"]
    resume = compare_resume(plan, {"world_size": reference["world_size"],
                                   "epochs": reference["modes"]["audit"]["epochs"]},
                            stop, resumed)
    resume["explanation"] = explain(resume)
    audit["resume"] = resume
    ok = resume["resume_exact"]
    detail = "" if ok else resume["explanation"]
    audit["verdicts"].append({"verdict": "resume-exact", "epoch": plan.epoch, "ok": ok,
                              "detail": detail})
    if not ok:
        broken = f"resume-exact (epoch {plan.epoch}): {detail}"
        audit["broken_promises"].append(broken)
        report["broken_promises"].append(broken)
    return report


def _check_checkpoint_dir(path: str) -> None:
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
    from sharddemo.resume import demo_report

    checkpoint = tempfile.mkdtemp(prefix="sharddemo-checkpoint-")
    # A resume launch also runs epochs 0..2 for 12 scenarios: more work than one mode.
    limits = RunOptions(epochs=3 * 12, dataset_size=opts.dataset_size, timeout=opts.timeout)
    traces = {}
    try:
        for phase in ("stop", "reference", "resume"):
            launch = make_launch(settings, [*opts.to_run_args(), "--phase", phase,
                                            "--checkpoint", checkpoint],
                                 command="resume-demo-rank", check=opts.check_world)
            traces[phase] = run_launch(launch, limits, debug=debug)
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
            "resume": demo_report(ref, traces["stop"], traces["resume"])}
