"""Installs and runs anywhere a user would put it: a non-editable wheel install works from a
directory outside the checkout (compare and audit), and every import is declared (pip check)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from support.launch import ROOT, launch_env, run_cmd


def test_pip_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """The wheel, built here and installed (not editable) into a new venv. Its dependencies
    come from this environment's site-packages through a .pth file (a venv of its own would
    download torch again); sharddemo itself comes only from the wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    run_cmd([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
             "-w", str(tmp / "dist"), str(ROOT)], timeout=300)
    wheel = next((tmp / "dist").glob("sharddemo-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "sharddemo/configs/cpu2.yaml" in names and "sharddemo/configs/2gpu.yaml" in names
    assert any(n.endswith("/licenses/LICENSE") or n.endswith("/LICENSE") for n in names), names
    venv = tmp / "venv"
    run_cmd([sys.executable, "-m", "venv", str(venv)], timeout=120)
    python = venv / "bin" / "python"
    site = run_cmd([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    (Path(site.stdout.strip()) / "deps-from-test-env.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    run_cmd([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
            timeout=300)
    outside = tmp / "elsewhere"
    outside.mkdir()
    return venv, outside


def _run_outside(venv: Path, outside: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = launch_env()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(venv / "bin" / "sharddemo"), *args], cwd=outside, env=env,
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    return proc


def test_wheel_install_runs_compare_from_outside_the_checkout(wheel_venv):
    venv, outside = wheel_venv
    where = _run_outside(venv, outside, ["configs", "--path", "cpu2.yaml"])
    assert where.returncode == 0, where.stderr
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout  # the installed copy
    proc = _run_outside(venv, outside, ["compare", "--epochs", "1", "--modes", "sampler"])
    assert proc.returncode == 0, proc.stderr
    assert "world size 2 (MULTI_CPU, backend gloo)" in proc.stdout
    assert "seen 8 = 1x the dataset" in proc.stdout


def test_wheel_install_runs_audit_from_outside_the_checkout(wheel_venv):
    venv, outside = wheel_venv
    factory = outside / "my_loader.py"
    factory.write_text((ROOT / "examples" / "good.py").read_text())
    proc = _run_outside(venv, outside, ["audit", "my_loader.py:make_loader", "--epochs", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdicts" in proc.stdout
