"""Starting processes from a test: `accelerate launch`, the `sharddemo` CLI, `sharddemo audit`,
any command, each with a free port, a short process-group timeout, an outer timeout (a hang fails
the test) and every rank's output shown when a launch fails.

Only tests under tests/ranks/ may call these (tests/conftest.py fails any other test that starts
a process); the scripts they launch are in tests/scripts/."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_CONFIG = str(ROOT / "accelerate_configs" / "cpu2.yaml")
# The longest any launch in the suite may take before the test fails (a hang ends here).
OUTER_TIMEOUT = 180


def free_port() -> int:
    from sharddemo.launch import free_port as _free

    return _free()


def launch_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("SHARDDEMO_DEBUG", None)
    return env


def use_warm(warm: bool | None, env: dict | None = None) -> bool:
    """Whether a launch forks its ranks from the warm launcher (support/warm.py): as the test asks
    (`warm=`), else warm (every helper but run_cmd); SHARDDEMO_TEST_LAUNCHER=warm or
    =accelerate decides for every launch of the run. The tests of the launcher itself, of
    faults and of signals ask for the real one (`warm=False`). A forked rank hangs now and then
    in a DDP model's teardown: the server then ends the launch, and the helper runs it again on
    the real launcher, on its folders as they were before it (support/warm.py's Snapshot;
    CONTRIBUTING.md). A launch whose `env` puts something on PYTHONPATH (a test's plugin, run
    as each process starts: support/collideplugin, faultplugin, hideplugin) is always real: a
    forked rank has started already."""
    if env is not None and env.get("PYTHONPATH") != os.environ.get("PYTHONPATH"):
        return False
    chosen = os.environ.get("SHARDDEMO_TEST_LAUNCHER")
    if chosen in ("warm", "accelerate"):
        return chosen == "warm"
    return warm is not False


def accelerate_launch(args: list[str], nproc: int = 2, timeout: float = OUTER_TIMEOUT,
                      check: bool = True, config: str = CPU_CONFIG,
                      warm: bool | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file cpu2.yaml --num_processes N --main_process_port FREE ARGS`.

    By default (use_warm) the ranks are forked by the warm launcher (support/warm.py: the same
    processes, process group and environment, without importing torch and accelerate three
    times a launch, nor the script's frameworks: heavy_imports); `warm=False`, or
    SHARDDEMO_TEST_LAUNCHER=accelerate: the real `accelerate launch`."""
    if use_warm(warm) and config == CPU_CONFIG and args \
            and args[0].endswith(".py"):
        from support.warm import warm_launch

        proc = warm_launch(args, nproc=nproc, config=config, timeout=timeout, check=check,
                           preload=heavy_imports(args[0]))
        if proc is not None:
            return proc
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
           "--num_processes", str(nproc), "--main_process_port", str(free_port()), *args]
    return run_cmd(cmd, timeout=timeout, check=check)


def torchrun(args: list[str], nproc: int = 2, timeout: float = OUTER_TIMEOUT, check: bool = True,
             preload: tuple = (), warm: bool | None = None,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N --master_port FREE SCRIPT ARGS` (`python -m
    torch.distributed.run`), its ranks forked by the warm launcher as accelerate_launch's are
    (`preload`: modules it imports once first, e.g. Lightning; `warm=False`: the real torchrun)."""
    if use_warm(warm, env=env):
        from support.warm import warm_launch

        proc = warm_launch([str(a) for a in args], nproc=nproc, config=None, timeout=timeout,
                           check=check, preload=preload, env=env)
        if proc is not None:
            return proc
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), *map(str, args)]
    return run_cmd(cmd, timeout=timeout, check=check, env=env)


def lightning_fit(args: list[str], devices: int = 2, timeout: float = OUTER_TIMEOUT,
                  warm: bool | None = None) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` for a script whose Lightning Trainer (devices=`devices`, DDP) starts
    its ranks itself. Warm: the ranks are forked with torchrun's variables instead, so Lightning
    takes them as launched (its TorchElasticEnvironment) and starts none, Lightning imported
    once (heavy_imports); `warm=False`: Lightning's own launcher."""
    if use_warm(warm):
        return torchrun(args, nproc=devices, timeout=timeout, check=False,
                        preload=heavy_imports(str(args[0])))
    return run_cmd([sys.executable, *map(str, args)], timeout=timeout, check=False)


# The frameworks a launched script may import whose import costs seconds a process (6 s of CPU
# for Lightning's or the Trainer's, against 2 for torch and accelerate): the warm launcher
# imports them once, before it forks (every later launch of that pytest worker has them)
HEAVY = ("pytorch_lightning", "lightning", "transformers")


@functools.lru_cache(maxsize=None)
def heavy_imports(script: str) -> tuple:
    """The modules of HEAVY that `script` (a path from the checkout) imports, anywhere in it
    (a `try:`'s optional ones too)."""
    import ast

    path = ROOT / script
    if not path.is_file():
        return ()
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        found += [n.split(".")[0] for n in names if n.split(".")[0] in HEAVY]
    return tuple(dict.fromkeys(found))


def run_cmd(cmd: list[str], timeout: float = OUTER_TIMEOUT, check: bool = True,
            env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=env or launch_env(), cwd=ROOT, stdin=subprocess.DEVNULL,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{exc.stdout}\n"
                    f"--- stderr (all ranks)\n{exc.stderr}")
    if check and proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n"
                    f"--- stderr (all ranks)\n{proc.stderr}")
    return proc


