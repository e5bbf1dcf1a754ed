"""The progress bar a person sees while a launch runs: one tqdm bar on stderr, fed by the
main rank's `sharddemo-progress` lines on its stdout (rank.walk writes them)."""

from __future__ import annotations

import os
import sys
import time

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
