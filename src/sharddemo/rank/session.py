"""One rank's session: its Accelerator, its checks, its trace header, status and teardown.

The Accelerator with a short process-group timeout, the check that the launcher really started
every rank, the trace header every rank command writes, the status files the parent reads, and
the teardown. Every rank command (run, audit-rank, resume-rank, resume-demo-rank) opens one
`rank_session`; the watch builds its header with `trace_header`.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from datetime import timedelta
from typing import Optional

import torch

from sharddemo.errors import UsageError
from sharddemo.options import EXPECT_ENV, NODE_ENV, STATUS_ENV
from sharddemo.rank.collect import exchange_ints, exchange_objects, guard_forks, set_timeout
from sharddemo.rank.heartbeat import HEARTBEAT


TRACE_SCHEMA = "sharddemo.trace/1"


def rank_label(rank: Optional[int] = None, world: Optional[int] = None) -> str:
    """`[rank r/W]` from the arguments, or from the launcher's environment."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return f"[rank {rank}/{world}]"


def make_accelerator(device: str, timeout: float):
    """One Accelerator for the whole run, with a short process-group timeout.

    On a machine without CUDA the script asks for `cpu=True`: under torchrun (which is what
    `accelerate launch` with a MULTI_GPU config runs) that gives MULTI_CPU on gloo with the
    launcher's real ranks. Without it, each process would set itself up alone.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but CUDA is not available; use --device cpu")
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=timeout))]
    set_timeout(timeout)
    guard_forks()  # DataLoader workers forked right after a collective (collect.guard_forks)
    mark_started()
    return Accelerator(cpu=(device == "cpu"), kwargs_handlers=handlers)


def validate_not_alone(num_processes: int, env: Optional[dict] = None) -> None:
    """Stop when the launcher asked for several processes but this one finds itself alone.

    That is the silent trap of `accelerate launch --cpu --num_processes 2` and of a
    MULTI_CPU config without MPI: one process runs, prints, and sees the whole dataset.
    """
    env = os.environ if env is None else env
    asked = 0
    for key in ("WORLD_SIZE", EXPECT_ENV):
        try:
            asked = max(asked, int(env.get(key, "0") or 0))
        except ValueError:
            pass
    if num_processes >= asked and not (
        # accelerate's plain (non-torchrun) launcher sets MASTER_PORT only when it was asked
        # for more than one process, never WORLD_SIZE, and always its ACCELERATE_* settings.
        # MASTER_PORT alone proves nothing: SLURM jobs export it for plain `python` too.
        num_processes == 1 and "MASTER_PORT" in env and "WORLD_SIZE" not in env
        and "ACCELERATE_MIXED_PRECISION" in env
    ):
        return
    wanted = f"{asked} processes" if asked > 1 else "several processes"
    raise UsageError(
        f"launched for {wanted} but this process is alone (world size {num_processes}); "
        "accelerate launch --cpu and MULTI_CPU configs without MPI start one process. "
        "Fix: accelerate launch --config_file accelerate_configs/cpu2.yaml (MULTI_GPU launcher, "
        "which sharddemo runs on CPU with gloo)"
    )


def peak_rss_mb(accelerator) -> list[float]:
    """Every rank's peak resident memory so far, in MB, rank by rank. A collective."""
    import resource

    kb = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
    return [round(row[0] / 1024, 1) for row in exchange_ints(accelerator, [kb])]


def placement(accelerator) -> list[dict]:
    """Return where every rank runs: global rank, local rank, node (machine rank) and host.

    As the main process sees them after one gather. The reference takes `local_rank` from
    `get_rank()`, which is only right on the first machine; here both are recorded."""
    import socket

    node = os.environ.get(NODE_ENV) or os.environ.get("GROUP_RANK") or "0"
    mine = {"rank": accelerator.process_index, "local_rank": accelerator.local_process_index,
            "node": int(node), "host": socket.gethostname()}
    return sorted(exchange_objects(accelerator, mine), key=lambda p: p["rank"])


def write_trace(trace: dict, path: str) -> None:
    """The main rank's trace, whole or not at all (compact: it can hold 10^7 ids)."""
    import json

    from sharddemo.fileio import write_atomic

    write_atomic(path, json.dumps(trace, separators=(",", ":")))


def teardown(accelerator) -> None:
    """End the run and leave the process group, as the DDP tutorial's destroy does."""
    accelerator.end_training()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# STATUS_ENV, set by `sharddemo compare` / `audit` for the ranks they launch: a folder where
