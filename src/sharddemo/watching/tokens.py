"""The watch's tokens and sources on one rank (`watch(..., tokens=, sources=, weights=)`):
each batch's token fields and source field read and summed where they are (a GPU's tensors
stay there: no host sync a step), read once at the epoch's end and exchanged in one small
collective; the judgement is analysis/tokens.py's.

A token field is one of: a 0/1 mask, batch x length (`attention_mask`: its ones are the tokens,
its size the slots, the rest padding); per-sample lengths, one number a sample; or labels,
batch x length, named with "label" (its entries other than -100 are the supervised tokens).
`tokens=("attention_mask", "labels")` gives both: the tokens from the mask, the supervised
ones from the labels. A source field holds each sample's source: an int index or a name."""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import torch

# a label that is no supervised token (the loss ignores it: torch's cross_entropy default)
IGNORE_INDEX = -100


def is_labels(field: Any) -> bool:
    return isinstance(field, str) and "label" in field.lower()


class TokenMeter:
    """One rank's token and source sums for the open epoch."""

    def __init__(self, tokens: Any, sources: Any) -> None:
        fields = tokens if isinstance(tokens, (tuple, list)) else ((tokens,) if tokens is not None
                                                                   else ())
        self.label_fields = [f for f in fields if is_labels(f)]
        self.token_fields = [f for f in fields if not is_labels(f)] or self.label_fields[:1]
        self.sources = sources
        self.reset()

    def reset(self) -> None:
        self.tokens: Any = 0  # (tensors on the batch's device once a batch came)
        self.slots: Any = 0
        self.supervised: Any = 0
        self.has_slots = None  # the token field is a mask (its size: the slots)
        self.by_source: dict = {}  # name -> [samples, tokens] (host ints)
        self.source_counts: Any = None  # int sources: per-index counts (device)
        self.source_tokens: Any = None
        # the fields of the batches not yet summed: (token field, labels, sources) a batch,
        # kept as they came and summed SETTLE_BATCHES at a time (settle): a handful of
        # operations for them all, not a handful a step
        self.pending: list = []
        self.pending_size = 0

    # batches kept before their fields are summed, and the most entries they may hold (32 MB
    # of int64 at most, on their device)
    SETTLE_BATCHES = 64
    SETTLE_SIZE = 1 << 22

    def add(self, batch):
        """One batch's fields, kept to be summed (a ValueError names a field it lacks); returns
        its token field (None without one)."""
        tokens = labels = sources = None
        if self.token_fields:
            tokens = self.read(batch, self.token_fields[0], "tokens")
        if self.label_fields and self.label_fields[0] != (self.token_fields or [None])[0]:
            labels = self.read(batch, self.label_fields[0], "tokens")
        if self.sources is not None:
            sources = self.read(batch, self.sources, "sources")
            if not (torch.is_tensor(sources) and not sources.is_floating_point()):
                self.add_named(sources, tokens)  # (names: host data, counted as they come)
                sources = None
        self.pending.append((tokens, labels, sources))
        self.pending_size += sum(t.numel() for t in (tokens, labels) if t is not None)
        if len(self.pending) >= self.SETTLE_BATCHES or self.pending_size >= self.SETTLE_SIZE:
            self.settle()
        return tokens

    def token_field(self, batch):
        """The batch's token field alone (None without one): what a rank that does not count
        (a mesh's peer) keeps for its lineage."""
        return self.read(batch, self.token_fields[0], "tokens") if self.token_fields else None

    @staticmethod
    def read(batch, field, what: str):
        """A batch's field: a dict key or a tuple position at once, else by the id field's
        rule (rank.ids.field_values, with its error)."""
        try:
            if isinstance(batch, dict) or isinstance(batch, (tuple, list)) and isinstance(
                    field, int):
                value = batch[field]
                if torch.is_tensor(value):
                    return value
                return torch.as_tensor(value) if not isinstance(value, (list, tuple)) or (
                    value and not isinstance(value[0], str)) else value
        except (KeyError, IndexError, TypeError):
            pass
        from sharddemo.rank.ids import field_values

        value = field_values(batch, field, f"sharddemo.watch: {what}={field!r}", ValueError,
                             ids=False)
        return torch.as_tensor(value) if not isinstance(value, (list, tuple)) or (
            value and not isinstance(value[0], str)) else value

    def settle(self) -> None:
        """Sum the kept batches' fields: those of one shape together."""
        pending, self.pending, self.pending_size = self.pending, [], 0
        by_shape: dict = {}
        for entry in pending:
            key = tuple(tuple(t.shape) if t is not None else None for t in entry)
            by_shape.setdefault(key, []).append(entry)
        for group in by_shape.values():
            tokens, labels, sources = (
                (torch.cat([e[k] for e in group]) if len(group) > 1 else group[0][k])
                if group[0][k] is not None else None for k in range(3))
            per_sample = None
            if tokens is not None and (sources is not None or self.label_fields
                                       and labels is None):
                # (each sample's: the sources' tokens need them)
                per_sample = self.count(tokens, self.token_fields[0])
                self.tokens = self.tokens + per_sample.sum()
            elif tokens is not None:  # (the total alone: one count over them all)
                self.tokens = self.tokens + self.total(tokens, self.token_fields[0])
            if labels is not None:
                self.supervised = self.supervised + torch.count_nonzero(labels != IGNORE_INDEX)
            elif self.label_fields and tokens is not None:  # (the labels are the token field)
                self.supervised = self.supervised + per_sample.sum()
            if sources is not None:
                self.add_indexed(sources, per_sample)

    def count(self, values: torch.Tensor, field) -> torch.Tensor:
        """Each sample's tokens from a token field (a mask, lengths or labels); a mask's size
        goes to the slots. A mask's nonzero entries are its tokens (a packer's mask may hold
        segment numbers 1, 2, ..., not ones): row_tokens."""
        self.has_slots = not is_labels(field) and values.dim() >= 2
        if self.has_slots:
            self.slots = self.slots + values.numel()
        return row_tokens(values, field)

    def total(self, values: torch.Tensor, field) -> torch.Tensor:
        """A token field's tokens, all of its batches together (one count)."""
        if is_labels(field):
            self.has_slots = False
            return torch.count_nonzero(values != IGNORE_INDEX)
        if values.dim() >= 2:
            self.has_slots = True
            self.slots = self.slots + values.numel()
            return torch.count_nonzero(values)
        self.has_slots = False
        return values.to(torch.int64).sum()

    def add_indexed(self, values: torch.Tensor, per_sample) -> None:
        index = values.reshape(-1).to(torch.int64)
        if self.source_counts is None:
            self.source_counts = torch.zeros(0, dtype=torch.int64, device=index.device)
            self.source_tokens = torch.zeros(0, dtype=torch.int64, device=index.device)
        counts = torch.bincount(index, minlength=self.source_counts.numel())
        self.source_counts = grow(self.source_counts, counts.numel()) + counts
        if per_sample is not None:
            tokens = torch.bincount(index, weights=per_sample.to(torch.float64),
                                    minlength=self.source_counts.numel()).to(torch.int64)
            self.source_tokens = grow(self.source_tokens, tokens.numel()) + tokens

    def add_named(self, values, tokens) -> None:
        names = [str(v) for v in (values.tolist() if torch.is_tensor(values) else values)]
        # (each row's tokens alone: the batch's slots are counted when it is summed, once)
        lengths = ([int(x) for x in row_tokens(torch.as_tensor(tokens), self.token_fields[0])]
                   if tokens is not None else [0] * len(names))
        for name, (count, length) in named_counts(names, lengths).items():
            row = self.by_source.setdefault(name, [0, 0])
            row[0] += count
            row[1] += length

    def so_far(self) -> int:
        """The epoch's tokens so far (a window's exchange: one read of the device sum)."""
        self.settle()
        return int(self.tokens)

    def take(self, keep: bool = False) -> dict:
        """The epoch's sums as host ints (one read of each device sum), then empty (`keep`:
        not emptied, a checkpoint's look at the epoch so far)."""
        self.settle()
        part: dict = {"tokens": int(self.tokens), "slots": int(self.slots) if self.has_slots
                      else None,
                      "supervised": int(self.supervised) if self.label_fields else None}
        sources = {name: list(row) for name, row in self.by_source.items()}
        if self.source_counts is not None:
            counts = self.source_counts.tolist()
            tokens = (self.source_tokens.tolist() if self.source_tokens is not None
                      else [0] * len(counts))
            for index, count in enumerate(counts):
                if count:
                    row = sources.setdefault(str(index), [0, 0])
                    row[0] += count
                    row[1] += tokens[index] if index < len(tokens) else 0
        part["sources"] = sources if self.sources is not None else None
        if not keep:
            self.reset()
        return part


