"""A rank's progress, reported to the parent: what it last did, where and when.

Where the parent set STATUS_ENV (`sharddemo compare`, `audit`), each rank keeps one small
file in that folder, `rank-R.progress` (its format: sharddemo.progress), mapped into its
memory: a report is a store into that memory, no system call, which the parent reads from
the same page of the machine's file cache.

Progress is a batch received, an epoch's start or end, or any collective done
(rank.collect.collective); the parent's watchdog (launch.Watchdog) stops a launch only when
no rank has made any for its bound. A report costs one clock read and one
`struct.pack_into`, about a microsecond a batch (docs/benchmarks.md, "Figures behind design
choices"). Without STATUS_ENV (a rank started by hand, the watch in a user's own script)
nothing is mapped and a report returns at once.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Optional

from sharddemo.options import STATUS_ENV
from sharddemo.progress import HEAD, SIZE, WHERE_AT


class Heartbeat:
    """This rank's progress file (`path` None: report nothing).

    The file is made and mapped at the first report (rank.session.mark_started makes one), in
    the rank's own process: never in a DataLoader worker that imports this module, which would
    replace the rank's file with its own."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self.memory: Optional[mmap.mmap] = None
        self.seq = 0
        self.step = 0
        self.phase = 0

    def _map(self) -> Optional[mmap.mmap]:
        # Made whole beside its name, then renamed: the parent never sees a short file.
        path, self.path = self.path, None  # one try
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w+b") as handle:
                handle.write(bytes(SIZE))
                handle.flush()
                memory = mmap.mmap(handle.fileno(), SIZE)
            os.replace(tmp, path)
        except OSError:
            return None  # no folder to report to: nothing is reported
        self.memory = memory
        return memory

    def _memory(self) -> Optional[mmap.mmap]:
        if self.memory is None and self.path is not None:
            return self._map()
        return self.memory

    def at(self, where: str) -> None:
        """A new epoch of a loader begins here (`where`: its name and epoch): step 0."""
        memory = self._memory()
        if memory is None:
            return
        text = where.encode("utf-8")[:SIZE - WHERE_AT - 1]
        memory[WHERE_AT:WHERE_AT + 1 + len(text)] = bytes([len(text)]) + text
        self.step = 0
        self.report()

    def stepped(self, step: int) -> None:
        """This rank received its batch number `step` (1-based) of the current epoch."""
        memory = self.memory
        if memory is None:
            memory = self._memory()
            if memory is None:
                return
        self.step = step
        self.phase = self.phase or 1
        self.seq += 1
        HEAD.pack_into(memory, 0, self.seq, step, time.monotonic(), self.phase)

    def report(self) -> None:
        """Progress without a new batch (a collective done, an epoch's start or end)."""
        memory = self._memory()
        if memory is None:
            return
        self.seq += 1
        HEAD.pack_into(memory, 0, self.seq, self.step, time.monotonic(), self.phase)

    def finishing(self) -> None:
        """Every epoch walked: what is left is the trace and the teardown."""
        self.phase = 2
        self.at("the trace and teardown")


def _from_env() -> Heartbeat:
    folder = os.environ.get(STATUS_ENV)
    if not folder:
        return Heartbeat(None)
    # A process that the launcher started alone has no RANK (`sharddemo trap`): it is rank 0.
    rank = os.environ.get("RANK") or "0"
    return Heartbeat(os.path.join(folder, f"rank-{rank}.progress"))


# This process's one heartbeat (a rank is one process).
HEARTBEAT = _from_env()
