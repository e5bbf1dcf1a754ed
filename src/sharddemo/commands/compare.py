"""`sharddemo compare`: one launch of every mode, then the report."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from sharddemo.commands.launches import report_of, run_args
from sharddemo.commands.output import (validate_files, error, large_report_notice, show,
                                       wants_progress)
from sharddemo.launch import LaunchSettings, make_launch, run_launch
from sharddemo.options import RunOptions, validate_compare, mesh_world


def compare_command(opts: RunOptions, settings: LaunchSettings, *, fmt: str,
                    output: Optional[str], plot: Optional[str], check: bool,
                    max_memory: Optional[str], debug: bool) -> int:
    """`sharddemo compare` from the command line: the files checked, the launch, the report
    printed; with --check, exit 1 where a mode broke what it promises."""
    from sharddemo.reportsize import what_it_lists

    validate_files(output, plot)
    what = lambda world: what_it_lists(opts.dataset_size, world, opts.epochs, opts.gather)
    notice = large_report_notice(what, fmt, output, can_count=not plot)
    result = compare_run(opts, settings, plot=bool(plot), max_memory=max_memory, debug=debug,
                         progress=wants_progress(fmt), size_notice=notice)
    if not show(result, fmt, output, plot):
        return 0
    if check and result["broken_promises"]:
        error("broken promise(s): " + "; ".join(result["broken_promises"]))
        return 1
    return 0


def compare_run(opts: RunOptions, settings: LaunchSettings = LaunchSettings(), *,
                plot: bool = False, max_memory: Optional[str] = None, debug: bool = False,
                progress: bool = False,
                size_notice: Optional[Callable[[int, int], None]] = None) -> dict:
    """`sharddemo compare`: every mode in one launch (or the resume demo's three), then the
    report. Refuses what the CLI refuses (options.validate_compare) before any rank starts.
    `size_notice(bytes, world)`: told, before the launch, how large the JSON report will be
    (reportsize) on the node that writes it."""
    if opts.mesh is not None:
        # the mesh is the world: its product of sizes is how many ranks to launch
        settings = dataclasses.replace(
            settings, num_processes=mesh_world(opts.mesh, settings.num_processes))
    validate_compare(opts, world=settings.num_processes, plot=plot, max_memory=max_memory)
    if opts.modes == ("resume",):
        from sharddemo.commands.resume import resume_demo_run

        return resume_demo_run(opts, settings, debug=debug)
    launch = make_launch(settings, {"run": opts.to_dict()}, run_args(opts),
                         check=opts.validate_split_batches)
    if size_notice is not None and launch.machine_rank == 0:
        from sharddemo.reportsize import compare_report_bytes

        size_notice(compare_report_bytes(opts, launch.num_processes), launch.num_processes)
    return report_of(launch, run_launch(launch, timeout=opts.timeout, debug=debug,
                                        progress=progress))
