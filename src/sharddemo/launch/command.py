"""The command line of a launch: how to launch (LaunchSettings, with accelerate launch's own
names), the launch itself (Launch: its `accelerate launch` arguments and the line to rerun it by
hand), the settings checked against the config file (make_launch), and a free port."""

from __future__ import annotations

import shlex
import socket
from dataclasses import dataclass
from typing import Callable, Optional

from sharddemo.config import default_config_path, load_config
from sharddemo.errors import UsageError


def free_port() -> int:
    """A port nobody listens on now, for this launch's rendezvous (never another job's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class LaunchSettings:
    """How to launch, with accelerate launch's own names: one machine by default, or one
    node of a multi-node job."""

    config_file: Optional[str] = None
    num_processes: Optional[int] = None  # all ranks, over every machine
    main_process_port: Optional[int] = None
    num_machines: Optional[int] = None
    machine_rank: Optional[int] = None
    main_process_ip: Optional[str] = None


@dataclass
class Launch:
    config_file: Optional[str]
    num_processes: int
    # What the ranks are asked to do: the options file's contents (options.read_rank_options)
    options: dict
    # The flags of `command` that do the same by hand (options.command_line), for display()
    display_args: list[str]
    device: str = "auto"
    port: Optional[int] = None
    # The launch flags instead of a config file (`sharddemo trap` uses `--cpu`).
    flags: Optional[list[str]] = None
    expect_world: bool = True
    # The sharddemo command the ranks run.
    command: str = "run"
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: Optional[str] = None

    def accelerate_args(self) -> list[str]:
        if self.flags is not None:
            args = [*self.flags, "--num_processes", str(self.num_processes)]
        else:
            args = ["--config_file", self.config_file, "--num_processes", str(self.num_processes)]
        if self.num_machines > 1:
            args += ["--num_machines", str(self.num_machines),
                     "--machine_rank", str(self.machine_rank),
                     "--main_process_ip", str(self.main_process_ip)]
        return args

    def display(self) -> str:
        """The line a user can paste to rerun this by hand (the port only when one was
        given: on one machine accelerate picks a free one)."""
        device = [] if self.device == "auto" else ["--device", self.device]
        port = ["--main_process_port", str(self.port)] if self.port else []
        words = (["accelerate", "launch", *self.accelerate_args(), *port, "-m", "sharddemo",
                  self.command, *self.display_args, *device])
        return shlex.join(words)


def make_launch(settings: LaunchSettings, options: dict, display_args: list[str],
                command: str = "run", check: Optional[Callable[[int], object]] = None) -> Launch:
    """Settings from the command line + the config file -> the launch to run."""
    path = settings.config_file or default_config_path()
    config = load_config(path)
    if settings.num_processes is not None and settings.num_processes < 1:
        raise UsageError(f"--num-processes must be at least 1, got {settings.num_processes}")
    world = settings.num_processes or config.num_processes
    machines = settings.num_machines or config.num_machines
    rank = settings.machine_rank if settings.machine_rank is not None else int(
        config.raw.get("machine_rank", 0) or 0)
    ip, port = settings.main_process_ip, settings.main_process_port
    if machines > 1:
        # Every machine must agree: take the config's address and port unless given.
        ip = ip or config.raw.get("main_process_ip")
        port = port or config.raw.get("main_process_port")
        if not ip or not port:
            raise UsageError("a multi-node launch needs --main-process-ip and "
                             "--main-process-port, the same on every machine")
        if not 0 <= rank < machines:
            raise UsageError(f"--machine-rank must be 0..{machines - 1}, got {rank}")
        if world % machines:
            raise UsageError(f"--num-processes counts every rank on every machine: {world} does "
                             f"not divide by {machines} machines")
    elif rank:
        raise UsageError(f"--machine-rank {rank} needs a multi-node launch: pass --num-machines")
    if port is not None and not 0 < int(port) < 65536:
        raise UsageError(f"--main-process-port must be 1..65535, got {port}")
    if check is not None:
        check(world)
    # A config that says use_cpu stays on CPU even where GPUs are visible.
    device = "cpu" if config.raw.get("use_cpu") else "auto"
    return Launch(config_file=path, num_processes=world, options=options,
                  display_args=display_args, device=device,
                  port=int(port) if port else None, command=command, num_machines=machines,
                  machine_rank=rank, main_process_ip=ip)
