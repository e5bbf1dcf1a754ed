"""How a batch's ids are read: `ReadIds(batch, tag)` gives the 0-based ids of the samples in
`batch` (or `(values, shift)`, the ids being values - shift), and `read_values` adds the worker
that made the batch."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from sharddemo.rank.tagging import UNKNOWN_WORKER, unwrap

# read_ids(batch, tag) -> the batch's 0-based ids: `batch` is the loader's own batch, `tag` what
# sharddemo attached to it (rank.tagging.tag_batches; None when untagged). It may instead return
# (values, shift), the ids being values - shift (rank.sources.batch_values: the toy sources hold
# id + 1); the walk then subtracts where it is cheapest (the count path: once per flush).
ReadIds = Callable[[Any, Optional[dict]], Any]


def unshift(values: torch.Tensor, shift: int) -> torch.Tensor:
    """The ids held as `values` = ids + shift (ReadIds): values - shift, or `values` itself
    (no copy) where the shift is 0."""
    return values - shift if shift else values


def read_values(read_ids: ReadIds, batch,
                 known: Optional[int] = None) -> tuple[torch.Tensor, int, int]:
    """(values, the worker that made the batch, shift): its ids are values - shift. `known`:
    the worker of every batch where the loader says it (known_worker); else read from the
    batch's tag (a few microseconds a batch), UNKNOWN_WORKER without one."""
    inner, tag = unwrap(batch)
    got = read_ids(inner, tag)
    values, shift = got if type(got) is tuple else (got, 0)
    if known is not None:
        return values, known, shift
    worker = UNKNOWN_WORKER
    if tag is not None and len(tag["worker"]):
        worker = int(tag["worker"][0])
    return values, worker, shift
