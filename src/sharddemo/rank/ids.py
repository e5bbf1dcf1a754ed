"""How a batch's ids are read, by one rule for `audit --id-field` and the watch's `id_field`.

`ReadIds(batch, tag)` gives the 0-based ids of the samples in `batch` (or `(values, shift)`, the
ids being values - shift), and `read_values` adds the worker that made the batch. An id field is
read by one rule for `audit --id-field` and the watch's `id_field` alike: `field_values` picks
the field, `packed_ids` reads packed rows (several samples a row: docs/watch.md, "Packed rows"),
`integer_ids` checks its values."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
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


def field_values(batch, id_field, label: str, error=None, ids: bool = True):
    """Return a batch's id field, by the one rule for audit and the watch alike.

    `"."` is the batch itself (a batch that is the tensor of ids); a dict's key; a tuple's or
    list's position (an int, or a string of digits); else the key of a mapping-like batch. A
    field the batch does not have is one error (`error`, UsageError by default) that names the
    fields it does have; `label` names the option as the user wrote it (`--id-field nope`,
    `id_field='nope'`); `ids`: the field is meant to hold ids (else tokens= or sources=, whose
    batch is never the field itself)."""
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
    raise error(f"{label}: the batches ({kind}{shape}) have no field {id_field!r}; "
                + ("pass '.' when each batch is itself the tensor of ids" if ids else
                   "name a field of a batch that is a dict (a key) or a tuple (a position)"))


def integer_ids(values, label: str, error=None, *, keep_device: bool = False,
                keys: bool = True) -> torch.Tensor:
    """Return an id field's values as ids, by the one rule: whole numbers only.

    Integers, or floats that are whole, as a 1-D int64 tensor on the CPU (`keep_device`:
    integers stay where they are, as the watch counts ids on their GPU without a sync; floats
    there are read to be checked); bools, complex numbers, fractions and anything that is not a
    number are one error naming what the field holds. (Keys, str or bytes, are told apart before
    this: rank.keys.key_values; `keys`: whether the reader takes them, as the error says.)"""
    from sharddemo.errors import UsageError

    error = error or UsageError
    hint = (f"{label} must hold each sample's id: an integer 0..N-1"
            + (" or a key (str, bytes)" if keys else ""))
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


# A packed row's padding: the -1s that end a row of a packed id field (a 2-D tensor B x W, or
# rows of different lengths padded by the user's collate). Only at a row's end: a -1 before a
# real id of its row is an id like any other (one that names no sample: ids-in-range).
PAD = -1


class Packs:
    """One rank's stream of packed rows, read row after row within an epoch: the last id of
    the last row read (None: no row yet, or that row was all padding), whether that id
    continued a sample from the row before (a sample over three rows or more is one split),
    and the samples split so far (`split`). `reset()` at each epoch's end: a sample is never
    split across two epochs."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> int:
        """Start the stream anew; returns the samples split since the last reset."""
        split = getattr(self, "split", 0)
        self.last: Optional[int] = None
        self.continued = False
        self.split = 0
        return split


