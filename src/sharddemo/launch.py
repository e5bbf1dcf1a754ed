"""Start the Accelerate script with `accelerate launch`, watch it, collect its trace.

The ranks run in their own process session, so that a timeout, a failed rank or a Ctrl-C
here takes all of them down; nothing is left running.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from sharddemo.errors import RunFailed, UsageError
from sharddemo.options import RunOptions
from sharddemo.options import EXPECT_ENV


def free_port() -> int:
    """A port nobody listens on now, for this launch's rendezvous (never another job's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Launch:
    config_file: Optional[str]
    num_processes: int
    run_args: list[str]
    device: str = "auto"
    port: Optional[int] = None
    # The launch flags instead of a config file (`sharddemo trap` uses `--cpu`).
    flags: Optional[list[str]] = None
    expect_world: bool = True
    # The sharddemo command the ranks run.
    command: str = "run"

    def accelerate_args(self) -> list[str]:
        if self.flags is not None:
            return [*self.flags, "--num_processes", str(self.num_processes)]
        return ["--config_file", self.config_file, "--num_processes", str(self.num_processes)]

    def display(self) -> str:
        """The line a user can paste to rerun this by hand (no port: accelerate picks one)."""
        device = [] if self.device == "auto" else ["--device", self.device]
        words = (["accelerate", "launch", *self.accelerate_args(), "-m", "sharddemo",
                  self.command, *self.run_args, *device])
        return shlex.join(words)


def outer_timeout(opts: RunOptions) -> float:
    """How long the whole launch may take: start-up, plus the process-group timeout, plus
    room for the work itself. A hang always ends here at the latest."""
    work = opts.epochs * opts.dataset_size * len(opts.modes) * 2e-5
    return 60.0 + 2 * opts.timeout + work


def run_launch(launch: Launch, opts: RunOptions, *, debug: bool = False,
               timeout: Optional[float] = None) -> dict:
    """Run the launch; return the trace the main process wrote. Raises RunFailed."""
    port = launch.port or free_port()
    with tempfile.TemporaryDirectory(prefix="sharddemo-") as tmp:
        trace_path = os.path.join(tmp, "trace.json")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch.accelerate_args(),
               "--main_process_port", str(port),
               "-m", "sharddemo", launch.command, *launch.run_args, "--quiet",
               "--trace-out", trace_path]
        if launch.device != "auto":
            cmd += ["--device", launch.device]
        env = dict(os.environ)
        if launch.expect_world:
            env[EXPECT_ENV] = str(launch.num_processes)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        if debug:
            env["SHARDDEMO_DEBUG"] = "1"
        out_path = os.path.join(tmp, "stdout.log")
        err_path = os.path.join(tmp, "stderr.log")
        limit = timeout if timeout is not None else outer_timeout(opts)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
            try:
                code = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                raise RunFailed(
                    f"the launch did not finish within {limit:.0f} s and was stopped; "
                    "a rank stopped answering (raise --timeout if the work is really that long)"
                ) from None
            except KeyboardInterrupt:
                kill_group(proc)
                raise
            finally:
                if proc.poll() is None:
                    kill_group(proc)
        if code != 0:
            with open(err_path, encoding="utf-8", errors="replace") as handle:
                stderr = handle.read()
            message, usage = explain_failure(stderr, code, debug)
            raise (UsageError if usage else RunFailed)(message)
        try:
            with open(trace_path, encoding="utf-8") as handle:
                return json.load(handle)
        except (OSError, ValueError):
            raise RunFailed("the ranks exited without writing their trace") from None


def kill_group(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM the launch's whole process session, then SIGKILL what is left."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                return
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


RANK_ERROR = re.compile(r"\[rank (\d+)/\d+\] (Error|Usage error): (.*?)(?=\[rank \d+/\d+\] |$)",
                        re.M)


def explain_failure(stderr: str, code: int, debug: bool) -> tuple[str, bool]:
    """The ranks' own error lines when they wrote any, else the end of what they printed.
    Returns the message and whether it was a usage error (bad input, exit code 2)."""
    found = RANK_ERROR.findall(stderr)
    if debug:
        sys.stderr.write(stderr)
    if found:
        usage = any(kind == "Usage error" for _, kind, _ in found)
        seen: list[str] = []
        for rank, kind, message in found:
            if usage and kind != "Usage error":
                continue  # the others only saw the usage error's rank go away
            line = f"rank {rank}: {message}"
            if line not in seen:
                seen.append(line)
        return "; ".join(seen), usage
    tail = [line for line in stderr.strip().splitlines() if line.strip()][-3:]
    return f"the launch exited with code {code}: " + (" | ".join(tail) or "no output"), False
