"""Bring every rank's ids to the main process, correct for ANY shapes.

Ranks may legitimately hold different numbers of batches and batches of different sizes:
`even_batches=False`, `split_batches`, `drop_last`, iterable shards, unseeded samplers,
`split_dataset_by_node`, a rank with nothing at all. A plain `accelerator.gather` of unequal
shapes aborts on gloo ("Received data size doesn't match", or a half-filled buffer on the other
rank), and a gather of an EMPTY tensor crashes gloo (torch issue 85234). So every collection
here goes the same way:

    1. exchange lengths (one small gather of int64 headers, the same size on every rank);
    2. pad every rank's tensor to the longest, never to less than one element;
    3. `accelerator.gather` the padded tensors;
    4. trim each rank's part back to its own length (by the exchanged lengths, never by a
       sentinel value).

Every function here is a collective: every rank calls it the same number of times with the
same `width` of header, whatever it holds, and every branch below is taken on all ranks alike
because it depends only on exchanged values.

Two ranks, rank 0 holding ids [0, 1, 2, 3] and rank 1 holding [4]:
headers [[4], [1]] -> width 4 -> rank 1 sends [4, -1, -1, -1] -> gathered
[0, 1, 2, 3, 4, -1, -1, -1] -> trimmed to rank 0 [0, 1, 2, 3], rank 1 [4].
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from sharddemo.errors import CollectiveFailed
from sharddemo.rank.heartbeat import HEARTBEAT

PAD = -1  # never read back: the trim goes by the exchanged lengths

# The process group's timeout (seconds), set by make_accelerator: a collective that fails after
# waiting most of it timed out on a silent peer; one that fails sooner lost a peer.
_timeout = [1800.0]


def set_timeout(seconds: float) -> None:
    _timeout[0] = float(seconds)


def collective(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call one collective; if it fails, say how from the time it took (CollectiveFailed).

    One that returns is progress for the parent's watchdog (rank.heartbeat)."""
    start = time.monotonic()
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:
        waited = time.monotonic() - start
        kind = "timeout" if waited >= 0.8 * _timeout[0] else "peer"
        raise CollectiveFailed(f"{type(exc).__name__} after {waited:.1f} s in a collective: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}", kind) from exc
    HEARTBEAT.report()
    return out


def exchange_ints(accelerator, values: Sequence[int]) -> list[list[int]]:
    """Return every rank's list of ints (the same count on every rank), as [rank][k].

    A collective: one all-gather into one flat tensor, torch.distributed's own where the process
    group is up (accelerate's gather on gloo gathers into a list of tensors and concatenates
    them, three allocations and a copy more for a few ints), else accelerate's gather."""
    world = accelerator.num_processes
    if world == 1:
        return [[int(v) for v in values]]
    mine = torch.tensor(list(values), dtype=torch.int64, device=accelerator.device)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rows = mine.new_empty((world * len(values),))
        collective(all_gather_flat(), rows, mine)
    else:
        rows = collective(accelerator.gather, mine)
    return rows.to("cpu").view(world, len(values)).tolist()


def exchange_objects(accelerator, mine: Any) -> list[Any]:
    """Return every rank's picklable object, as [rank], on every rank.

    Accelerate's gather_object. A collective; alone, no call."""
    if accelerator.num_processes == 1:
        return [mine]
    from accelerate.utils import gather_object

    return collective(gather_object, [mine])


def share_from_main(accelerator, mine: Any) -> Any:
    """Return the main process's picklable object on every rank (the others' `mine` unused).

    A collective: torch.distributed's broadcast_object_list from rank 0 (through the device
    where the backend needs one: NCCL); alone, or without a process group, `mine`."""
    import torch.distributed as dist

    if accelerator.num_processes == 1 or not (dist.is_available() and dist.is_initialized()):
        return mine
    box = [mine if accelerator.is_main_process else None]
    device = accelerator.device if accelerator.device.type != "cpu" else None
    collective(dist.broadcast_object_list, box, src=0, device=device)
    return box[0]


def gather_ragged(accelerator, tensor: torch.Tensor, lengths: Sequence[int],
                  main_only: bool = False) -> list[torch.Tensor]:
    """Return every rank's 1-D tensor, of lengths that may differ, as a list indexed by rank.

    On the CPU; `lengths[r]` already exchanged. A collective; nothing is sent when every rank is
    empty (all ranks know it from `lengths`). `main_only`: only the main process receives them
    (a gather onto it, gather_to_main, instead of an all-gather); the others get []."""
    width = max(lengths, default=0)
    tensor = tensor.reshape(-1).to(accelerator.device)
    if width == 0:
        return [tensor.new_empty(0).to("cpu") for _ in lengths]
    if tensor.numel() < width:
        fill = PAD if tensor.dtype.is_signed else 0  # (bytes: rank.keys' tables)
        pad = torch.full((width - tensor.numel(),), fill, dtype=tensor.dtype,
                         device=tensor.device)
        tensor = torch.cat([tensor, pad])
    if accelerator.num_processes == 1:
        rows: Any = tensor.to("cpu").view(1, width)
    elif main_only:
        rows = gather_to_main(accelerator, tensor)
        if rows is None:
            return []
    else:
        rows = collective(accelerator.gather, tensor).to("cpu").view(len(lengths), width)
    return [rows[r][:n].to("cpu") for r, n in enumerate(lengths)]


