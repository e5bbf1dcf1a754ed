"""The processes of a launch: every one of them known (Family) and ended on any way out, and
the signals (SIGINT, SIGTERM, SIGHUP) that end a launch turned into an exception (Interrupted)
so that the ending runs for each."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading

class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP reached `compare`/`audit`: every process started is ended,
    nothing is written, and the line names the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_raise(exc_type):
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

