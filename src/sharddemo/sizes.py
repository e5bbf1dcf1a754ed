"""A loader's batch arithmetic in words, for `run`'s output and the report's renderers.

The same for `run`'s output on the main rank and for the report's renderers (torch-free,
importing nothing of sharddemo's: both sides read it)."""

from __future__ import annotations

# A mode's own sizes (a framework's eval loader differs from its train loader).
SIZES = ("dataset_size", "batch_size", "global_batch")


def own_sizes_line(report: dict, data: dict) -> str:
    """Return a mode's own per-rank and global batch, where it differs from the header's.

    Where a mode's loader batches otherwise than the header says (the header gives the run's:
    under --split-batches, accelerate's slice of the batch, which a loader it does not prepare
    never takes; an audit's second loader)."""
    g = data.get("global_batch")
    if g is None or g == report["global_batch"]:
        return ""
    w = batch_ways(report)
    why = (" (not prepared: --split-batches slices only the batches of a loader accelerate "
           "prepares)" if (report.get("options") or {}).get("split_batches")
           and not data.get("prepared") else "")
    return f"this loader: per-rank batch {g // w}, global batch {g}{why}"


def batch_ways(report: dict) -> int:
    """How many ways the report's global batch is dealt: the data-parallel groups on a mesh
    (peers share a batch), else the ranks."""
    mesh = report.get("mesh")
    return max(mesh["data_groups"] if mesh else report["world_size"], 1)
