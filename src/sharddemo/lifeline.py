"""A launch ends with the sharddemo process that started it, however that process dies.

Ctrl-C, SIGTERM and SIGHUP reach `compare` / `audit`, which end every process they started
(launch.Family). SIGKILL (a CI job's hard timeout, the OOM killer) leaves sharddemo no time to
do anything, and `accelerate launch` starts each rank in a session of its own, so no
process-group kill reaches them either: the launcher and the ranks must notice for themselves.

On Linux each asks the kernel for a parent-death signal (prctl PR_SET_PDEATHSIG): the launcher
gets SIGKILL when sharddemo dies, each rank SIGKILL when the launcher dies, so the chain comes
down within a second whatever ended its top. A parent that died before its child asked is
caught too: the child then finds that sharddemo is no longer among its ancestors, and exits.
Elsewhere (macOS, Windows: no prctl) nothing is set; a killed parent there leaves its launch
to end on its own (docs/reliability.md).

Torch-free, importing nothing of sharddemo's: the parent (launch/run.py) and the ranks (the CLI's
entry, before torch is imported) both use it.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, Optional

# <linux/prctl.h>
PR_SET_PDEATHSIG = 1


def _prctl() -> Optional[Callable[..., int]]:
    """libc's prctl, looked up once in the parent (a forked child should only call it), or
    None where there is none (not Linux, no libc to load)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.prctl
        function.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                             ctypes.c_ulong]
        function.restype = ctypes.c_int
        return function
    except (OSError, AttributeError):
        return None


def launcher_preexec(parent: int) -> Optional[Callable[[], None]]:
    """The `preexec_fn` for the launcher that sharddemo (pid `parent`) starts: SIGKILL for it
    when sharddemo dies; and where sharddemo died between the fork and this call (the kernel
    then has no parent left to watch), the child exits before it becomes the launcher. None
    where the platform has no parent-death signal."""
    prctl = _prctl()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def _parent_of(pid: int) -> Optional[int]:
    """`pid`'s parent, from /proc (None where it cannot be read: the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    # pid (comm) state ppid ...: comm may hold spaces and parentheses, so read after the last ")"
    try:
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (ValueError, IndexError):
        return None


def descends_from(ancestor: int, depth: int = 8) -> Optional[bool]:
    """Whether `ancestor` is this process's parent, grandparent, ... (up to `depth`
    generations: a rank's is its launcher's parent); None where /proc cannot tell."""
    pid = os.getppid()
    for _ in range(depth):
        if pid == ancestor:
            return True
        if pid in (0, 1):
            return False
        parent = _parent_of(pid)
        if parent is None:
            return None if not os.path.isdir("/proc/self") else False
        pid = parent
    return False


def end_with_launch(ancestor: int) -> None:
    """In a rank that sharddemo (pid `ancestor`) launched: SIGKILL for this rank when its
    launcher dies (which the launcher's own parent-death signal makes follow sharddemo's
    death); and where the chain is already broken (sharddemo or the launcher died before this
    call), exit now. Does nothing where the platform has no parent-death signal."""
    prctl = _prctl()
    if prctl is None or prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if descends_from(ancestor) is False:
        os._exit(1)
