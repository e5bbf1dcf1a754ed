"""`sharddemo --version`: its own version, the libraries it runs on, and what a launch here
would use (CUDA -> NCCL; otherwise CPU ranks on gloo)."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

import click

from sharddemo import __version__
from sharddemo.commands.ranks import distributed_here


def print_version() -> None:
    """The three lines of `sharddemo --version` (torch answers the last: it is imported)."""

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    torch_version, here = distributed_here()
    click.echo(f"sharddemo {__version__}")
    click.echo(f"python {platform.python_version()} | torch {torch_version} | accelerate "
               f"{ver('accelerate')} | datasets {ver('datasets')} | click {ver('click')}")
    click.echo(f"distributed type here: {here}")
