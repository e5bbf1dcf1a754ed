"""Run one launch: its temporary folder and options file, the ranks' environment, the wait
(the watchdog, the progress bar), the end of every process on any way out, and the trace the
main rank wrote or the one line that says why there is none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

from sharddemo.errors import DEBUG_ENV, RunFailed, UsageError
from sharddemo.launch.command import Launch, free_port
from sharddemo.launch.failures import PORT_TAKEN, explain_failure, read_status
from sharddemo.launch.processes import Family, Interrupted, signals_raise
from sharddemo.launch.progressbar import ProgressBar
from sharddemo.launch.watchdog import Watchdog
from sharddemo.lifeline import launcher_preexec
from sharddemo.options import (EXPECT_ENV, NODE_ENV, PARENT_ENV, PROGRESS_ENV, STATUS_ENV,
                               write_rank_options)


def run_launch(launch: Launch, *, timeout: float, debug: bool = False,
               max_time: Optional[float] = None, progress: bool = False,
               retried: bool = False) -> dict:
    """Run the launch; return the trace the main process wrote. Raises RunFailed.

    `timeout`: the ranks' process-group timeout (--timeout), from which the watchdog's
    bounds come (progress_bound, start_bound): a launch runs as long as its ranks make
    progress. `max_time`: the user's own limit on the whole launch (audit --max-time), kept
    as given; None: none."""
    port = launch.port or free_port()
    with tempfile.TemporaryDirectory(prefix="sharddemo-") as tmp:
        trace_path = os.path.join(tmp, "trace.json")
        status_dir = os.path.join(tmp, "status")
        os.mkdir(status_dir)
        # The launcher's and the ranks' temporary files (torchrun's log folder, an hf-stream's
        # files, a Trainer's output_dir) go here and are removed with it: ranks end with
        # os._exit (cli._end_rank), so their own atexit cleanup never runs.
        scratch = os.path.join(tmp, "scratch")
        os.mkdir(scratch)
        # the ranks read what to do from one file beside the trace (options.read_rank_options)
        options_path = os.path.join(tmp, "options.json")
        write_rank_options(options_path, launch.options)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch.accelerate_args(),
               "--main_process_port", str(port),
               "-m", "sharddemo", launch.command, "--options", options_path, "--quiet",
               "--trace-out", trace_path]
        if launch.device != "auto":
            cmd += ["--device", launch.device]
        env = dict(os.environ)
        if launch.expect_world:
            env[EXPECT_ENV] = str(launch.num_processes)
        env[NODE_ENV] = str(launch.machine_rank)
        env[STATUS_ENV] = status_dir
        env[PARENT_ENV] = str(os.getpid())
        if progress:
            env[PROGRESS_ENV] = "1"
        env["TMPDIR"] = scratch
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        if debug:
            env[DEBUG_ENV] = "1"
        out_path = os.path.join(tmp, "stdout.log")
        err_path = os.path.join(tmp, "stderr.log")
        # torchrun names a dead process by its local rank: on machine m of a
        # multi-node job, global rank = m * ranks per machine + local rank.
        per_machine = launch.num_processes // max(launch.num_machines, 1)
        first = launch.machine_rank * per_machine
        watchdog = Watchdog(status_dir, timeout,
                            expected=per_machine if launch.expect_world else 0)
        with open(out_path, "wb") as out, open(err_path, "wb") as err, \
                signals_raise(Interrupted):
            # A SIGKILL here ends nothing below by itself: the launcher and the ranks watch
            # for it (sharddemo.lifeline).
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True,
                                    preexec_fn=launcher_preexec(os.getpid()))
            family = Family(proc)
            bar = ProgressBar(out_path) if progress else None
            try:
                code = _wait(proc, watchdog, max_time, bar, family)
            finally:
                # Any way out (the watchdog, an error, Ctrl-C, SIGTERM, SIGHUP): end every
                # process started.
                if bar is not None:
                    bar.close()
                family.end()
        if code != 0:
            with open(err_path, encoding="utf-8", errors="replace") as handle:
                stderr = handle.read()
            watchdog.poll()
            failed, started = read_status(status_dir)
            if (not failed and launch.port is None and not retried
                    and PORT_TAKEN.search(stderr)):
                # Someone took the free port before the launcher bound it: once more, anew.
                return run_launch(launch, timeout=timeout, debug=debug, max_time=max_time,
                                  progress=progress, retried=True)
            message, usage = explain_failure(failed, started, stderr, code, debug,
                                             first_rank=first, seen=watchdog.last_seen(),
                                             timeout=timeout)
            raise (UsageError if usage else RunFailed)(message)
        if launch.machine_rank != 0 and not os.path.exists(trace_path):
            return {}  # another node's main process writes the report
        try:
            with open(trace_path, encoding="utf-8") as handle:
                return json.load(handle)
        except (OSError, ValueError):
            raise RunFailed("the ranks exited without writing their trace") from None


def _wait(proc: subprocess.Popen, watchdog: "Watchdog", max_time: Optional[float],
          bar: Optional["ProgressBar"], family: "Family") -> int:
    """Wait for the launch, updating the progress bar and the list of its processes; raise
    RunFailed, saying what was seen, when the watchdog finds that no rank makes progress or
    when `max_time` has passed (the caller ends every process)."""
    end = None if max_time is None else watchdog.began + max_time
    while True:
        family.refresh()
        try:
            return proc.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            watchdog.poll(now)
            stalled = watchdog.overdue(now)
            if stalled is not None:
                raise RunFailed(stalled) from None
            if end is not None and now > end:
                raise RunFailed(f"the launch did not finish within its limit of {max_time:g} s "
                                f"(--max-time) and was stopped; {watchdog.describe(now)}"
                                ) from None
            if bar is not None:
                bar.update()

