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
