"""Samples named by keys (a WebDataset `__key__`, a string id column), not by positions.

On a rank, each key a batch holds becomes a local id: 0, 1, 2, ... in the order this rank
first saw its keys, the same id for the same key every time (KeyTable). The walk records
those ids like any others; at the end of each epoch the ranks' tables travel to the main
process (exchange_tables), and there every rank's ids become its keys again, so the epoch's
record names its samples by key (name_record). The parent then numbers the keys 0..N-1 for the
analysis (analysis.keys) and names them again in the report.

Keys are exact: nothing is hashed, so two keys never merge. They cost what the keys
themselves weigh, once per rank: keys are audited on the id path (the ids of every batch
kept, as below a million samples), not the count path, which counts integer ids.

Rank 0 sees the batches [["a", "b"], ["c"]] and rank 1 [["b"], ["d", "a"]]: rank 0's table
is a -> 0, b -> 1, c -> 2 and its record [[0, 1], [2]], rank 1's b -> 0, d -> 1, a -> 2 and
[[0], [1, 2]]; after the exchange the main process's record is [[["a", "b"], ["c"]],
[["b"], ["d", "a"]]].
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from sharddemo.collect import exchange_ints, gather_ragged
from sharddemo.errors import RunFailed, UsageError


def key_values(values: Any) -> Optional[list]:
    """The keys in a batch's field, as a list of str (bytes decoded as UTF-8, an undecodable
    byte written as a backslash escape), or None when the field holds numbers. Keys come
    as a list or tuple of str/bytes (the DataLoader's default collate, WebDataset's
    batching), a numpy array of strings, or one str/bytes for an unbatched sample."""
    if isinstance(values, (str, bytes)):
        values = [values]
    elif isinstance(values, np.ndarray):
        if values.dtype.kind not in "USO":
            return None
        values = values.reshape(-1).tolist()
    elif not isinstance(values, (list, tuple)):
        return None
    if not values or not isinstance(values[0], (str, bytes)):
        return None
    out = []
    for v in values:
        if isinstance(v, bytes):
            v = v.decode("utf-8", "backslashreplace")
        elif not isinstance(v, str):
            raise UsageError(f"the id field mixes keys (str) with {type(v).__name__} values; "
                             "it must hold one kind of id")
        out.append(v)
    return out


class KeyTable:
    """This rank's keys -> local ids (first seen first). `counting`: set by the walk on the
    count path, which takes integer ids only: a key then stops the audit with one line."""

    def __init__(self, field: str) -> None:
        self.field = field
        self.ids: dict[str, int] = {}
        self.keys: list[str] = []
        self.counting = False
        self.numbers = False  # this rank's field held numbers

    def lookup(self, keys: list[str]) -> torch.Tensor:
        if self.counting:
            raise UsageError(f"--id-field {self.field} holds keys ({keys[0]!r}, ...), which "
                             "are audited on the id path; pass --gather epoch (from 1,000,000 "
                             "samples the audit otherwise counts, which takes integer ids)")
        ids, table = self.ids, self.keys
        out = np.empty(len(keys), dtype=np.int64)
        for k, key in enumerate(keys):
            local = ids.get(key)
            if local is None:
                local = ids[key] = len(table)
                table.append(key)
            out[k] = local
        return torch.from_numpy(out)

    def encode(self) -> torch.Tensor:
        """The table as one uint8 tensor: each key's UTF-8 bytes, each preceded by its length
        in 4 bytes (little-endian), in local-id order."""
        parts = []
        for key in self.keys:
            data = key.encode("utf-8", "surrogatepass")
            parts.append(len(data).to_bytes(4, "little"))
            parts.append(data)
        blob = b"".join(parts)
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else \
            torch.empty(0, dtype=torch.uint8)


def decode(blob: bytes) -> list[str]:
    keys, pos = [], 0
    while pos < len(blob):
        size = int.from_bytes(blob[pos:pos + 4], "little")
        keys.append(blob[pos + 4:pos + 4 + size].decode("utf-8", "surrogatepass"))
        pos += 4 + size
    return keys


def exchange_tables(accelerator, table: KeyTable) -> Optional[list[list[str]]]:
    """A collective (every rank, each epoch's end, where --id-field is given): every rank's
    key table on the main process (None elsewhere), or None on every rank where no rank saw a
    key. A rank that saw keys beside one that saw numbers is one error line."""
    blob = table.encode()
    heads = exchange_ints(accelerator, [len(table.keys), int(table.numbers), blob.numel()])
    if not any(h[0] for h in heads):
        return None
    if any(h[1] for h in heads):
        raise RunFailed(f"--id-field {table.field} held keys (str) on some ranks and numbers "
                        "on others; it must hold one kind of id")
    parts = gather_ragged(accelerator, blob, [h[2] for h in heads])
    if not accelerator.is_main_process:
        return None
    return [decode(bytes(part.numpy().tobytes())) for part in parts]


def name_record(record: dict, tables: list[list[str]]) -> dict:
    """The epoch's record with every rank's local ids replaced by its keys: each rank's
    batches, and what the per-batch gathers returned (`gathered_for_metrics`: every step's
    batches in rank order, the last step cut where accelerate cut it)."""
    per_rank = []
    for entry, table in zip(record["ranks"], tables):
        per_rank.append([[table[i] for i in batch] for batch in entry["batches"]])
    metrics = record.get("gathered_for_metrics")
    if metrics is not None:
        flat, named = [], []
        steps = max((len(b) for b in per_rank), default=0)
        for step in range(steps):
            for r, entry in enumerate(record["ranks"]):
                if step < len(entry["batches"]):
                    flat += entry["batches"][step]
                    named += per_rank[r][step]
        # the gathers returned the ranks' local ids in this order; a check that they did
        metrics = named[:len(metrics)] if flat[:len(metrics)] == list(metrics) else None
    out = dict(record)
    out["ranks"] = [dict(entry, batches=batches)
                    for entry, batches in zip(record["ranks"], per_rank)]
    out["gathered_for_metrics"] = metrics
    out["ids_are_keys"] = True
    return out