def gather_to_main(accelerator, tensor: torch.Tensor) -> Optional[list[torch.Tensor]]:
    """Return every rank's `tensor` on the main process, indexed by rank; None elsewhere.

    The same shape on every rank. A collective: torch.distributed's gather onto rank 0 (the main
    process), which sends each rank's tensor to the main process only: where only the main
    process reads them, the others neither receive nor copy what an all-gather would give them.
    """
    import torch.distributed as dist

    parts = ([torch.empty_like(tensor) for _ in range(accelerator.num_processes)]
             if accelerator.is_main_process else None)
    collective(dist.gather, tensor, parts, dst=0)
    return parts


def narrowest_dtype(top: int) -> torch.dtype:
    """Return int32 when every value fits, else int64.

    A gather of a large epoch's ids as int32 costs much less on gloo than as int64
    (docs/benchmarks.md, "Figures behind design choices")."""
    return torch.int32 if top < 2**31 - 1 else torch.int64


# ---------------------------------------------------------------------------------------------
# Forks right after a collective.

FORK_PAUSE_S = 0.005
_fork_guard = [False]


def guard_forks() -> None:
    """Make every fork of this rank (a DataLoader starting its workers) wait a few ms first.

    Only on the Pythons that need it: once per process; a no-op on CPython 3.12 and later.

    CPython before 3.12 (gh-112275) re-initialises the runtime's HEAD lock in a forked child
    only AFTER taking it, so a child forked while another thread holds that lock deadlocks
    before running a line. Here it happens when the fork follows a collective at once (never
    when a pause separates them), which points at gloo's threads, the only other threads then,
    taking the lock as the collective finishes (which thread holds it was not pinned down).
    Loaders fork right after a collective all the time: accelerate's prepared loaders broadcast
    their RNG state and then start the workers; sharddemo's walk exchanges lengths and then
    iterates. That hung ranks in back-to-back epochs (benchmarks/fork_after_collective.py
    reproduces it; the runs that hung, with and without the guard: docs/reliability.md).
    Sleeping before the fork lets the other thread leave the lock first; the loader yields
    exactly the same batches.
    """
    if _fork_guard[0] or sys.version_info >= (3, 12) or not hasattr(os, "register_at_fork"):
        return
    _fork_guard[0] = True
    os.register_at_fork(before=_pause_before_fork)


def _pause_before_fork() -> None:
    time.sleep(FORK_PAUSE_S)


def all_reduce_bytes(accelerator, buffer: np.ndarray) -> None:
    """Sum the uint8 `buffer` over the ranks, in place on every rank: one all-reduce.

    Through the device where the process group's backend needs one (NCCL)."""
    import torch.distributed as dist

    tensor = torch.from_numpy(buffer)
    device = accelerator.device
    if device.type == "cpu":
        collective(dist.all_reduce, tensor, op=dist.ReduceOp.SUM)
        return
    sent = tensor.to(device)
    collective(dist.all_reduce, sent, op=dist.ReduceOp.SUM)
    tensor.copy_(sent.to("cpu"))


# What the code is reduced as: gloo and NCCL sum uint8 but no 16- or 32-bit unsigned integers
# ("Invalid scalar type" on gloo), so a wider code goes as int32 / int64 a chunk at a time.
WIRE = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.int32,
         np.dtype(np.uint32): torch.int64}


def reduce_to_main(accelerator, code: np.ndarray, background: bool = True,
                   chunk: int = 1 << 22) -> Callable[[], None]:
    """Start summing `code` over the ranks into the main process's `code`; return `wait`.

    In place; the other ranks' arrays are left as they were; `wait` returns once the sums are
    there. A reduce, not an all-reduce: only the main process reads the sums, and on gloo a
    reduce costs less than an all-reduce (docs/benchmarks.md).

    Where the code is sent as it is (uint8 on the CPU: up to 15 ranks on gloo), the reduce runs
    in the background (gloo's own thread) while the rank goes on with the small exchanges of the
    epoch's end. Until `wait` returns no rank may touch `code` (gloo may use a rank's array as
    its scratch). A code that must be converted (wider, or to a device for NCCL) is reduced a
    chunk at a time before this returns: in flight at once its copies would take memory in
    proportion to N."""
    import torch.distributed as dist

    device = accelerator.device
    wire = WIRE[code.dtype]
    main = accelerator.is_main_process
    works = []
    for lo in range(0, code.size, chunk):
        part = torch.from_numpy(code[lo:lo + chunk])
        if background and wire == part.dtype and device.type == "cpu":
            works.append(collective(dist.reduce, part, dst=0, op=dist.ReduceOp.SUM,
                                    async_op=True))
            continue
        sent = part.to(device, wire)
        collective(dist.reduce, sent, dst=0, op=dist.ReduceOp.SUM)
        if main:
            part.copy_(sent.to("cpu"))

    def wait() -> None:
        for work in works:
            collective(work.wait)

    return wait


# -- the ranks, with or without accelerate

class TorchRanks:
    """What the recorder asks of an Accelerator, from torch.distributed alone.

    For torchrun, SLURM srun, or a single process."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.num_processes = self.dist.get_world_size() if self.dist else 1
        self.process_index = self.dist.get_rank() if self.dist else 0
        self.is_main_process = self.process_index == 0
        backend = self.dist.get_backend() if self.dist else "none"
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if backend == "nccl" else torch.device("cpu"))

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.new_empty((self.num_processes * tensor.numel(),))
        collective(all_gather_flat(), out, tensor.contiguous())
        return out


def all_gather_flat():
    """Return torch's all-gather into one flat tensor, under the name this torch has.

    all_gather_single where torch has it (2.13 deprecates all_gather_into_tensor, with a
    FutureWarning on every rank at its first call), else all_gather_into_tensor (the same
    collective under its older name)."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def ranks_of(accelerator):
    """The accelerator, or torch.distributed's ranks where there is none."""
    return accelerator if accelerator is not None else TorchRanks()
