"""`sharddemo trap`: the silent replication trap (`accelerate launch --cpu --num_processes
N` starts one process) run for real, and explained."""

from __future__ import annotations

from typing import cast

import click

from sharddemo.analysis import build_report
from sharddemo.analysis.types import Trace
from sharddemo.commands.launches import run_args
from sharddemo.errors import UsageError
from sharddemo.launch import Launch, run_launch
from sharddemo.options import RunOptions


def trap_command(num_processes: int, dataset_size: int, batch_size: int) -> None:
    """`sharddemo trap` from the command line: the options checked, the trap run and told."""
    if num_processes < 2:
        raise UsageError(f"--num-processes must be at least 2 to show the trap, got {num_processes}")
    opts = RunOptions(dataset_size=dataset_size, batch_size=batch_size, epochs=1,
                      modes=("prepared",)).validate()
    click.echo(trap_run(opts, num_processes), nl=False)


TRAP_FLAGS = ["--cpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def trap_run(opts: RunOptions, num_processes: int) -> str:
    """Run the `accelerate launch --cpu --num_processes N` trap for real and explain it."""
    from sharddemo.render import render_table

    launch = Launch(config_file=None, num_processes=num_processes, flags=TRAP_FLAGS,
                    options={"run": opts.to_dict(), "allow_alone": True},
                    display_args=run_args(opts), device="cpu", expect_world=False)
    trace = run_launch(launch, timeout=opts.timeout)
    report = build_report(cast(Trace, trace), launch_command=launch.display())
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
