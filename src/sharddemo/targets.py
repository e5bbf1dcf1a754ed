"""The user's factory and the keys file of `audit --keys`, parsed and checked in the parent.

The factory as the command line names it (`path/to/file.py:make_loader`,
`package.module:make_trainer`), checked before any rank starts (torch-free). The ranks import
and call the factory (sharddemo.rank.audit.load_factory)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Optional

from sharddemo.errors import UsageError


# Each kind of factory, for the messages: how it is called and what it builds (the plain
# audit's, --trainer's and --lightning's).
FACTORY_CALLS = {None: ("make_loader(accelerator)", "loader"),
                 "trainer": ("make_trainer()", "Trainer"),
                 "lightning": ("make_datamodule()", "LightningDataModule")}


def factory_name(framework: Optional[str]) -> str:
    return FACTORY_CALLS[framework][0].split("(")[0]


def parse_target(target: str, framework: Optional[str] = None) -> tuple[str, str]:
    """`module:name` or `file.py:name` -> (module or path, name)."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name or not name.replace(".", "_").isidentifier():
        f = factory_name(framework)
        raise UsageError(f"factory {target!r} is not of the form package.module:{f} or "
                         f"path/to/file.py:{f}")
    return where, name


def read_keys(path: str, dataset_size: Optional[int] = None) -> list[str]:
    """Return the samples' keys, one per line of `path`, or one Error line.

    UTF-8; a trailing newline and a carriage return are not part of a key. The Error line says
    what is wrong with the file."""
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            keys = [line.rstrip("\n").rstrip("\r") for line in handle]
    except OSError as exc:
        raise UsageError(f"--keys {path}: cannot read it ({exc.strerror}); pass a file of the "
                         "samples' keys, one per line") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--keys {path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         "write the keys as UTF-8, one per line") from None
    if not keys:
        raise UsageError(f"--keys {path} is empty; it must list every sample's key, one per "
                         "line")
    seen: dict[str, int] = {}
    for line, key in enumerate(keys, 1):
        if key in seen:
            raise UsageError(f"--keys {path}: line {line} repeats the key {key!r} of line "
                             f"{seen[key]}; each sample's key must be listed once")
        seen[key] = line
    if dataset_size is not None and dataset_size != len(keys):
        raise UsageError(f"--keys {path} lists {len(keys)} keys but --dataset-size is "
                         f"{dataset_size}; leave --dataset-size out (the file gives N)")
    return keys


def validate_target(target: str, framework: Optional[str] = None) -> None:
    """Catch a missing file or module before any rank starts.

    The import itself runs on the ranks, where the factory is used."""
    where, _ = parse_target(target, framework)
    f = factory_name(framework)
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise UsageError(f"factory file {where} does not exist; pass path/to/file.py:{f}")
        from sharddemo.extras import require_imports_of

        require_imports_of(where)
        return
    try:
        spec = importlib.util.find_spec(where)
    except (ImportError, ValueError) as exc:
        spec, why = None, f" ({exc})"
    else:
        why = ""
    if spec is None:
        raise UsageError(f"module {where} cannot be found{why}; check the name, or install or add "
                         f"its folder to PYTHONPATH, or pass path/to/file.py:{f}")