def add_parts(before: list[dict], after: list[dict]) -> list[dict]:
    """Each group's sums before a restart and after it, added group by group (the same
    groups: a run resumed on as many data-parallel groups)."""
    from sharddemo.analysis.tokens import source_totals

    def plus(a, b):
        return None if a is None or b is None else a + b

    out = []
    for x, y in zip(before, after):
        sources = None
        if x.get("sources") is not None and y.get("sources") is not None:
            sources = source_totals([x, y])  # (the two parts' {name: [samples, tokens]})
        out.append({"tokens": plus(x.get("tokens"), y.get("tokens")),
                    "slots": plus(x.get("slots"), y.get("slots")),
                    "supervised": plus(x.get("supervised"), y.get("supervised")),
                    "sources": sources if sources is not None else y.get("sources"),
                    # (a part of the chain lost: what came before an earlier stop)
                    **({"after_restart": True} if x.get("after_restart") else {})})
    return out


def grow(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """`tensor` padded with zeros to `size` (a source index first seen)."""
    if tensor.numel() >= size:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(size - tensor.numel())])


def named_counts(names: list[str], lengths: list[int]) -> dict[str, tuple[int, int]]:
    """{name: (samples, tokens)} of one batch's named sources."""
    counts = Counter(names)
    tokens: Counter = Counter()
    for name, length in zip(names, lengths):
        tokens[name] += int(length)
    return {name: (counts[name], tokens[name]) for name in counts}


