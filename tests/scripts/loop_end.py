"""What the loop scripts here share (imported from the scripts' own folder, which Python puts
first on the path of a script it runs)."""

from __future__ import annotations


def end_loader(loader) -> None:
    """A case's end: the watched loader closed (the epoch stopped in is reported, partial), and
    the workers of a pass left open ended here, not in a later case's forked worker (where the
    iterator's __del__ would test a process that is not its child)."""
    loader.close()
    iterator = loader.__dict__.get("_iterator")
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def write_logs_and_end(out: str, tag: str, logs: dict) -> None:
    """A launch's end: this rank's logged ids of every case to OUT/ids.TAG.RANK.json (what
    support/reports.py's launch_cases reads back), then the process group ended on every rank
    together."""
    import json
    import os

    import torch.distributed as dist

    with open(os.path.join(out, f"ids.{tag}.{dist.get_rank()}.json"), "w") as f:
        json.dump(logs, f)
    dist.barrier()
    dist.destroy_process_group()


def load_saved(out: str, name: str, rank: int) -> dict:
    """What case `name` saved on this rank (OUT/NAME.RANK.pt), or rank 0's where the saving
    launch had no such rank (a launch on more ranks loads rank 0's)."""
    import os

    import torch

    path = os.path.join(out, f"{name}.{rank}.pt")
    if not os.path.exists(path):
        path = os.path.join(out, f"{name}.0.pt")
    return torch.load(path, weights_only=False)
