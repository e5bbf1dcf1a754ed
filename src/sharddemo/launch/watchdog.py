"""The watchdog on the ranks' progress: a launch is stopped only when no rank has made
progress for longer than its bound (docs/reliability.md). The ranks' reports are the files
rank.heartbeat writes in the status folder, laid out by sharddemo.progress."""

from __future__ import annotations

import os
import re
import time
from typing import Optional

from sharddemo.progress import SIZE, read_report

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

