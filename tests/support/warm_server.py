"""The warm launcher's server (tests/support/warm.py starts one for each pytest worker): it
imports torch, accelerate and sharddemo once, then, for each launch it is sent, forks the ranks
and gives each the environment `accelerate launch --config_file accelerate_configs/cpu2.yaml`
gives its ranks (accelerate's own env for the config, then torchrun's per-rank variables). Each
rank is then what a launched rank is -- its own process, its own gloo rank, its own seeds --
without the 3 imports of torch and accelerate (launcher and ranks) of a real launch.

The protocol: its first line on stdout is {"socket": PATH}; then one JSON request a line on
stdin ({"argv", "nproc", "port", "cwd", "env", "timeout", "config": an accelerate config or null
for `torchrun`, "preload": modules to import first}), one JSON reply a line on stdout ({"rc",
"stdout", "stderr", "timed_out"}).

The socket at PATH takes the launches of the `sharddemo` commands the tests run
(support/warm_cli.py: the command's `accelerate launch` is support/warm_client.py instead), one
connection a launch: the request {"launch": the `accelerate launch` arguments, "env", "cwd",
"timeout"} with the client's stdout and stderr passed along (SCM_RIGHTS), so that the ranks
write to them as a launcher's ranks write to its own; the reply {"rc"}, or {"real": true} where
accelerate would not start the ranks with torchrun on this one machine (its simple launcher:
one process; several machines), which the client then runs itself. The client's end (the
command ended its launch: a stall, a signal) ends the ranks, as the launcher's death does.
The server stays single-threaded (a fork copies only the forking thread); it ends at stdin's
end."""

from __future__ import annotations

import importlib
import io
import json
import os
import select
import selectors
import signal
import socket
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
    env, _ = launch_plan(["--config_file", config, "--num_processes", str(nproc),
                          "--main_process_port", "0", "script.py"])
    assert env is not None
    return env


def launch_plan(words: list) -> tuple:
    """`accelerate launch WORDS` read by accelerate's own parser: (the environment its
    launcher gives the ranks, accelerate's parsed arguments), the environment None where
    accelerate would not start the ranks with torchrun on this machine alone (its
    multi_gpu_launcher: a config of several GPUs, or of CPUs as accelerate_configs/cpu2.yaml
    is), e.g. `--cpu` (its simple launcher: one process) or several machines."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(words)
    args, _, _ = _validate_launch_command(args)
    if not args.multi_gpu or args.cpu or args.use_deepspeed or args.use_fsdp \
            or args.use_megatron_lm or (args.num_machines or 1) > 1:
        return None, args
    env = prepare_multi_gpu_env(args)
    # (it starts from a copy of this process's environment: keep what it adds or changes, so
    # that each launch's own environment is the rest)
    return {k: v for k, v in env.items() if os.environ.get(k) != v}, args


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


def run_rank(argv: list, env: dict, cwd: str, out, err, hold: tuple = ()) -> None:
    """In the forked child: become the rank, run the script as `python SCRIPT ARGS` (`-m
    MODULE ARGS`: as `python -m MODULE ARGS`) would, exit as the interpreter would (threads
    joined, atexit handlers run), never return. `out`, `err`: the files its stdout and stderr
    go to, by path, or open descriptors (a client's own: written to as they are). `hold`: the
    launch's pipes (fork_ranks), by which a rank whose script ended well waits for the others'
    to end before it exits."""
    code = 1
    try:
        os.setsid()  # its own group: a timeout kills it with its DataLoader workers
        null = os.open(os.devnull, os.O_RDONLY)  # (stdin is the server's protocol)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(0, closefd=False)
        for fd, path in ((1, out), (2, err)):
            if isinstance(path, int):
                os.dup2(path, fd)
                continue
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        tempfile.tempdir = None  # (the server's was looked up: this rank's TMPDIR, as it starts)
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

        try:
            if argv[0] == "-m":  # (python -m: the folder it starts in first on the path)
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                script = os.path.abspath(argv[0])
                sys.argv = [script, *argv[1:]]
                sys.path[0] = os.path.dirname(script)
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
            if hold and code == 0:
                hold_until_all_ended(*hold)
        finally:
            os._exit(code)


def hold_until_all_ended(done: int, go: int) -> None:
    """A rank whose script ended well says so (`done`) and waits until the server has heard
    it of every rank (`go` closes), then exits: no rank leaves while another's script runs,
    as a real rank's slow interpreter teardown mostly ensures, and the server knows when
    each script ended (its straggler rule, STRAGGLER_S: a rank still in its script long after
    another's ended is the DDP teardown hang of CONTRIBUTING.md, which holding the peers did
    not prevent). A failed rank is not held (the server ends the others, as torchrun does)."""
    try:
        os.write(done, b".")
        select.select([go], [], [], 300)  # (EOF once every rank is done; the server's end)
    except OSError:
        pass


def serve_store(port: int, nproc: int, timeout: float) -> int:
    """Fork the launch's rendezvous store, as torchrun's agent hosts it (the ranks connect to it
    as clients: TORCHELASTIC_USE_AGENT_STORE); its pid, killed when the launch ends."""
    server = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        die_with_server(server)
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


def native_stacks(pids: dict) -> str:
    """Each hung rank's native stacks (gdb's, where gdb is installed), for the launch's stderr:
    what faulthandler's Python stacks leave out."""
    import shutil
    import subprocess

    gdb = shutil.which("gdb")
    text = ""
    for pid, rank in pids.items():
        if gdb is None:
            break
        try:
            ran = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                                 capture_output=True, text=True, timeout=30)
            out = ran.stdout + ran.stderr
        except (OSError, subprocess.TimeoutExpired):
            continue
        frames: list = []
        depth = 0
        for line in out.splitlines():  # (each thread's 16 innermost frames: where it waits)
            if line.startswith("Thread"):
                frames.append(line)
                depth = 0
            elif line.startswith("#") and depth < 16:
                frames.append(line[:200])
                depth += 1
            elif "ptrace" in line or "attach" in line.lower():  # (why there are none)
                frames.append(line[:200])
        text += "\n".join([f"[warm launcher] rank {rank}'s native stacks:", *frames, ""])
    return text


