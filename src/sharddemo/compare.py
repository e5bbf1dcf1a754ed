"""`sharddemo compare`: one launch of every mode, then the report."""

from __future__ import annotations

from typing import Optional

from sharddemo.config import default_config_path, load_config
from sharddemo.errors import UsageError
from sharddemo.launch import Launch, run_launch
from sharddemo.options import RunOptions
from sharddemo.report import build_report


def make_launch(opts: RunOptions, config_file: Optional[str],
                num_processes: Optional[int]) -> Launch:
    path = config_file or default_config_path()
    config = load_config(path)
    if num_processes is not None and num_processes < 1:
        raise UsageError(f"--num-processes must be at least 1, got {num_processes}")
    world = num_processes or config.num_processes
    opts.check_world(world)
    # A config that says use_cpu stays on CPU even where GPUs are visible.
    device = "cpu" if config.raw.get("use_cpu") else "auto"
    return Launch(config_file=path, num_processes=world, run_args=opts.to_run_args(),
                  device=device)


def compare_run(opts: RunOptions, *, config_file: Optional[str] = None,
                num_processes: Optional[int] = None, debug: bool = False) -> dict:
    launch = make_launch(opts, config_file, num_processes)
    trace = run_launch(launch, opts, debug=debug)
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


def audit_run(opts, *, config_file: Optional[str] = None, num_processes: Optional[int] = None,
              debug: bool = False) -> dict:
    """`sharddemo audit`: launch the user's factory on real ranks, then the report + verdicts."""
    from sharddemo.audit import precheck_target

    precheck_target(opts.target)
    path = config_file or default_config_path()
    config = load_config(path)
    if num_processes is not None and num_processes < 1:
        raise UsageError(f"--num-processes must be at least 1, got {num_processes}")
    world = num_processes or config.num_processes
    device = "cpu" if config.raw.get("use_cpu") else "auto"
    launch = Launch(config_file=path, num_processes=world, run_args=opts.to_run_args(),
                    device=device, command="audit-rank")
    trace = run_launch(launch, RunOptions(epochs=opts.epochs, timeout=opts.timeout),
                       debug=debug, timeout=opts.max_time)
    return build_report(trace, launch_command=launch.display(), config_file=path)