def sharddemo(args: list[str], timeout: float = OUTER_TIMEOUT, check: bool = True,
              env: dict | None = None, warm: bool | None = None) -> subprocess.CompletedProcess:
    """`python -m sharddemo ARGS`. Its launch of the ranks forks them from the warm launcher
    (support/warm_cli.py: the command itself is the real one) unless `warm=False` (the tests
    of the launcher itself: its messages, faults, signals) or SHARDDEMO_TEST_LAUNCHER=accelerate."""
    if use_warm(warm, env=env):
        from support.warm import warm_command

        return run_cmd(warm_command(args), timeout=timeout, check=check, env=env)
    return run_cmd([sys.executable, "-m", "sharddemo", *args], timeout=timeout, check=check,
                   env=env)


# A process that has done all its work and written everything sometimes aborts in the
# interpreter's teardown: a native thread left joinable ("terminate called without an active
# exception", SIGABRT; docs/reliability.md). sharddemo's own ranks end with os._exit; a user's
# training script (the watch tests run the examples as users do) does not.
TEARDOWN_ABORT = "terminate called without an active exception"


def ended_or_aborted_at_teardown(proc: subprocess.CompletedProcess) -> bool:
    """Exit 0, or the teardown abort above and nothing else (no rank's Python traceback); the
    caller then checks that every output is whole."""
    if proc.returncode == 0:
        return True
    ranks_raised = any(line.startswith("[rank") and "Traceback" in line
                       for line in proc.stderr.splitlines())
    aborted = proc.returncode in (-6, 134) or "SIGABRT" in proc.stderr  # itself, or a rank
    return TEARDOWN_ABORT in proc.stderr and aborted and not ranks_raised


# the programs the tests launch (as processes of their own), and the helpers' folder
SCRIPTS = ROOT / "tests" / "scripts"
SUPPORT = ROOT / "tests" / "support"

# `sharddemo audit` as the audit tests run it (tests/ranks/test_audit.py, test_audit_parts.py)
FACTORIES = str(SUPPORT / "factories.py")
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


def audit(target, *args, check=True, nproc=2):
    """`sharddemo audit TARGET --format json`; every report it prints must validate."""
    import jsonschema

    proc = sharddemo(["audit", target, "--num-processes", str(nproc), "--format", "json", *args],
                     check=False)
    if check and proc.returncode not in (0, 1):
        pytest.fail(f"audit exited {proc.returncode}\n{proc.stderr}")
    if proc.returncode in (0, 1) and proc.stdout.strip():
        jsonschema.validate(json.loads(proc.stdout), SCHEMA)
    return proc


def verdicts(proc):
    report = json.loads(proc.stdout)
    out = {}
    for v in report["modes"]["audit"]["verdicts"]:
        out[v["verdict"]] = out.get(v["verdict"], True) and v["ok"]
    return report, out


def transformers_older_than(version: str) -> bool:
    """The installed transformers is older than `version` (call it where transformers is
    installed: after pytest.importorskip("transformers"))."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) < Version(version)