# each rank leaves `rank-R.started` when it starts and `rank-R.json` ({"kind", "message"}) when
# it fails, so the launcher's side learns what happened from the ranks themselves, not by
# reading words in their stderr.


def _status_path(suffix: str) -> Optional[str]:
    folder = os.environ.get(STATUS_ENV)
    rank = os.environ.get("RANK")
    return os.path.join(folder, f"rank-{rank}.{suffix}") if folder and rank else None


def mark_started() -> None:
    # A rank that dies of a fatal signal (an abort in gloo, a crash in a native library)
    # leaves no status file; Python's fault handler at least writes which signal, and every
    # thread's Python stack, to the rank's stderr (shown with SHARDDEMO_DEBUG=1).
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    HEARTBEAT.report()  # the progress file (rank.heartbeat): starting
    path = _status_path("started")
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(str(os.getpid()))


def failure_kind(exc: BaseException, usage: bool = False) -> str:
    """Return how a rank failed: usage, timeout, peer or error.

    From the exception's own type (CollectiveFailed says how the collective failed), following
    the chain of causes."""
    if usage:
        return "usage"
    seen = exc
    while seen is not None:
        kind = getattr(seen, "kind", None)
        if kind:
            return kind
        seen = seen.__cause__ or seen.__context__
    return "error"


def rank_fail(message: str, kind: str = "error") -> None:
    """Report this rank's failure: a line on stderr and its status file.

    The failing rank speaks for itself: one line on stderr for a person (`[rank r/W] Error:
    ...`), and its status file for `sharddemo compare` / `audit`, which turn `usage` into exit
    code 2 and everything else into 1."""
    import json

    label = "Usage error" if kind == "usage" else "Error"
    # One write call, so that lines from ranks failing together do not interleave.
    sys.stderr.write(f"{rank_label()} {label}: {message}\n")
    sys.stderr.flush()
    path = _status_path("json")
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"rank": int(os.environ["RANK"]), "kind": kind, "message": message}, handle)


def trace_header(ranks) -> dict:
    """Return the fields every trace starts with, from what really runs.

    The world size, the process group's backend (gloo, nccl; "none" in one process),
    accelerate's distributed type where an Accelerator runs (else "torch.distributed", or "NO"
    alone) and the device. `ranks` is an Accelerator or anything with num_processes and device
    (the watch's own ranks)."""
    state = getattr(ranks, "state", None)
    backend = getattr(state, "backend", None)
    if backend is None:
        dist = torch.distributed
        backend = (dist.get_backend() if dist.is_available() and dist.is_initialized()
                   else None)
    if state is not None and getattr(state, "distributed_type", None) is not None:
        kind = state.distributed_type.value
    else:
        kind = "torch.distributed" if backend else "NO"
    return {"schema": TRACE_SCHEMA, "world_size": ranks.num_processes,
            "backend": backend or "none", "distributed_type": kind,
            "device": torch.device(ranks.device).type}


class RankSession:
    """What a rank command holds while it runs: its Accelerator and its trace's way out.

    The main process writes the trace for the parent; the others return None."""

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def finish(self, body: dict, trace_out: Optional[str]) -> Optional[dict]:
        """Write the trace on the main process (the header, then `body`) to `trace_out`.

        Whole or not at all; None on the other ranks."""
        HEARTBEAT.finishing()
        if not self.is_main:
            return None
        trace = {**trace_header(self.accelerator), **body}
        if trace_out:
            write_trace(trace, trace_out)
        return trace


@contextmanager
def rank_session(device: str, timeout: float, *, allow_alone: bool = False):
    """Run a rank command the one way: set up, check the world, and always tear down.

    An Accelerator with a short process-group timeout (make_accelerator), the check that this
    process is not alone where the launcher asked for several (validate_not_alone; `allow_alone` skips
    it for `sharddemo trap`), and on any way out the end of training and of the process group
    (teardown)."""
    accelerator = make_accelerator(device, timeout)
    try:
        if not allow_alone:
            validate_not_alone(accelerator.num_processes)
        yield RankSession(accelerator)
    finally:
        teardown(accelerator)


def distributed_here() -> tuple[str, str]:
    """Return torch's version and what a launch here would use, for `sharddemo --version`.

    CUDA -> NCCL; otherwise CPU ranks on gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    here = (f"MULTI_GPU on NCCL ({gpus} GPUs visible)" if gpus >= 2 else
            "MULTI_CPU on gloo (no 2 GPUs visible: CPU ranks, accelerate_configs/cpu2.yaml)")
    return torch.__version__, here
