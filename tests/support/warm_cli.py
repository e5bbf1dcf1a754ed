"""The `sharddemo` command as the tests run it warm: `python warm_cli.py SOCKET ARGS` is
`python -m sharddemo ARGS`, but the command's launch of its ranks (`python -m
accelerate.commands.launch ...`, launch/run.py) starts support/warm_client.py with the same
arguments instead, which has the warm server at SOCKET fork them (support/warm_server.py).
Everything else is the command's own: its options, its watchdog, the end of its processes on
any way out, what it prints and writes."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import types

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_client.py")
LAUNCHER = ["-m", "accelerate.commands.launch"]


def main() -> None:
    path = sys.argv[1]

    class Popen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            if isinstance(args, list) and args[1:3] == LAUNCHER:
                args = [args[0], CLIENT, path, *args[3:]]
            super().__init__(args, *rest, **kwargs)

    import sharddemo.launch.run as run

    shim = types.ModuleType("subprocess")
    shim.__dict__.update(subprocess.__dict__)
    shim.Popen = Popen  # type: ignore[attr-defined]
    run.subprocess = shim  # type: ignore[attr-defined]
    sys.argv = ["sharddemo", *sys.argv[2:]]
    runpy.run_module("sharddemo", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
