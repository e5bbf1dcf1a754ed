"""The warm launcher: ranks forked from a server that imported torch and accelerate once.

A real 2-rank `accelerate launch` spends about 3 of its 5 seconds here importing torch and
accelerate in three processes (the launcher and each rank). The server (support/warm_server.py,
one for each pytest worker, started at its first launch) imports them once and forks the ranks
of each launch with the environment accelerate's launcher gives them (accelerate's own env
builder for the config, then torchrun's per-rank variables); each rank reseeds its generators
as a fresh process would. The ranks are real processes in a real gloo process group; what they
skip is the launcher process itself (its error files, its own messages; the rendezvous store
its agent hosts is forked for each launch, support/warm_server.py's serve_store), so
the tests of launching, faults and signals use the real launcher (`warm=False`). The
`sharddemo` commands run warm too (warm_command): the command is the real one, its launch of
`accelerate launch` has the server fork the ranks instead (support/warm_cli.py).
`SHARDDEMO_TEST_LAUNCHER=accelerate` sends every launch through the real launcher."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
from support.launch import ROOT, SUPPORT, free_port, launch_env

# how long a rank may stay in its script once another's ended well before the launch is ended
# and run again on the real launcher (0: the server's own STRAGGLER_S)
STRAGGLER_S: float = 0
_server: subprocess.Popen | None = None
_socket: str = ""


def server() -> subprocess.Popen:
    global _server, _socket
    if _server is None or _server.poll() is not None:
        env = launch_env()
        _server = subprocess.Popen([sys.executable, str(SUPPORT / "warm_server.py")],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   cwd=ROOT, env=env, start_new_session=True)
        atexit.register(_server.kill)
        assert _server.stdout is not None
        hello = _server.stdout.readline()
        if not hello:
            pytest.fail(f"the warm launcher did not start (exit {_server.wait()})")
        _socket = json.loads(hello)["socket"]
    return _server


def warm_command(args: list[str]) -> list[str]:
    """The command line of `sharddemo ARGS` whose launch forks its ranks from the warm server
    (support/warm_cli.py)."""
    server()
    return [sys.executable, str(SUPPORT / "warm_cli.py"), _socket, *args]


def warm_launch(args: list[str], nproc: int, config: str | None, timeout: float,
                check: bool, preload: tuple = (),
                env: dict | None = None) -> subprocess.CompletedProcess | None:
    """What `accelerate launch --config_file CONFIG --num_processes NPROC ARGS` (config None:
    `torchrun --nproc_per_node NPROC ARGS`) gives the test (its exit code, every rank's stdout
    and stderr), from forked ranks; `preload`: modules the server imports first (once); `env`:
    the launch's environment (launch_env() unless given). None where a rank hung after
    another's script had ended (warm_server.py's STRAGGLER_S): the caller runs the launch on
    the real launcher."""
    srv = server()
    saved = Snapshot(args, env)
    request = {"argv": args, "nproc": nproc, "config": config, "port": free_port(),
               "cwd": str(ROOT), "env": env or launch_env(), "timeout": timeout,
               "preload": list(preload), "straggler_s": STRAGGLER_S}
    assert srv.stdin is not None and srv.stdout is not None
    srv.stdin.write(json.dumps(request) + "\n")
    srv.stdin.flush()
    line = srv.stdout.readline()
    if not line:
        saved.drop()
        pytest.fail(f"the warm launcher ended (exit {srv.wait()}) during: {' '.join(args)}")
    reply = json.loads(line)
    cmd = (["accelerate", "launch (warm)", "--num_processes", str(nproc), *args] if config else
           ["torchrun (warm)", "--nproc_per_node", str(nproc), *args])
    if reply["timed_out"] == "straggler":
        # the teardown hang of a DDP model in a forked rank (warm_server.py's STRAGGLER_S,
        # CONTRIBUTING.md): this launch runs again on the real launcher, on its folders as
        # they were before it (Snapshot), and the warm one's stacks are a warning in the
        # test report
        restored = saved.restore()
        if restored is not None:
            pytest.fail(f"warm launch hung in a rank's end, and running it again on the real "
                        f"launcher is not safe: {restored}: {' '.join(args)}\n"
                        f"{reply['stderr'][-16000:]}")
        warnings.warn(f"warm launch hung in a rank's end; run again on the real launcher: "
                      f"{' '.join(args)}\n{reply['stderr'][-16000:]}", stacklevel=2)
        return None
    saved.drop()
    if reply["timed_out"]:
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{reply['stdout']}"
                    f"\n--- stderr (all ranks)\n{reply['stderr']}")
    proc = subprocess.CompletedProcess(cmd, reply["rc"], reply["stdout"], reply["stderr"])
    if check and proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n"
                    f"--- stderr (all ranks)\n{proc.stderr}")
    return proc


# The most a launch's folders may hold for Snapshot to copy them aside (a test's folders hold
# a few checkpoints of small models: kilobytes to a few megabytes)
SNAPSHOT_MAX_BYTES = 256 << 20
# pytest's folders under the temp dir: pytest-of-USER/pytest-N[/popen-gwK]/TEST_FOLDER
PYTEST_LEVELS = (re.compile(r"pytest-of-.+"), re.compile(r"pytest-\d+"),
                 re.compile(r"popen-gw\d+"))


class Snapshot:
    """The folders a launch may write, copied aside before it starts, so that a launch the
    straggler rule ended (warm_server.py's STRAGGLER_S) runs again on the real launcher on what
    it found, not on what its hung first run left (a lineage folder, a checkpoint). A launch's
    folders are those its arguments and the environment it is given name under the temp dir:
    each named path's test folder (pytest's tmp_path, or the first folder below the temp dir).
    Folders it names outside the temp dir are the checkout's: none is written by a launch."""

    def __init__(self, args: list[str], env: dict | None) -> None:
        words = list(args) + [v for k, v in (env or {}).items() if os.environ.get(k) != v]
        self.folders = sorted({f for w in words for f in launch_folders(str(w))})
        self.aside = Path(tempfile.mkdtemp(prefix="warm-snapshot-"))
        self.kept: dict[Path, Path | None] = {}
        self.unsafe = ""
        total = 0
        for i, folder in enumerate(self.folders):
            if not folder.exists():
                self.kept[folder] = None
                continue
            total += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            if total > SNAPSHOT_MAX_BYTES:
                self.unsafe = f"its folders hold over {SNAPSHOT_MAX_BYTES >> 20} MB"
                break
            copy = self.aside / str(i)
            shutil.copytree(folder, copy, symlinks=True)
            self.kept[folder] = copy

    def restore(self) -> str | None:
        """Each folder as it was before the launch; what stops that, where something does."""
        if self.unsafe:
            return self.unsafe
        for folder, copy in self.kept.items():
            shutil.rmtree(folder, ignore_errors=True)
            if copy is not None:
                shutil.copytree(copy, folder, symlinks=True)
        self.drop()
        return None

    def drop(self) -> None:
        shutil.rmtree(self.aside, ignore_errors=True)


def launch_folders(word: str) -> list[Path]:
    """The test folders a launch's argument names: a path under the temp dir (the whole word, or
    what follows `=` in `--option=PATH`) gives its test folder, pytest's tmp_path or the first
    folder below the temp dir."""
    temp = Path(tempfile.gettempdir()).resolve()
    found = []
    for text in {word, word.partition("=")[2]}:
        if not text.startswith("/"):
            continue
        try:
            parts = Path(text).resolve().relative_to(temp).parts
        except ValueError:
            continue
        depth = 0
        while depth < len(PYTEST_LEVELS) and depth < len(parts) - 1 \
                and PYTEST_LEVELS[depth].fullmatch(parts[depth]):
            depth += 1
        if depth < len(parts):
            found.append(temp.joinpath(*parts[:depth + 1]))
    return found
