"""Helpers for the tests that start real ranks: free ports, short timeouts, outer timeouts,
and every rank's output shown when a launch fails."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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


def accelerate_launch(args: list[str], nproc: int = 2, timeout: float = OUTER_TIMEOUT,
                      check: bool = True, config: str = CPU_CONFIG) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file cpu2.yaml --num_processes N --main_process_port FREE ARGS`."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
           "--num_processes", str(nproc), "--main_process_port", str(free_port()), *args]
    return run_cmd(cmd, timeout=timeout, check=check)


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
              env: dict | None = None) -> subprocess.CompletedProcess:
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


# `sharddemo audit` as the audit tests run it (tests/test_audit.py, tests/test_audit_parts.py)
FACTORIES = str(ROOT / "tests" / "factories.py")
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


# -- the `ranks` marker: tests that start processes (real ranks, the CLI, an install) ----------
# `python -m pytest -m "not ranks"` is the fast subset (one process, about a minute). A test is
# marked where its own code, or a fixture it uses, calls one of these.
STARTS_PROCESSES = ("accelerate_launch(", "sharddemo(", "audit(", "run_cmd(", "subprocess.", "run_launch(",
                    "Popen(", "debug_launcher(")


def _starts_processes(func, fixtures: dict, seen: set) -> bool:
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    if any(word in source for word in STARTS_PROCESSES):
        return True
    # the helpers it calls that the tests define (a module's own launch helper)
    names = set(getattr(getattr(func, "__code__", None), "co_names", ()))
    for code in getattr(getattr(func, "__code__", None), "co_consts", ()):
        names |= set(getattr(code, "co_names", ()))  # a lambda's or an inner function's
    for name in names:
        helper = getattr(func, "__globals__", {}).get(name)
        if inspect.isfunction(helper) and "tests" in Path(inspect.getfile(helper)).parts \
                and id(helper) not in seen:
            seen.add(id(helper))
            if _starts_processes(helper, fixtures, seen):
                return True
        if inspect.isclass(helper) and id(helper) not in seen:
            seen.add(id(helper))  # a module's launching class (a resume chain)
            try:
                ours = "tests" in Path(inspect.getfile(helper)).parts
                source = inspect.getsource(helper) if ours else ""
            except (OSError, TypeError):  # (a class built into Python or an extension)
                source = ""
            if any(word in source for word in STARTS_PROCESSES):
                return True
    for name in inspect.signature(func).parameters:
        for definition in fixtures.get(name, ()):
            if id(definition) not in seen:
                seen.add(id(definition))
                if _starts_processes(definition.func, fixtures, seen):
                    return True
    return False


def pytest_configure(config):
    config.addinivalue_line("markers", "ranks: starts processes (real ranks, the CLI, pip); "
                                       "-m 'not ranks' runs the rest in about a minute")


def pytest_collection_modifyitems(config, items):
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        fixtures = dict(info.name2fixturedefs) if info is not None else {}
        if _starts_processes(item.function, fixtures, set()):
            item.add_marker(pytest.mark.ranks)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray session per test module (tests/test_ray*.py, which skip without ray): 2
    CPUs for the 2 workers, whose loop is imported from tests/ray_loop.py."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}})
    yield
    ray.shutdown()


def transformers_older_than(version: str) -> bool:
    """The installed transformers is older than `version` (call it where transformers is
    installed: after pytest.importorskip("transformers"))."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) < Version(version)
