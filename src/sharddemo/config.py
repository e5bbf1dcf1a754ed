"""Find and check an accelerate config file before anything is launched.

accelerate itself fails late, with a traceback, on a missing or malformed config. Here it is
loaded with `yaml.safe_load`, its keys checked against accelerate's own config dataclass, and
any problem becomes one `Error:` line that names the file and the fix.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Optional

from sharddemo.errors import UsageError

CPU_CONFIG = "cpu2.yaml"
GPU_CONFIG = "2gpu.yaml"


def shipped_configs() -> dict[str, str]:
    """Return the accelerate configs installed with the package: name -> its first comment line.

    Package data, read with importlib.resources, wherever the installer put the package. The
    repository's top-level accelerate_configs/ holds the same files, for people who pass them to
    `accelerate launch --config_file` from a checkout."""
    from importlib.resources import files

    out = {}
    for entry in sorted(files("sharddemo").joinpath("configs").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            first = entry.read_text(encoding="utf-8").splitlines()[0] if entry.is_file() else ""
            out[entry.name] = first.lstrip("# ").strip()
    return out


def shipped_config_path(name: str) -> str:
    """Return a real file path of the installed config `name`, for `accelerate launch`.

    For `--config_file`. From a zip (a zipapp), the file is copied out to a temporary file that
    lives as long as this process."""
    import atexit
    import contextlib
    from importlib.resources import as_file, files

    if name not in shipped_configs():
        raise UsageError(f"no shipped config named {name!r}; choose one of: "
                         + ", ".join(shipped_configs()) + " (sharddemo configs lists them)")
    stack = contextlib.ExitStack()
    atexit.register(stack.close)
    return str(stack.enter_context(as_file(files("sharddemo").joinpath("configs", name))))


def visible_gpus() -> int:
    """Count NVIDIA GPUs without importing torch (keeps `compare` start-up cheap)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = glob.glob("/dev/nvidia[0-9]*")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        return min(len(ids), len(devices))
    return len(devices)


def default_config_path() -> str:
    """Return the installed config NAME (cpu2.yaml, or 2gpu.yaml where two GPUs are visible).

    Shown as accelerate_configs/NAME where the working directory holds that very file (a
    checkout of this repository: a shorter command to rerun by hand); a file of that name with
    other content is the user's own and is not used unless passed with --config-file."""
    name = GPU_CONFIG if visible_gpus() >= 2 else CPU_CONFIG
    shipped = shipped_config_path(name)
    local = os.path.join(os.getcwd(), "accelerate_configs", name)
    try:
        with open(local, "rb") as mine, open(shipped, "rb") as ours:
            if mine.read() == ours.read():
                return _display(local)
    except OSError:
        pass
    return shipped


def _display(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


@dataclass(frozen=True)
class LaunchConfig:
    path: str
    distributed_type: str
    num_processes: int
    num_machines: int
    raw: dict


def known_keys() -> set[str]:
    """The keys accelerate's own config dataclasses accept.

    Read from accelerate's source with `ast` rather than imported: importing accelerate costs
    seconds (it imports torch), and `compare` must not pay that before its launch does.
    """
    import ast
    import importlib.util

    spec = importlib.util.find_spec("accelerate")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("accelerate is not installed; pip install accelerate")
    path = os.path.join(spec.submodule_search_locations[0], "commands", "config", "config_args.py")
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    keys: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("BaseConfig", "ClusterConfig"):
            keys.update(item.target.id for item in node.body
                        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
    return keys


def load_config(path: str, keys: Optional[set[str]] = None) -> LaunchConfig:
    import yaml

    if not os.path.exists(path):
        raise UsageError(f"config file {path} does not exist; pass --config-file "
                         "accelerate_configs/cpu2.yaml or another accelerate config")
    if os.path.isdir(path):
        raise UsageError(f"config file {path} is a directory; pass a YAML file")
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise UsageError(f"config file {path} is not valid YAML{line}; fix it or "
                         "regenerate it with `accelerate config`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"config file {path} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} is not a YAML mapping of accelerate settings; "
                         "see accelerate_configs/cpu2.yaml for the form")
    unknown = sorted(set(data) - (keys if keys is not None else known_keys()))
    if unknown:
        raise UsageError(f"config file {path} has unknown key(s): {', '.join(unknown)}; "
                         "remove them (accelerate would refuse them too)")
    nproc = data.get("num_processes", 1)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise UsageError(f"config file {path} asks for num_processes: {nproc!r}; "
                         "set it to 1 or more, or pass --num-processes")
    machines = data.get("num_machines", 1)
    if not isinstance(machines, int) or machines < 1:
        raise UsageError(f"config file {path} asks for num_machines: {machines!r}; set it to 1 or more")
    return LaunchConfig(path=path, distributed_type=str(data.get("distributed_type", "NO")),
                        num_processes=nproc, num_machines=machines, raw=data)
