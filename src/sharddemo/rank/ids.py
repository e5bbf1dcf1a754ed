"""How a batch's ids are read, by one rule for `audit --id-field` and the watch's `id_field`.

`ReadIds(batch, tag)` gives the 0-based ids of the samples in `batch` (or `(values, shift)`, the
ids being values - shift), and `read_values` adds the worker that made the batch. An id field is
read by one rule for `audit --id-field` and the watch's `id_field` alike: `field_values` picks
the field, `integer_ids` checks its values."""

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
    """Return the ids held as `values` = ids + shift (ReadIds): values - shift.

    That is `values` itself (no copy) where the shift is 0."""
    return values - shift if shift else values


def read_values(read_ids: ReadIds, batch,
                 known: Optional[int] = None) -> tuple[torch.Tensor, int, int]:
    """Return (values, the worker that made the batch, shift): its ids are values - shift.

    `known`: the worker of every batch where the loader says it (known_worker); else read from
    the batch's tag (a few microseconds a batch), UNKNOWN_WORKER without one."""
    inner, tag = unwrap(batch)
    got = read_ids(inner, tag)
    values, shift = got if type(got) is tuple else (got, 0)
    if known is not None:
        return values, known, shift
    worker = UNKNOWN_WORKER
    if tag is not None and len(tag["worker"]):
        worker = int(tag["worker"][0])
    return values, worker, shift


def field_values(batch, id_field, label: str, error=None):
    """Return a batch's id field, by the one rule for audit and the watch alike.

    `"."` is the batch itself (a batch that is the tensor of ids); a dict's key; a tuple's or
    list's position (an int, or a string of digits); else the key of a mapping-like batch. A
    field the batch does not have is one error (`error`, UsageError by default) that names the
    fields it does have; `label` names the option as the user wrote it (`--id-field nope`,
    `id_field='nope'`)."""
    from sharddemo.errors import UsageError

    error = error or UsageError
    if id_field == ".":
        return batch
    key = int(id_field) if isinstance(id_field, str) and id_field.lstrip("-").isdigit() \
        else id_field
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        try:
            return batch[key]
        except (KeyError, TypeError):
            has = ", ".join(repr(k) for k in list(batch.keys())[:12])
            raise error(f"{label}: the batches ({type(batch).__name__}) have no field "
                        f"{id_field!r}; they have {has}") from None
    if isinstance(key, int) and torch.is_tensor(batch) and batch.dim() > 0:
        return batch[key]  # (a row: the caller says what a tensor's row is not)
    if isinstance(batch, (list, tuple)) and isinstance(key, int):
        if -len(batch) <= key < len(batch):
            return batch[key]
        raise error(f"{label}: the batches ({type(batch).__name__} of {len(batch)}) have no "
                    f"position {key}; they have positions 0..{len(batch) - 1}") from None
    kind = type(batch).__name__
    shape = f" of shape {tuple(batch.shape)}" if torch.is_tensor(batch) else ""
    raise error(f"{label}: the batches ({kind}{shape}) have no field {id_field!r}; pass '.' "
                "when each batch is itself the tensor of ids")


def integer_ids(values, label: str, error=None, *, keep_device: bool = False) -> torch.Tensor:
    """Return an id field's values as ids, by the one rule: whole numbers only.

    Integers, or floats that are whole, as a 1-D int64 tensor on the CPU (`keep_device`:
    integers stay where they are, as the watch counts ids on their GPU without a sync; floats
    there are read to be checked); bools, complex numbers, fractions and anything that is not a
    number are one error naming what the field holds. (Keys, str or bytes, are told apart before
    this: rank.keys.key_values.)"""
    from sharddemo.errors import UsageError

    error = error or UsageError
    hint = (f"{label} must hold each sample's id: an integer 0..N-1 or a key (str, bytes)")
    try:
        ids = values if torch.is_tensor(values) else torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):
        first = values
        while isinstance(first, (list, tuple)) and first:
            first = first[0]
        raise error(f"{hint} (it holds {type(first).__name__} values)") from None
    if ids.dtype is torch.bool or ids.is_complex():
        raise error(f"{hint} (it holds {ids.dtype} values)")
    if ids.is_floating_point() and not bool(torch.all(ids == ids.round())):
        raise error(f"{hint} (it holds {ids.dtype} values that are not whole numbers)")
    if keep_device:
        return ids.reshape(-1) if not ids.is_floating_point() else ids.reshape(-1).long()
    return ids.reshape(-1).to("cpu", torch.int64)
