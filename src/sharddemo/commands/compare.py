"""`sharddemo compare` (and `trap`): one launch of every mode, then the report."""

from __future__ import annotations

from typing import Callable, Optional

from sharddemo.analysis import build_report
from sharddemo.commands import report_of, run_args
from sharddemo.launch import Launch, LaunchSettings, make_launch, run_launch
from sharddemo.options import RunOptions, check_compare


def compare_run(opts: RunOptions, settings: LaunchSettings = LaunchSettings(), *,
                plot: bool = False, max_memory: Optional[str] = None, debug: bool = False,
                progress: bool = False,
                size_notice: Optional[Callable[[int, int], None]] = None) -> dict:
    """`sharddemo compare`: every mode in one launch (or the resume demo's three), then the
    report. Refuses what the CLI refuses (options.check_compare) before any rank starts.
    `size_notice(bytes, world)`: told, before the launch, how large the JSON report will be
    (reportsize) on the node that writes it."""
    check_compare(opts, world=settings.num_processes, plot=plot, max_memory=max_memory)
    if opts.modes == ("resume",):
        from sharddemo.commands.resume import resume_demo_run

        return resume_demo_run(opts, settings, debug=debug)
    launch = make_launch(settings, {"run": opts.to_dict()}, run_args(opts),
                         check=opts.check_world)
    if size_notice is not None and launch.machine_rank == 0:
        from sharddemo.reportsize import compare_report_bytes

        size_notice(compare_report_bytes(opts, launch.num_processes), launch.num_processes)
    return report_of(launch, run_launch(launch, timeout=opts.timeout, debug=debug,
                                        progress=progress))


TRAP_FLAGS = ["--cpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def trap_run(opts: RunOptions, num_processes: int) -> str:
    """Run the `accelerate launch --cpu --num_processes N` trap for real and explain it."""
    from sharddemo.render import render_table

    launch = Launch(config_file=None, num_processes=num_processes, flags=TRAP_FLAGS,
                    options={"run": opts.to_dict(), "allow_alone": True},
                    display_args=run_args(opts), device="cpu", expect_world=False)
    trace = run_launch(launch, timeout=opts.timeout)
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
