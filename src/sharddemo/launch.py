"""Start the Accelerate script with `accelerate launch`, watch it, collect its trace.

The ranks run in their own process session, so that a timeout, a failed rank or a Ctrl-C
here takes all of them down; nothing is left running. A SIGKILL here, which no code of ours
outlives, takes them down too: the launcher and the ranks end with their parent
(sharddemo.lifeline).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from sharddemo.config import default_config_path, load_config
from sharddemo.errors import DEBUG_ENV, RunFailed, UsageError
from sharddemo.lifeline import launcher_preexec
from sharddemo.options import (EXPECT_ENV, NODE_ENV, PARENT_ENV, PROGRESS_ENV, STATUS_ENV,
                               write_rank_options)
from sharddemo.progress import SIZE, read_report


def free_port() -> int:
    """A port nobody listens on now, for this launch's rendezvous (never another job's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class LaunchSettings:
    """How to launch, with accelerate launch's own names: one machine by default, or one
    node of a multi-node job."""

    config_file: Optional[str] = None
    num_processes: Optional[int] = None  # all ranks, over every machine
    main_process_port: Optional[int] = None
    num_machines: Optional[int] = None
    machine_rank: Optional[int] = None
    main_process_ip: Optional[str] = None


@dataclass
class Launch:
    config_file: Optional[str]
    num_processes: int
    # What the ranks are asked to do: the options file's contents (options.read_rank_options)
    options: dict
    # The flags of `command` that do the same by hand (options.command_line), for display()
    display_args: list[str]
    device: str = "auto"
    port: Optional[int] = None
    # The launch flags instead of a config file (`sharddemo trap` uses `--cpu`).
    flags: Optional[list[str]] = None
    expect_world: bool = True
    # The sharddemo command the ranks run.
    command: str = "run"
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: Optional[str] = None

    def accelerate_args(self) -> list[str]:
        if self.flags is not None:
            args = [*self.flags, "--num_processes", str(self.num_processes)]
        else:
            args = ["--config_file", self.config_file, "--num_processes", str(self.num_processes)]
        if self.num_machines > 1:
            args += ["--num_machines", str(self.num_machines),
                     "--machine_rank", str(self.machine_rank),
                     "--main_process_ip", str(self.main_process_ip)]
        return args

    def display(self) -> str:
        """The line a user can paste to rerun this by hand (the port only when one was
        given: on one machine accelerate picks a free one)."""
        device = [] if self.device == "auto" else ["--device", self.device]
        port = ["--main_process_port", str(self.port)] if self.port else []
        words = (["accelerate", "launch", *self.accelerate_args(), *port, "-m", "sharddemo",
                  self.command, *self.display_args, *device])
        return shlex.join(words)


# The watchdog's bounds (docs/reliability.md). A launch is stopped only when no rank has made
# progress (a batch received, an epoch's end, a collective done: rank.heartbeat) for
# PROGRESS_TIMEOUTS x --timeout. A rank that waits on a collective gives up after --timeout
# and says so itself, so in a launch whose ranks still run their own code the ranks' account
# comes first and this is the backstop (a rank stuck where no peer waits on it, a collective
# that never returns). A rank still starting (imports, the Accelerator, building its loader,
# its first batch), or finishing (every epoch walked: its trace written, the teardown), has
# START_S + 2 x --timeout from its last sign of life instead.
PROGRESS_TIMEOUTS = 3
START_S = 60.0


def progress_bound(timeout: float) -> float:
    """Seconds without progress on every rank after which a walking launch is stopped."""
    return PROGRESS_TIMEOUTS * timeout


def start_bound(timeout: float) -> float:
    """Seconds a rank may spend starting (before its first batch) without a sign of life."""
    return START_S + 2 * timeout


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
                _signals_raise(Interrupted):
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