def exchange_parts(ranks, part: dict, speakers: Optional[list[int]]) -> list[dict]:
    """Every rank's part (one small collective), then each data-parallel group's (its first
    rank's, `speakers` on a mesh; every rank's off one)."""
    from sharddemo.rank.collect import collective, exchange_objects

    dist = torch.distributed
    if ranks.num_processes == 1:
        parts = [part]
    elif dist.is_available() and dist.is_initialized():
        parts = [None] * dist.get_world_size()
        collective(dist.all_gather_object, parts, part)
    else:
        parts = exchange_objects(ranks, part)
    return [parts[r] for r in speakers] if speakers is not None else parts


def step_tokens(values: torch.Tensor, field) -> torch.Tensor:
    """A batch's tokens from its token field, one tensor a batch (a mask's nonzero entries,
    lengths summed, labels other than -100): what the lineage keeps for each step."""
    if is_labels(field):
        return torch.count_nonzero(values != IGNORE_INDEX)
    if values.dim() >= 2:
        return torch.count_nonzero(values)
    return values.to(torch.int64).sum()


def row_tokens(values: torch.Tensor, field) -> torch.Tensor:
    """Each row's tokens from a token field: a mask's nonzero entries, labels other than -100,
    or the lengths themselves. A row's count is its bools' sum read as bytes: a third to a
    sixth of `(mask != 0).sum(1)`'s time (docs/benchmarks.md, "Tokens")."""
    if is_labels(field):
        mask = values != IGNORE_INDEX
        return _row_sums(mask) if mask.dim() > 1 else mask.to(torch.int64)
    if values.dim() >= 2:
        return _row_sums(values.bool())
    return values.to(torch.int64)


def _row_sums(flags: torch.Tensor) -> torch.Tensor:
    """Each row's True entries of a bool tensor (B x ...), as int64."""
    rows = flags.reshape(flags.shape[0], -1).view(torch.uint8)
    return rows.sum(1, dtype=torch.int32).to(torch.int64)
