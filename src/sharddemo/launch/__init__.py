"""Start the Accelerate script with `accelerate launch`, watch it, collect its trace.

The ranks run in their own process session, so that a timeout, a failed rank or a Ctrl-C
here takes all of them down; nothing is left running. A SIGKILL here, which no code of ours
outlives, takes them down too: the launcher and the ranks end with their parent
(sharddemo.lifeline).

One module per part of a launch:

- command.py: what to launch (LaunchSettings, Launch, make_launch) and a free port;
- run.py: run_launch, which runs one launch and returns its trace;
- processes.py: every process the launch started (Family), ended on any way out;
- watchdog.py: the ranks' progress, and when a launch that makes none is stopped (Watchdog);
- progressbar.py: the bar a person sees (ProgressBar);
- failures.py: a failed launch in one line (explain_failure), from the ranks' status files
  and torchrun's stderr.
"""

from __future__ import annotations

from sharddemo.launch.command import Launch, LaunchSettings, free_port, make_launch
from sharddemo.launch.failures import explain_failure, killed_by_signal, read_status
from sharddemo.launch.processes import Family, Interrupted
from sharddemo.launch.progressbar import ProgressBar
from sharddemo.launch.run import run_launch
from sharddemo.launch.watchdog import Watchdog, progress_bound, start_bound

__all__ = ["Family", "Interrupted", "Launch", "LaunchSettings", "ProgressBar", "Watchdog",
           "explain_failure", "free_port", "killed_by_signal", "make_launch", "progress_bound",
           "read_status", "run_launch", "start_bound"]