def packed_rows(values, label: str, error=None,
                keys: bool = True) -> Optional[tuple[torch.Tensor, np.ndarray]]:
    """Return a packed id field as (its values in row order, each row's length), or None where
    the field holds one sample a row.

    Packed: a 2-D tensor of two columns or more (B x W, rows padded with -1), or a list or
    tuple whose items include rows (lists, tuples or 1-D numpy arrays of ids; a bare number is
    a row of one). A list of tensors is refused: the DataLoader's default collate turns a list
    each sample returns into one tensor per position (the batch transposed), which no rule
    can read as rows. The values are checked as any id field's (integer_ids)."""
    from sharddemo.errors import UsageError

    error = error or UsageError
    if torch.is_tensor(values):
        if values.dim() != 2 or values.shape[1] < 2:
            return None
        flat = integer_ids(values, label, error, keys=keys)
        return flat, np.full(values.shape[0], values.shape[1], dtype=np.int64)
    if not isinstance(values, (list, tuple)):
        return None
    rowish = (list, tuple, np.ndarray)
    if not any(isinstance(v, rowish) for v in values):
        if any(torch.is_tensor(v) and v.dim() for v in values):
            raise error(f"{label} is a list of tensors: the DataLoader's default collate makes "
                        "that of a list each sample returns (one tensor per position, the batch "
                        "transposed); return a tensor from __getitem__ (the batch is then a 2-D "
                        "tensor, one row a sample's pack, padded with -1) or lists of ids from "
                        "a collate_fn")
        return None
    rows = [v if isinstance(v, rowish) else [v] for v in values]
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    values = [x for r in rows for x in r]
    if any(isinstance(x, (str, bytes)) for x in values):
        raise error(f"{label} holds packed rows of keys (str, bytes): packed rows are read for "
                    "integer ids 0..N-1 only")
    if any(isinstance(x, rowish) or (torch.is_tensor(x) and x.dim()) for x in values):
        raise error(f"{label} holds rows of rows; a packed field holds, in each row, the ids "
                    "of the samples packed in it (a list of ints, or a 2-D tensor padded "
                    "with -1)")
    return integer_ids(values, label, error, keys=keys), lengths


def flatten_packs(flat: np.ndarray, lengths: np.ndarray,
                  packs: Optional[Packs] = None) -> np.ndarray:
    """Return the ids of the samples in packed rows (`flat`, each row's `lengths`), in row order.

    The -1s that end a row are padding, dropped. A sample split across two consecutive rows
    (the last id of one row is the first id of the next: a pack that ends part-way through a
    sample, continued in the next) is one sample: its second appearance is dropped and
    `packs.split` counts it once (a sample over three rows or more too). `packs` carries the
    last row of the rank's previous batch, so a sample split across two batches counts once
    as well; None: the rows of this batch alone. An id repeated anywhere else stays: a
    duplicate."""
    count = len(lengths)
    starts = np.cumsum(lengths) - lengths
    row = np.repeat(np.arange(count), lengths)
    at = np.arange(flat.size) - starts[row]  # each value's position in its row
    real = flat != PAD
    last = np.full(count, -1, dtype=np.int64)  # each row's last real position (-1: none)
    np.maximum.at(last, row[real], at[real])
    kept = flat[at <= last[row]]
    sizes = last + 1
    firsts = np.cumsum(sizes) - sizes  # each row's first id in `kept`
    full = sizes > 0
    prev_last = np.empty(count, dtype=np.int64)
    prev_full = np.zeros(count, dtype=bool)
    if count:
        ends = firsts + sizes - 1
        prev_last[1:] = kept[np.maximum(ends[:-1], 0)] if kept.size else 0
        prev_full[1:] = full[:-1]
        had = packs is not None and packs.last is not None
        prev_full[0] = had
        prev_last[0] = packs.last if had and packs is not None else 0
    first_ids = kept[np.minimum(firsts, max(kept.size - 1, 0))] if kept.size else prev_last
    merged = full & prev_full & (first_ids == prev_last)
    if packs is None or not count:
        return np.delete(kept, firsts[merged]) if merged.any() else kept
    # a merged row of one id continues the sample into the next row: no new split there
    continued = merged & (sizes == 1)
    before = np.empty(count, dtype=bool)
    before[0] = packs.continued
    before[1:] = continued[:-1]
    packs.split += int(np.count_nonzero(merged & ~before))
    packs.last = int(kept[-1]) if full[-1] else None
    packs.continued = bool(continued[-1])
    return np.delete(kept, firsts[merged]) if merged.any() else kept


def packed_ids(values, label: str, error=None, packs: Optional[Packs] = None,
               keys: bool = True) -> Optional[torch.Tensor]:
    """Return a packed id field's sample ids (flatten_packs: padding dropped, a sample split
    across consecutive rows once) as a 1-D int64 tensor on the CPU; None where the field holds
    one sample a row (read by integer_ids)."""
    got = packed_rows(values, label, error, keys)
    if got is None:
        return None
    flat, lengths = got
    return torch.from_numpy(flatten_packs(flat.numpy(), lengths, packs))
