"""The CLI as its own process: `sharddemo --version` names the libraries and accelerate's
distributed type (the in-process cases: tests/unit/test_cli.py)."""

from __future__ import annotations


def test_version_names_the_libraries_and_the_distributed_type():
    import accelerate
    import torch

    from sharddemo import __version__

    from support.launch import sharddemo

    proc = sharddemo(["--version"])
    assert proc.stdout.splitlines()[0] == f"sharddemo {__version__}"
    assert f"torch {torch.__version__}" in proc.stdout
    assert f"accelerate {accelerate.__version__}" in proc.stdout
    expected = "MULTI_GPU on NCCL" if torch.cuda.device_count() >= 2 else "MULTI_CPU on gloo"
    assert f"distributed type here: {expected}" in proc.stdout