def die_with_server(server: int) -> None:
    """In a forked child: SIGKILL for it when the server dies (the kernel's parent-death
    signal), so that no rank or store outlives a server that ended abruptly; at once where
    the server is already gone."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != server:
        os._exit(1)


def kill(pids: dict) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def fork_ranks(argv: list, nproc: int, base: dict, launcher: dict, port: int, cwd: str,
               outs: list) -> tuple:
    """The launch's ranks forked, each with `base` (the launch's environment), `launcher`
    (what accelerate's launcher adds) and torchrun's variables: ({pid: rank}, the server's
    ends of the pipes that hold a rank until every rank's script has ended: run_rank)."""
    sys.stderr.flush()
    pids: dict = {}
    done_r, done_w = os.pipe()
    go_r, go_w = os.pipe()
    server = os.getpid()
    for r in range(nproc):
        env = rank_env(base, launcher, r, nproc, port)
        pid = os.fork()
        if pid == 0:
            die_with_server(server)
            os.close(done_r)
            os.close(go_w)
            run_rank(argv, env, cwd, *outs[r], hold=(done_w, go_r))
        pids[pid] = r
    os.close(done_w)
    os.close(go_r)
    os.set_blocking(done_r, False)
    return pids, [done_r, go_w]


def wait_ranks(pids: dict, hold: list, timeout: float,
               client: socket.socket | None = None, straggler_s: float = 0) -> tuple:
    """Wait for every rank: ({rank: exit code}, whether the launch timed out ("straggler":
    a rank still in its script STRAGGLER_S after another's ended), the hung ranks' native
    stacks). The ranks held
    at their end (`hold`, fork_ranks) are let go once every rank has ended its script or
    exited. As torchrun's agent does, a failed rank ends the others (SIGTERM, then SIGKILL 5 s
    later); a launch past `timeout` has its hung ranks' stacks written (faulthandler), then is
    killed; a `client` whose end closes (its command ended the launch) has every rank killed,
    as a launcher's death does."""
    try:
        return wait_held(pids, hold, timeout, client, straggler_s or STRAGGLER_S)
    finally:
        for fd in hold:
            if fd >= 0:
                os.close(fd)


# How long the other ranks may go on once one rank's script has ended well: the ranks of a
# launch end together (their last collectives bind them), a few seconds apart at most; a
# launch ended by it runs again on the real launcher (support/warm.py), so one taken for a
# straggler wrongly costs time, not a result
STRAGGLER_S = 15


def wait_held(pids: dict, hold: list, timeout: float, client: socket.socket | None,
              straggler_s: float) -> tuple:
    nproc = len(pids)
    done = 0
    deadline = time.monotonic() + timeout
    codes: dict = {}
    timed_out: bool | str = False
    failed_at = None
    first_done = None
    stacks = ""
    while len(codes) < nproc:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if hold[1] >= 0:
                try:
                    done += len(os.read(hold[0], 64))
                except BlockingIOError:
                    pass
                if done + len(codes) >= nproc:
                    os.close(hold[1])  # (every script has ended: the held ranks exit)
                    hold[1] = -1
                elif done and first_done is None:
                    first_done = now
            if first_done is not None and hold[1] >= 0 and now > first_done + straggler_s:
                # a rank still in its script long after another's ended well: the teardown
                # hang of a DDP model in a forked rank (hold_until_all_ended); the launch is
                # "timed out" as "straggler" (support/warm.py runs it again on the real launcher)
                deadline = min(deadline, now)
                timed_out = "straggler"
            if now >= deadline:
                timed_out = timed_out or True
                hung = {p: r for p, r in pids.items() if pids[p] not in codes}
                for p in hung:
                    try:
                        os.kill(p, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
                time.sleep(1)
                stacks = native_stacks(hung)
                kill(hung)
                for p in pids:
                    if pids[p] not in codes:
                        os.waitpid(p, 0)
                        codes[pids[p]] = -9
                break
            if client is not None and closed(client):
                kill({p: r for p, r in pids.items() if pids[p] not in codes})
                failed_at = failed_at or now
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
    return codes, timed_out, stacks


def closed(client: socket.socket) -> bool:
    """Whether the client's end of the connection is closed (it sends nothing after its
    request)."""
    readable, _, _ = select.select([client], [], [], 0)
    if not readable:
        return False
    try:
        return client.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def end_store(store: int) -> None:
    kill({store: None})
    try:
        os.waitpid(store, 0)
    except ChildProcessError:
        pass  # (it ended early, reaped in the loop above)


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
    store = serve_store(request["port"], nproc, request["timeout"])
    pids, hold = fork_ranks(argv, nproc, request["env"], launchers[key], request["port"],
                            request["cwd"], outs)
    codes, timed_out, stacks = wait_ranks(pids, hold, request["timeout"],
                                          straggler_s=request.get("straggler_s", 0))
    end_store(store)
    stdout = stderr = ""
    for r, (out, err) in enumerate(outs):
        with open(out, errors="replace") as f:
            stdout += f.read()
        with open(err, errors="replace") as f:
            stderr += f.read()
        os.remove(out)
        os.remove(err)
    os.rmdir(folder)
    stderr += stacks + exit_lines(codes)
    bad = {r: c for r, c in codes.items() if c != 0}
    return {"rc": 1 if bad else 0, "stdout": stdout, "stderr": stderr, "timed_out": timed_out}


def exit_lines(codes: dict) -> str:
    """A line for each rank that exited other than 0."""
    lines = ""
    for r, c in sorted(codes.items()):
        if c:
            name = f" ({signal.Signals(-c).name})" if c < 0 and \
                -c in signal.Signals._value2member_map_ else ""
            lines += f"[warm launcher] rank {r} exited with {c}{name}\n"
    return lines


def launch_for_client(client: socket.socket) -> None:
    """One launch of a `sharddemo` command (support/warm_client.py: the module docstring's
    socket protocol), replied to on `client`."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, more, _, _ = socket.recv_fds(client, 1 << 20, 2)
        if not chunk:
            return
        data += chunk
        fds += more
    request = json.loads(data)
    try:
        env, args = launch_plan([*request["launch"]])
        if env is None or len(fds) != 2:
            client.sendall(json.dumps({"real": True}).encode() + b"\n")
            return
        nproc, port = args.num_processes, args.main_process_port
        argv = (["-m", args.training_script] if args.module else [args.training_script]) + \
            list(args.training_script_args)
        base = dict(request["env"])
        # the rank's lifeline (sharddemo.lifeline) holds on to its parent, this server, which
        # kills it when the client's end closes
        if "SHARDDEMO_PARENT_PID" in base:
            base["SHARDDEMO_PARENT_PID"] = str(os.getpid())
        store = serve_store(port, nproc, request["timeout"])
        pids, hold = fork_ranks(argv, nproc, base, env, port, request["cwd"], [fds] * nproc)
        codes, timed_out, stacks = wait_ranks(pids, hold, request["timeout"], client)
        end_store(store)
        os.write(fds[1], (stacks + exit_lines(codes)).encode())
        if timed_out:
            os.write(fds[1], f"[warm launcher] timed out after {request['timeout']} s\n".encode())
        bad = {r: c for r, c in codes.items() if c != 0}
        try:
            client.sendall(json.dumps({"rc": 1 if bad else 0}).encode() + b"\n")
        except OSError:
            pass  # (the client is gone: its command ended the launch)
    finally:
        for fd in fds:
            os.close(fd)


def main() -> None:
    launchers: dict = {}
    folder = tempfile.mkdtemp(prefix="warm-server-")
    path = os.path.join(folder, "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    PROTOCOL_OUT.write(json.dumps({"socket": path}) + "\n")
    PROTOCOL_OUT.flush()
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)
    selector.register(listener, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is listener:
                    client, _ = listener.accept()
                    with client:
                        launch_for_client(client)
                    continue
                line = sys.stdin.readline()
                if not line:
                    return
                reply = launch(json.loads(line), launchers)
                PROTOCOL_OUT.write(json.dumps(reply) + "\n")
                PROTOCOL_OUT.flush()
    finally:
        listener.close()
        os.remove(path)
        os.rmdir(folder)


if __name__ == "__main__":
    main()
