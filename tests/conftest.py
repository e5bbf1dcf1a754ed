"""The suite's two layers, kept apart by folder: tests/unit/ runs in the test's own process,
tests/ranks/ starts processes (real ranks, the CLI, pip, a Ray session).

Every test under tests/ranks/ is marked `ranks` here, by its folder (the marker is declared in
setup.cfg); no other test may carry the marker, and no other test may start a process: while an
unmarked test runs, starting one raises, and the test fails in its teardown even where the code
under test caught that error. So `python -m pytest -m "not ranks"` (the fast subset, about a
minute) never starts a rank. Processes a test does not start itself are allowed: DataLoader
workers (forked by multiprocessing, not by subprocess)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

RANKS = Path(__file__).resolve().parent / "ranks"


def in_ranks_folder(item: pytest.Item) -> bool:
    return RANKS in Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(config, items):
    for item in items:
        if in_ranks_folder(item):
            item.add_marker(pytest.mark.ranks)
        elif item.get_closest_marker("ranks") is not None:
            raise pytest.UsageError(f"{item.nodeid} is marked `ranks` but is not under tests/ranks/: "
                                    "the folder is the marker; move the test there")


# -- the guard: an unmarked test that starts a process fails ---------------------------------
# Popen._execute_child is where every subprocess (run, check_output, Popen, and so every
# launch helper in support/launch.py) starts its child, whatever name the caller imported.
_running: pytest.Item | None = None  # the test being set up, run or torn down, where unmarked
_started: list[str] = []  # what it tried to start
_execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]


class StartsProcesses(RuntimeError):
    """A test outside tests/ranks/ started a process."""


def _guarded_execute_child(self, args, *rest, **kwargs):
    if _running is not None:
        command = args if isinstance(args, (str, bytes)) else " ".join(map(str, args))
        _started.append(command)
        raise StartsProcesses(f"{_running.nodeid} starts a process ({command}) but is not marked "
                              "`ranks`: move it to tests/ranks/")
    return _execute_child(self, args, *rest, **kwargs)


def pytest_configure(config):
    subprocess.Popen._execute_child = _guarded_execute_child  # type: ignore[attr-defined]


def pytest_unconfigure(config):
    subprocess.Popen._execute_child = _execute_child  # type: ignore[attr-defined]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    global _running
    _running = None if item.get_closest_marker("ranks") is not None else item
    _started.clear()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    global _running
    _running = None
    if _started:
        started = list(_started)
        _started.clear()
        pytest.fail(f"{item.nodeid} is not marked `ranks` (it is not under tests/ranks/) but "
                    f"started a process: {started}", pytrace=False)


@pytest.fixture
def fresh_accelerate_state():
    """The Trainer built in-process makes an Accelerator; leave no state for other tests."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray session per test module (tests/ranks/test_ray.py and test_ray_data.py,
    which skip without ray): 2 CPUs for the 2 workers, whose loop they import from
    tests/support/ray_loop.py (the session's PYTHONPATH is tests/, for `support`)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}})
    yield
    ray.shutdown()