class Watchdog:
    """The parent's view of the ranks' progress: their reports in the status folder
    (sharddemo.progress), read as the launch runs (a quarter-second poll). A report carries
    the time it was made on the machine's monotonic clock, which this process reads too.

    `expected`: how many ranks of this machine should report; until they all have, the launch
    itself counts as starting since it began. A rank is starting until its first batch
    (start_bound from its last report), then walking (progress_bound), then finishing once
    every epoch is walked (start_bound again: a large trace to write). The launch is overdue
    when every rank, and the launch's own start while a rank has not reported, is past its
    bound."""

    def __init__(self, folder: str, timeout: float, expected: int = 0,
                 now: Optional[float] = None) -> None:
        self.folder = folder
        self.timeout = timeout
        self.expected = expected
        self.began = time.monotonic() if now is None else now
        self.ranks: dict[int, dict] = {}  # rank -> its last report (sharddemo.progress)
        self.failed_at: dict[int, float] = {}  # when each rank's failure file appeared

    def poll(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            match = re.fullmatch(r"rank-(\d+)\.(progress|json)", name)
            if not match:
                continue
            rank = int(match.group(1))
            if match.group(2) == "json":
                self.failed_at.setdefault(rank, now)
                continue
            report = _read_progress(os.path.join(self.folder, name))
            if report is not None:
                report["when"] = min(report["when"], now)
                self.ranks[rank] = report

    def deadline(self) -> tuple[float, str]:
        """(the time after which the launch is overdue, the phase whose bound sets it:
        "walking", or "starting" for a rank starting or finishing: no batch to count
        there, the start bound)."""
        candidates = [(report["when"] + progress_bound(self.timeout), "walking")
                      if report["phase"] == "walking" else
                      (report["when"] + start_bound(self.timeout), "starting")
                      for report in self.ranks.values()]
        if not self.ranks or len(self.ranks) < self.expected:
            candidates.append((self.began + start_bound(self.timeout), "starting"))
        return max(candidates)

    def overdue(self, now: Optional[float] = None) -> Optional[str]:
        """None while some rank is within its bound; else the line that says what was seen."""
        now = time.monotonic() if now is None else now
        deadline, phase = self.deadline()
        if now <= deadline:
            return None
        if phase == "starting":
            bound = (f"{start_bound(self.timeout):g} s, the bound for a rank starting or "
                     f"finishing: {START_S:g} s + 2 x --timeout")
        else:
            bound = (f"{progress_bound(self.timeout):g} s, the bound of {PROGRESS_TIMEOUTS} x "
                     "--timeout")
        latest = max([r["when"] for r in self.ranks.values()] or [self.began])
        return (f"no rank made progress for {now - latest:.0f} s (over {bound}) and the "
                f"launch was stopped; {self.describe(now)} (if one step or the start-up "
                "really takes that long, raise --timeout)")

    def last_seen(self, now: Optional[float] = None) -> dict[int, tuple[dict, float]]:
        """{rank: (its last report, seconds from it to the first failure a rank reported,
        or to `now` where none did)}."""
        now = time.monotonic() if now is None else now
        end = min(self.failed_at.values(), default=now)
        return {rank: (report, max(end - report["when"], 0.0))
                for rank, report in sorted(self.ranks.items())}

    def describe(self, now: Optional[float] = None) -> str:
        """Every rank's last report, the most recent first: `rank 1 last made progress at
        sampler epoch 0, step 3, 9.2 s before the stop`."""
        now = time.monotonic() if now is None else now
        seen = sorted(self.ranks.items(), key=lambda item: -item[1]["when"])
        parts = [progress_text(rank, report, now - report["when"], "the stop")
                 for rank, report in seen]
        if len(self.ranks) < self.expected:
            parts.append(f"{self.expected - len(self.ranks)} rank(s) had not started "
                         f"({now - self.began:.0f} s after the launch began)")
        return "; ".join(parts) or (f"no rank had started ({now - self.began:.0f} s after "
                                    "the launch began)")


def _read_progress(path: str) -> Optional[dict]:
    """A rank's progress report (sharddemo.progress), read until two reads agree (a rank
    may be writing it as it is read); None when it cannot be read whole."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(SIZE)
            for _ in range(3):
                handle.seek(0)
                again = handle.read(SIZE)
                if again == data:
                    return read_report(data)
                data = again
    except OSError:
        pass
    return None


def progress_text(rank: int, report: dict, ago: float, before: str = "the stop") -> str:
    """One rank's last report in words (rank.heartbeat's fields), `ago` seconds before
    `before`: `rank 1 last made progress at sampler epoch 0, step 3, 9.2 s before the stop`
    (step: the batches it had received in that epoch)."""
    phase = report.get("phase", "starting")
    if phase == "starting":
        return (f"rank {rank} was still starting (no batch yet), its last sign of life "
                f"{ago:.1f} s before {before}")
    if phase == "finishing":
        return (f"rank {rank} had walked every epoch and was writing its trace, "
                f"{ago:.1f} s before {before}")
    return (f"rank {rank} last made progress at {report.get('where')}, step "
            f"{report.get('step')}, {ago:.1f} s before {before}")


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP reached `compare`/`audit`: every process started is ended,
    nothing is written, and the line names the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise(exc_type):
    """While the launch runs, SIGINT, SIGTERM and SIGHUP raise `exc_type(signum)` in the main
    thread, so the cleanup below runs for each. SIGINT too, although Python raises
    KeyboardInterrupt for it by default: a process started with SIGINT ignored (as a shell
    without job control starts one in the background, and as some launchers start their
    children) keeps it ignored, and a library imported on the way can install its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise exc_type(signum)

    old = {sig: signal.signal(sig, handler)
           for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


class Family:
    """Every process the launch started, known by pid and start time.

    `accelerate launch` (torchrun) starts each rank in a session of its own, so a signal to
    the launcher's process group misses them, and a rank whose launcher died is re-parented
    and can no longer be found from it. So the family is listed while the launch runs (a
    quarter-second poll) and every member still alive is ended at the end."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import psutil

        self.proc = proc
        self.members: dict[int, "psutil.Process"] = {}
        try:
            self.members[proc.pid] = psutil.Process(proc.pid)
        except psutil.Error:
            pass

    def refresh(self) -> None:
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            self.members.setdefault(child.pid, child)

    def end(self, grace: float = 3.0) -> None:
        """SIGTERM every member still alive, then SIGKILL what is left after `grace`."""
        import psutil

        if self.proc.poll() is None:
            self.refresh()
        alive = [p for p in self.members.values() if _running(p)]
        if not alive:
            return
        try:
            os.killpg(os.getpgid(self.proc.pid), signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        for member in alive:
            try:
                member.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(alive, timeout=grace)
        for member in alive:
            try:
                member.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=grace)
        self.proc.poll()


def _running(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class ProgressBar:
    """One bar on the terminal, fed by the main rank's progress lines (the ranks themselves
    never draw one), shown only once the run has lasted `delay` seconds."""

    def __init__(self, stdout_path: str, delay: float = 1.0) -> None:
        self.path = stdout_path
        self.offset = 0
        self.bar = None
        self.label = None
        self.seen, self.first = None, (0.0, 0)  # the label last read, its first (time, samples)
        self.show_after = time.monotonic() + delay

    def update(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except OSError:
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        self.offset += end + 1
        lines = [line for line in chunk[:end].decode("utf-8", "replace").splitlines()
                 if line.startswith(PROGRESS_PREFIX)]
        if not lines:
            return
        _, label, step, total, *rest = lines[-1].split(" ")
        samples, scope = (int(rest[0]), rest[1]) if len(rest) == 2 else (None, None)
        now = time.monotonic()
        if label != self.seen:
            # The samples' rate is measured from the first line of this label on (the main
            # rank writes one at its first step), not from when the bar appears.
            self.seen, self.first = label, (now, samples or 0)
        if now < self.show_after:
            return
        from tqdm import tqdm

        if label != self.label:
            self.close()
            self.label = label
            columns, lines = _terminal_size()
            known = total != "?"
            self.bar = tqdm(total=int(total) if known else None, desc=label, unit="step",
                            leave=False, file=sys.stderr, ncols=columns, nrows=lines,
                            bar_format=BAR_FORMAT if known else BAR_FORMAT_OPEN)
        self.bar.n = int(step)
        if samples is not None:
            # Samples so far and their rate (once there is half a second to measure it),
            # beside tqdm's steps and ETA.
            where = "" if scope == "all" else " on rank 0"
            text = f"{samples:,} samples{where}"
            since, before = self.first
            if now - since >= 0.5 and samples > before:
                text += f", {(samples - before) / (now - since):,.0f}/s"
            self.bar.set_postfix_str(text, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _terminal_size() -> tuple[int, int]:
    """The size of the terminal the bar is drawn on (stderr; stdout may be a file): $COLUMNS
    and $LINES first, as shutil reads them. A terminal that reports no size (a fresh
    pseudo-terminal says 0 x 0) would make tqdm hide the bar: 100 x 20 then."""
    import shutil

    columns, lines = shutil.get_terminal_size((0, 0))
    try:
        own = os.get_terminal_size(sys.stderr.fileno())
    except (AttributeError, ValueError, OSError):
        own = os.terminal_size((0, 0))
    if "COLUMNS" not in os.environ:
        columns = own.columns
    if "LINES" not in os.environ:
        lines = own.lines
    return columns or 100, lines or 20


PROGRESS_PREFIX = "sharddemo-progress"
# tqdm's bar without its step rate (the samples' rate follows), so that steps, ETA, samples
# and their rate fit in 100 columns even at 10^8 samples (tqdm cuts a longer line).
BAR_FORMAT = ("{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
              "[{elapsed}<{remaining}{postfix}]")
BAR_FORMAT_OPEN = "{desc}: {n_fmt} steps [{elapsed}{postfix}]"

# torchrun's own report of a process that ended: a negative exit code is a signal. Only used to
# name the signal of a rank that died without leaving its status file.
TORCHRUN_EXIT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# torchrun's closing table: one entry per failed process; and the processes it closed itself
# (whose signal is torchrun's, not the cause).
TORCHRUN_ENTRY = re.compile(r"rank\s*:\s*\d+ \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+) "
                            r"\(pid: (\d+)\)")
TORCHRUN_CLOSED = re.compile(r"Sending process (\d+) closing signal")


def killed_by_signal(stderr: str, first_rank: int = 0) -> dict[int, int]:
    """{rank: signal number} for the ranks a signal ended, as torchrun reports them: its
    "failed" line names the first process it saw end; its closing table names every failed
    one. A rank that exits as soon as its peer dies can be the one torchrun sees first, so
    the table is read too, less the processes torchrun closed itself."""
    out = {first_rank + int(local): -int(code)
           for code, local in TORCHRUN_EXIT.findall(stderr) if int(code) < 0}
    closed = set(TORCHRUN_CLOSED.findall(stderr))
    for local, code, pid in TORCHRUN_ENTRY.findall(stderr):
        if int(code) < 0 and pid not in closed:
            out.setdefault(first_rank + int(local), -int(code))
    return out


# The port was taken between free_port() and the launcher's bind.
PORT_TAKEN = re.compile(r"EADDRINUSE|[Aa]ddress already in use")


def _by_message(lines: list) -> list[str]:
    """[(rank, message)] -> `rank 0, 1: message`, one entry per distinct message."""
    same: dict[str, list[int]] = {}
    for rank, message in lines:
        ranks = same.setdefault(message.strip(), [])
        if int(rank) not in ranks:
            ranks.append(int(rank))
    return [f"rank {', '.join(map(str, sorted(r)))}: {m}" for m, r in same.items()]


# What a native library prints as it aborts: a C++ exception nobody caught (gloo's enforce
# failures among them), glibc's heap checks.
NATIVE = re.compile(r"(terminate called.*|what\(\):.*|.*\[enforce fail at.*|"
                    r"(?:double free|free\(\)|malloc\(\)|corrupted).*|"
                    r"Fatal Python error: (?!Aborted$|Segmentation fault$).*)", re.MULTILINE)


def native_message(stderr: str, limit: int = 300) -> str:
    """The most telling line a native abort left in the launch's stderr, or ''."""
    found = [m.group(1).strip() for m in NATIVE.finditer(stderr)]
    for line in found:  # the exception's own text beats "terminate called ..."
        if line.startswith(("what():", "Fatal Python error")) or "enforce fail" in line:
            return line[:limit]
    return found[0][:limit] if found else ""


