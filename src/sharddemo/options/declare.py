"""How an option is declared once: a dataclass field with its flag and help (option), which
the CLI turns into its click option (cli.declared), which command_line writes back for the
line that reruns a launch by hand, and which from_dict reads back from a launch's options
file."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field


def option(default, flag: str, help: str, **more):
    """A field of an options dataclass that the command line sets: its flag (`--x`, or
    `--x/--no-x` for a switch), its help, and for the CLI what the default does not say
    (`type`, `choices`, `metavar`). The CLI builds its options from these (cli.declared), and
    `command_line` writes them back: an option is declared here and nowhere else."""
    return field(default=default, metadata={"flag": flag, "help": help, **more})


def command_line(opts) -> list[str]:
    """The flags that reproduce `opts` on the command line (those that differ from their
    defaults), for the line a user can paste to rerun a launch by hand."""
    args: list[str] = []
    for f in dataclasses.fields(opts):
        flag = f.metadata.get("flag")
        value = getattr(opts, f.name)
        if flag is None or value == f.default:
            continue
        if "/" in flag:
            on, off = flag.split("/")
            args.append(on if value else off)
        elif isinstance(value, bool):
            args.append(flag)
        else:
            text = f"{value:g}" if isinstance(value, float) else str(value)
            args += [flag, os.path.abspath(text) if f.metadata.get("path") else text]
    return args


def from_dict(cls, data: dict):
    """An options dataclass from its `dataclasses.asdict` (the JSON file a launch hands its
    ranks), tuples restored."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) and k == "modes" else v
              for k, v in data.items() if k in names}
    return cls(**values)
