"""Samples named by keys (a WebDataset `__key__`, a string id column), not by positions.

On a rank, each key a batch holds becomes a local id: 0, 1, 2, ... in the order this rank
first saw its keys, the same id for the same key every time (KeyTable). The walk records
those ids like any others; at the end of each epoch the ranks' tables travel to the main
process (exchange_tables), and there every rank's ids become its keys again, so the epoch's
record names its samples by key (name_record). The parent then numbers the keys 0..N-1 for the
analysis (analysis.keys) and names them again in the report.

On the id path keys are exact: nothing is hashed, so two keys never merge. They cost what
the keys themselves weigh, once per rank.

On the count path (a million samples and more, or --gather count) a rank keeps no table of
keys: every key is hashed (key_hashes: a 128-bit xxh3 digest of its UTF-8 bytes, read as two
64-bit halves) and looked up in a KeyIndex of the known keys (a file of keys, or the
dataset's own column: source_keys), which holds each known key's 64-bit hash, its 64-bit
check (the other half) and its position, 24 bytes a key. A key's position is its sample id,
so the count path counts keys exactly as it counts integer ids. Two known keys with the same
64-bit hash are kept apart by their checks, and so is a delivered key whose hash is a known
key's but whose check is not: the collision is recorded and reported, never merged (two keys
would merge only if both 64-bit halves agreed). A key the index does not hold is outside the
dataset. Without a known set of keys the count path has nothing to number them by, and says
so in one line.

Rank 0 sees the batches [["a", "b"], ["c"]] and rank 1 [["b"], ["d", "a"]]: rank 0's table
is a -> 0, b -> 1, c -> 2 and its record [[0, 1], [2]], rank 1's b -> 0, d -> 1, a -> 2 and
[[0], [1, 2]]; after the exchange the main process's record is [[["a", "b"], ["c"]],
[["b"], ["d", "a"]]].
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from sharddemo.rank.collect import exchange_ints, gather_ragged
from sharddemo.errors import RunFailed, UsageError
from sharddemo.record import LIST_CAP


def key_values(values: Any) -> Optional[list]:
    """Return the keys in a batch's field as a list of str, or None when it holds numbers.

    Bytes decoded as UTF-8, an undecodable byte written as a backslash escape. Keys come as a
    list or tuple of str/bytes (the DataLoader's default collate, WebDataset's batching), a
    numpy array of strings, or one str/bytes for an unbatched sample."""
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


def key_hashes(keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Return each key's 128-bit xxh3 digest of its UTF-8 bytes, as two 64-bit halves.

    (hash, check), two uint64 arrays. Not a cryptographic hash; nothing here needs one."""
    import xxhash

    digest = xxhash.xxh3_128_digest
    blob = b"".join(digest(key.encode("utf-8", "surrogatepass")) for key in keys)
    halves = np.frombuffer(blob, dtype="<u8").reshape(len(keys), 2)
    return halves[:, 0].copy(), halves[:, 1].copy()


# The first id of a key outside the index: N + the top 62 bits of its hash, the same on every
# rank (so the ranks' lists of such keys agree) and inside int64.
OUTSIDE_SHIFT = 2


class KeyIndex:
    """The known keys by their 64-bit hashes, for the count path (key k is sample id k).

    In the order given. `lookup(keys)` gives each key's id, or N + (hash >> 2) for a key outside
    it. Built from chunks of keys (a file's lines, a dataset column's batches), holding 24 bytes
    a key and no key itself. `label`: where the keys come from, for the messages."""

    def __init__(self, chunks, label: str) -> None:
        hashes, checks = [], []
        for chunk in chunks:
            if chunk:
                h, c = key_hashes(chunk)
                hashes.append(h)
                checks.append(c)
        h = np.concatenate(hashes) if hashes else np.empty(0, np.uint64)
        c = np.concatenate(checks) if checks else np.empty(0, np.uint64)
        order = np.argsort(h, kind="stable")  # by hash; keys of one hash in key order
        self.hashes, self.checks = h[order], c[order]
        self.slots = order.astype(np.int64)
        self.n = int(h.size)
        self.label = label
        # keys that share a 64-bit hash (rare: a run of equal hashes): the same key listed
        # twice (its check the same too) is refused; two keys are a collision, told apart by
        # their checks: id pairs
        self.known_collisions = []
        for i in np.flatnonzero(self.hashes[1:] == self.hashes[:-1]).tolist():
            start = i
            while start > 0 and self.hashes[start - 1] == self.hashes[i]:
                start -= 1
            for j in range(start, i + 1):
                a, b = sorted((int(self.slots[j]), int(self.slots[i + 1])))
                if self.checks[j] == self.checks[i + 1]:
                    raise UsageError(f"{label}: key {b} is key {a} again (0-based); each "
                                     "sample's key must be listed once")
                self.known_collisions.append([a, b])
        self.known_collisions.sort()
        self.reset()

    def reset(self) -> None:
        """Start an epoch's log of collisions and outside keys."""
        self.collisions: list[tuple[str, int]] = []  # (delivered key, the known id it hit)
        self.collision_count = 0
        self.outside: dict[int, str] = {}  # outside id -> its key, the first LIST_CAP

    def lookup(self, keys: list[str]) -> torch.Tensor:
        h, c = key_hashes(keys)
        n = self.n
        pos = np.searchsorted(self.hashes, h)
        at = np.minimum(pos, max(n - 1, 0))
        hit = (pos < n) & (self.hashes[at] == h) if n else np.zeros(len(keys), bool)
        exact = hit & (self.checks[at] == c) if n else hit
        out = np.where(exact, self.slots[at] if n else 0, -1).astype(np.int64)
        for k in np.flatnonzero(hit & ~exact).tolist():
            # the same hash as a known key: the one whose check agrees, if any
            p = int(pos[k])
            while p < n and self.hashes[p] == h[k]:
                if self.checks[p] == c[k]:
                    out[k] = self.slots[p]
                    break
                p += 1
            else:
                self.collision_count += 1
                if len(self.collisions) < LIST_CAP:
                    self.collisions.append((keys[k], int(self.slots[pos[k]])))
        miss = np.flatnonzero(out < 0)
        if miss.size:
            ids = n + (h[miss] >> np.uint64(OUTSIDE_SHIFT)).astype(np.int64)
            out[miss] = ids
            for k, i in zip(miss.tolist(), ids.tolist()):
                if len(self.outside) >= LIST_CAP:
                    break
                self.outside.setdefault(i, keys[k])
        return torch.from_numpy(out)

    def events(self) -> dict:
        """This epoch's collisions and outside keys (plain data), and a fresh log."""
        out = {"collisions": self.collisions, "collision_count": self.collision_count,
               "outside": self.outside}
        self.reset()
        return out


