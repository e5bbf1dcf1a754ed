"""`sharddemo configs`: the accelerate configs that ship with sharddemo, listed, or one's
installed path (sharddemo.config finds them)."""

from __future__ import annotations

from typing import Optional

import click

from sharddemo.config import shipped_config_path, shipped_configs


def configs_command(name: Optional[str]) -> None:
    """`sharddemo configs` from the command line: every shipped config with its first line, or
    the path of config `name`."""
    if name is not None:
        click.echo(shipped_config_path(name))
        return
    shipped = shipped_configs()
    width = max(len(n) for n in shipped)
    for config_name, first_line in shipped.items():
        click.echo(f"{config_name:<{width}}  {first_line}")