def read_status(folder: str) -> tuple[dict[int, dict], set[int]]:
    """What the ranks left in the status folder: {rank: {"kind", "message"}} for the ranks that
    failed and said so, and the set of ranks that started."""
    failed, started = {}, set()
    for name in os.listdir(folder):
        match = re.fullmatch(r"rank-(\d+)\.(started|json)", name)
        if not match:
            continue
        rank = int(match.group(1))
        if match.group(2) == "started":
            started.add(rank)
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                failed[rank] = json.load(handle)
        except (OSError, ValueError):
            continue
    return failed, started


def explain_failure(failed: dict[int, dict], started: set[int], stderr: str, code: int,
                    debug: bool, first_rank: int = 0,
                    seen: Optional[dict[int, tuple[dict, float]]] = None,
                    timeout: Optional[float] = None) -> tuple[str, bool]:
    """What went wrong, in one line, from what each rank said of itself (its status file:
    usage, error, timeout or peer, measured on the rank) and which ranks started but said
    nothing. Returns the message and whether it was a usage error (exit code 2).

    The root cause comes first: a rank's own exception, or a rank that died without a word
    (with the signal torchrun saw, when it names one), or a rank its peers waited the whole
    process-group timeout for. Ranks that only lost the connection to a failed peer come
    last, briefly.

    `seen`: {rank: (its last progress report, seconds from it to the first failure)}
    (Watchdog.last_seen), and `timeout` the process-group timeout: a rank its peers waited
    for is then said to have stopped making progress where it did, or, where it was still
    making progress within half the timeout of the failure, to have been too slow to reach
    the collective; never to have stopped when it was working.
    """
    import signal as _signal

    if debug:
        sys.stderr.write(stderr)
    usage = [(r, f["message"]) for r, f in sorted(failed.items()) if f.get("kind") == "usage"]
    if usage:
        return "; ".join(_by_message(usage)), True
    # The ranks compared notes and found they differ: the message names the ranks already.
    agreed = [f["message"] for _, f in sorted(failed.items()) if f.get("kind") == "mismatch"]
    if agreed:
        return agreed[0], False
    own = [(r, f["message"]) for r, f in sorted(failed.items()) if f.get("kind") == "error"]
    waited = sorted(r for r, f in failed.items() if f.get("kind") == "timeout")
    lost = sorted(r for r, f in failed.items() if f.get("kind") == "peer")
    silent = sorted(started - set(failed))
    signals = killed_by_signal(stderr, first_rank)
    causes = _by_message(own)
    if waited:
        stalled = [r for r in silent if r not in signals] or silent
        waiters = ", ".join(map(str, waited))
        causes.append(_waited_for(stalled, waiters, seen or {}, timeout))
        silent = [r for r in silent if r not in stalled]
    for rank in silent:
        if rank in signals:
            number = signals[rank]
            try:
                name = _signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            native = native_message(stderr)
            causes.insert(0, f"rank {rank} was killed by signal {number} ({name}) and said nothing"
                          + (f" (a native library said: {native})" if native else ""))
        elif not own and not lost:
            causes.append(f"rank {rank} ended without a word")
    if lost and not causes and started and started <= set(lost):
        # Every rank failed in a collective and none had failed before it: no peer was lost,
        # the collective itself failed (what it said is the cause).
        lost_messages = [(r, failed[r]["message"]) for r in lost]
        return ("every rank failed in the same collective, none before it: "
                + "; ".join(_by_message(lost_messages))), False
    if lost:
        ranks = ", ".join(map(str, lost))
        causes.append(f"rank {ranks} then lost the connection to the failed rank"
                      if causes else f"rank {ranks} lost the connection to a peer that failed "
                      "without a message")
    if causes:
        return "; ".join(dict.fromkeys(causes)), False
    tail = [line for line in stderr.strip().splitlines() if line.strip()][-3:]
    return f"the launch exited with code {code}: " + (" | ".join(tail) or "no output"), False