def file_keys(path: str, chunk: int = 1 << 16):
    """The keys of a --keys file in chunks (as audit.read_keys reads it: one per line)."""
    with open(path, encoding="utf-8", newline="") as handle:
        lines = []
        for line in handle:
            lines.append(line.rstrip("\n").rstrip("\r"))
            if len(lines) == chunk:
                yield lines
                lines = []
        if lines:
            yield lines


def source_keys(loader, field: str):
    """Return the set of keys the loader's own dataset holds in `field`, where it says.

    A datasets.Dataset (as the loader reads it: a view's own rows) whose column `field` holds
    strings or bytes -> (a function giving its keys in chunks, N); else None."""
    from sharddemo.rank.describe import base_loader

    dataset = getattr(base_loader(loader), "dataset", None)
    dataset = getattr(dataset, "_inner", dataset)  # (a loader tagged on its way to prepare)
    features = getattr(dataset, "features", None)
    if features is None or not hasattr(dataset, "select_columns") or field not in features:
        return None
    dtype = getattr(features[field], "dtype", None)
    if dtype not in ("string", "large_string", "binary", "large_binary"):
        return None
    column = dataset.select_columns([field]).with_format(None)

    def chunks(size: int = 1 << 16):
        for start in range(0, len(column), size):
            values = column[start:start + size][field]
            yield [v.decode("utf-8", "backslashreplace") if isinstance(v, bytes) else v
                   for v in values]

    return chunks, len(column)


class KeyTable:
    """This rank's keys -> local ids (first seen first), on the id path.

    `counting`: set by the walk on the count path, where the keys' ids come from `index` (a
    KeyIndex of the known keys, built at the first batch from `known`: a function giving the
    keys in chunks) instead; without one, a key stops the audit with one line."""

    def __init__(self, field: str, known=None, known_from: str = "") -> None:
        self.field = field
        self.ids: dict[str, int] = {}
        self.keys: list[str] = []
        self.counting = False
        self.numbers = False  # this rank's field held numbers
        self.known, self.known_from = known, known_from
        self.known_count: Optional[int] = None  # how many keys `known` gives
        self.index: Optional[KeyIndex] = None

    def lookup(self, keys: list[str]) -> torch.Tensor:
        if self.counting:
            if self.known is None:
                raise UsageError(
                    f"--id-field {self.field} holds keys (str), and the count path numbers "
                    "keys by the set of all keys, which is not known here; pass --keys "
                    "FILE listing every sample's key, or --gather epoch (from 1,000,000 "
                    "samples the audit otherwise counts)")
            if self.index is None:
                self.index = KeyIndex(self.known(), self.known_from)
            return self.index.lookup(keys)
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
        """Return the table as one uint8 tensor, in local-id order.

        Each key's UTF-8 bytes, each preceded by its length in 4 bytes (little-endian)."""
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
    """Bring every rank's key table to the main process, a collective.

    Called on every rank at each epoch's end, where --id-field is given: the tables on the main
    process (None elsewhere), or None on every rank where no rank saw a key. A rank that saw
    keys beside one that saw numbers is one error line."""
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
    """Return the epoch's record with every rank's local ids replaced by its keys.

    Each rank's batches, and what the per-batch gathers returned (`gathered_for_metrics`: every
    step's batches in rank order, the last step cut where accelerate cut it)."""
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


def exchange_key_events(accelerator, table: KeyTable) -> Optional[dict]:
    """Merge every rank's collisions and outside keys on the main process, a collective.

    Called on every rank at each counted epoch's end, where the field held keys; None elsewhere,
    and on every rank where no rank looked a key up."""
    from sharddemo.rank.collect import exchange_objects

    index = table.index
    mine = None if index is None else {**index.events(), "n": index.n,
                                       "known_collisions": index.known_collisions}
    rows = [r for r in exchange_objects(accelerator, mine) if r is not None]
    if not rows or not accelerator.is_main_process:
        return None
    outside: dict[int, str] = {}
    for r in rows:
        for i, key in r["outside"].items():
            outside.setdefault(int(i), key)
    return {"n": rows[0]["n"], "known_collisions": rows[0]["known_collisions"],
            "collisions": [list(c) for r in rows for c in r["collisions"]][:LIST_CAP],
            "collision_count": sum(r["collision_count"] for r in rows),
            "outside": {str(i): k for i, k in sorted(outside.items())[:LIST_CAP]}}
