"""The warm launcher's server (tests/support/warm.py starts one for each pytest worker): it
imports torch, accelerate and sharddemo once, then, for each launch it is sent, forks the ranks
and gives each the environment `accelerate launch --config_file accelerate_configs/cpu2.yaml`
gives its ranks (accelerate's own env for the config, then torchrun's per-rank variables). Each
rank is then what a launched rank is -- its own process, its own gloo rank, its own seeds --
without the 3 imports of torch and accelerate (launcher and ranks) of a real launch.

The protocol: one JSON request a line on stdin ({"argv", "nproc", "port", "cwd", "env",
"timeout", "config": an accelerate config or null for `torchrun`, "preload": modules to
import first}), one JSON reply a line on stdout ({"rc", "stdout", "stderr", "timed_out"}). The
server stays single-threaded (a fork copies only the forking thread); it ends at stdin's end."""

from __future__ import annotations

import importlib
import io
import json
import os
import signal
import sys
import tempfile
import time

# What every launched script imports anyway, imported here once, before any fork.
import accelerate  # noqa: F401
import numpy
import torch
import torch.distributed  # noqa: F401
import torch.utils.data  # noqa: F401

import sharddemo  # noqa: F401
import sharddemo.watching.state  # noqa: F401

PROTOCOL_OUT = os.fdopen(os.dup(1), "w", buffering=1)
sys.stdout = sys.stderr  # nothing of the server's own reaches the protocol's pipe


def accelerate_env(config: str, nproc: int) -> dict:
    """The environment accelerate's launcher gives the ranks for `config`, from accelerate's own
    parser and env builder (what `accelerate launch` calls before it starts torchrun)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", config, "--num_processes", str(nproc), "--main_process_port", "0",
         "script.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    # (it starts from a copy of this process's environment: keep what it adds or changes, so
    # that each launch's own environment is the rest)
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def rank_env(base: dict, launcher: dict, rank: int, nproc: int, port: int) -> dict:
    """torchrun's variables for one rank of a one-node launch (the rendezvous store is the
    launch's, serve_store's, as torchrun's agent's is)."""
    env = dict(base)
    env.update(launcher)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    })
    env.pop("MASTER_PORT_FREE", None)
    return env


def run_rank(argv: list, env: dict, cwd: str, out: str, err: str) -> None:
    """In the forked child: become the rank, run the script as `python SCRIPT ARGS` would, exit
    as the interpreter would (threads joined, atexit handlers run), never return."""
    code = 1
    try:
        os.setsid()  # its own group: a timeout kills it with its DataLoader workers
        null = os.open(os.devnull, os.O_RDONLY)  # (stdin is the server's protocol)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(0, closefd=False)
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # a hung rank's stacks, written to its stderr before the timeout kills it (launch())
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)
        # a fresh process's seeds: its own Python, numpy and torch generators
        import random

        random.seed()
        numpy.random.seed()
        torch.seed()
        import runpy

        script = os.path.abspath(argv[0])
        sys.argv = [script, *argv[1:]]
        sys.path[0] = os.path.dirname(script)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        import threading

        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve_store(port: int, nproc: int, timeout: float) -> int:
    """Fork the launch's rendezvous store, as torchrun's agent hosts it (the ranks connect to it
    as clients: TORCHELASTIC_USE_AGENT_STORE); its pid, killed when the launch ends."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        os.setsid()
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port, nproc, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout), multi_tenant=True)
        while store is not None:
            time.sleep(3600)  # (until the launch ends: SIGKILL)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)


def kill(pids: dict) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def launch(request: dict, launchers: dict) -> dict:
    nproc, argv = request["nproc"], request["argv"]
    for module in request.get("preload", ()):
        try:  # (before the fork: once for every later launch)
            importlib.import_module(module)
        except ImportError:
            pass  # (the script says so itself)
    key = (request["config"], nproc)
    if key not in launchers:
        # torchrun's own: one thread a rank where it starts several (torch.distributed.run)
        launchers[key] = accelerate_env(*key) if request["config"] else {"OMP_NUM_THREADS": "1"}
    folder = tempfile.mkdtemp(prefix="warm-")
    outs = [(os.path.join(folder, f"out{r}"), os.path.join(folder, f"err{r}"))
            for r in range(nproc)]
    sys.stderr.flush()
    store = serve_store(request["port"], nproc, request["timeout"])
    pids: dict = {}
    for r in range(nproc):
        env = rank_env(request["env"], launchers[key], r, nproc, request["port"])
        pid = os.fork()
        if pid == 0:
            run_rank(argv, env, request["cwd"], *outs[r])
        pids[pid] = r
    deadline = time.monotonic() + request["timeout"]
    codes: dict = {}
    timed_out = False
    failed_at = None
    while len(codes) < nproc:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                hung = {p: r for p, r in pids.items() if pids[p] not in codes}
                for p in hung:
                    try:
                        os.kill(p, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
                time.sleep(1)
                kill(hung)
                for p in pids:
                    if pids[p] not in codes:
                        os.waitpid(p, 0)
                        codes[pids[p]] = -9
                break
            # as torchrun's agent does: a failed rank ends the others (SIGTERM, then SIGKILL)
            if failed_at is not None and now > failed_at + 5:
                kill({p: r for p, r in pids.items() if pids[p] not in codes})
            time.sleep(0.02)
            continue
        if pid not in pids:
            continue
        code = os.waitstatus_to_exitcode(status)
        codes[pids[pid]] = code
        if code != 0 and failed_at is None:
            failed_at = time.monotonic()
            for p, r in pids.items():
                if r not in codes:
                    try:
                        os.killpg(p, signal.SIGTERM)
                    except (ProcessLookupError, PermissionError):
                        pass
    kill({store: None})
    try:
        os.waitpid(store, 0)
    except ChildProcessError:
        pass  # (it ended early, reaped in the loop above)
    stdout = stderr = ""
    for r, (out, err) in enumerate(outs):
        with open(out, errors="replace") as f:
            stdout += f.read()
        with open(err, errors="replace") as f:
            stderr += f.read()
        os.remove(out)
        os.remove(err)
    os.rmdir(folder)
    bad = {r: c for r, c in sorted(codes.items()) if c != 0}
    for r, c in bad.items():
        name = f" ({signal.Signals(-c).name})" if c < 0 and -c in signal.Signals._value2member_map_ \
            else ""
        stderr += f"[warm launcher] rank {r} exited with {c}{name}\n"
    return {"rc": 1 if bad else 0, "stdout": stdout, "stderr": stderr, "timed_out": timed_out}


def main() -> None:
    launchers: dict = {}
    for line in sys.stdin:
        reply = launch(json.loads(line), launchers)
        PROTOCOL_OUT.write(json.dumps(reply) + "\n")
        PROTOCOL_OUT.flush()


if __name__ == "__main__":
    main()
