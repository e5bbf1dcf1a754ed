"""Finding every process a launch started (a unique token in its environment) and injecting a
fault into a launch (tests/support/faultplugin on its PYTHONPATH)."""

from __future__ import annotations

import os
import time
import uuid

import psutil
from support.launch import SUPPORT, launch_env

FAULT_PLUGIN = str(SUPPORT / "faultplugin")


def tagged_env(fault: str | None = None) -> tuple[dict, str]:
    """An environment with a unique token, to find every process the run started, and, with
    `fault` (HOW:RANK:MODE:EPOCH), the test-only fault plugin (tests/support/faultplugin)."""
    token = uuid.uuid4().hex
    env = launch_env()
    env["SHARDDEMO_TEST_TOKEN"] = token
    if fault:
        env["SHARDDEMO_TEST_FAULT"] = fault
        env["PYTHONPATH"] = os.pathsep.join(p for p in (FAULT_PLUGIN, env.get("PYTHONPATH")) if p)
    return env, token


def survivors(token: str) -> list:
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get("SHARDDEMO_TEST_TOKEN") == token and proc.pid != os.getpid():
                left.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return left


def assert_nothing_left(token: str) -> None:
    deadline = time.monotonic() + 5
    while survivors(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = survivors(token)
    assert not left, f"processes left running: {[p.info['cmdline'] for p in left]}"