def _waited_for(stalled: list[int], waiters: str, seen: dict[int, tuple[dict, float]],
                timeout: Optional[float]) -> str:
    """The cause where rank(s) `waiters` gave up at the process-group timeout waiting for the
    ranks `stalled`: what each of those was last seen doing (its progress report)."""
    gave_up = (f"rank {waiters} gave up waiting for "
               f"{'it' if len(stalled) == 1 else 'them'} at the process-group timeout "
               "(--timeout)")
    if not stalled:
        return f"a rank never reached the collective: {gave_up}"
    known = [r for r in stalled if r in seen]
    if not known:
        return f"rank {', '.join(map(str, stalled))} stopped answering: {gave_up}"
    before = f"rank {waiters} gave up"
    working, parts = False, []
    for rank in stalled:
        if rank not in seen:
            parts.append(f"rank {rank} sent no progress report")
            continue
        report, ago = seen[rank]
        if (report.get("phase") == "walking" and timeout is not None
                and ago < timeout / 2):
            working = True
            parts.append(f"rank {rank} was still making progress ({report.get('where')}, "
                         f"step {report.get('step')}, {ago:.1f} s before {before}) but did "
                         "not reach the collective in time")
        elif report.get("phase") == "walking":
            parts.append(f"rank {rank} stopped making progress at {report.get('where')}, "
                         f"step {report.get('step')} ({ago:.1f} s before {before})")
        else:
            parts.append(progress_text(rank, report, ago, before))
    hint = ("; the work between two collectives must take less than --timeout: raise it"
            if working else "")
    return f"{', '.join(parts)}: {gave_up}{hint}"


def make_launch(settings: LaunchSettings, options: dict, display_args: list[str],
                command: str = "run", check: Optional[Callable[[int], object]] = None) -> Launch:
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
    return Launch(config_file=path, num_processes=world, options=options,
                  display_args=display_args, device=device,
                  port=int(port) if port else None, command=command, num_machines=machines,
                  machine_rank=rank, main_process_ip=ip)
