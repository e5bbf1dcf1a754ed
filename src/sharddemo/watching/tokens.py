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
        self.by_source: dict = {}  # name -> [samples, tokens] (host ints or device tensors)
        self.source_counts: Any = None  # int sources: per-index counts (device)
        self.source_tokens: Any = None

    def add(self, batch) -> None:
        """One batch's fields, summed where they are (a ValueError names a field it lacks)."""
        from sharddemo.rank.ids import field_values

        per_sample = None
        if self.token_fields:
            field = self.token_fields[0]
            values = torch.as_tensor(field_values(batch, field, f"sharddemo.watch: tokens "
                                                  f"{field!r}", ValueError))
            if is_labels(field):
                mask = values != IGNORE_INDEX
                per_sample = mask.reshape(mask.shape[0], -1).sum(1) if mask.dim() > 1 else mask
                self.has_slots = False
            elif values.dim() >= 2:  # a mask: its nonzero entries are the tokens
                per_sample = (values != 0).reshape(values.shape[0], -1).sum(1)
                self.slots = self.slots + values[0].numel() * values.shape[0]
                self.has_slots = True
            else:  # one length a sample
                per_sample = values.to(torch.int64)
                self.has_slots = False
            self.tokens = self.tokens + per_sample.sum()
        for field in self.label_fields:
            values = torch.as_tensor(field_values(batch, field, f"sharddemo.watch: tokens "
                                                  f"{field!r}", ValueError))
            self.supervised = self.supervised + (values != IGNORE_INDEX).sum()
        if self.sources is not None:
            self.add_sources(field_values(batch, self.sources, f"sharddemo.watch: sources "
                                          f"{self.sources!r}", ValueError), per_sample)

    def add_sources(self, values, per_sample) -> None:
        if torch.is_tensor(values) and not values.is_floating_point():
            index = values.reshape(-1).to(torch.int64)
            if index.numel() and self.source_counts is None:
                self.source_counts = torch.zeros(0, dtype=torch.int64, device=index.device)
                self.source_tokens = torch.zeros(0, dtype=torch.int64, device=index.device)
            counts = torch.bincount(index, minlength=self.source_counts.numel())
            self.source_counts = grow(self.source_counts, counts.numel()) + counts
            if per_sample is not None:
                tokens = torch.bincount(index, weights=per_sample.to(torch.float64),
                                        minlength=self.source_counts.numel()).to(torch.int64)
                self.source_tokens = grow(self.source_tokens, tokens.numel()) + tokens
            return
        names = [str(v) for v in (values.tolist() if torch.is_tensor(values) else values)]
        lengths = per_sample.tolist() if per_sample is not None else [0] * len(names)
        for name, (count, tokens) in named_counts(names, lengths).items():
            row = self.by_source.setdefault(name, [0, 0])
            row[0] += count
            row[1] += tokens

    def take(self) -> dict:
        """The epoch's sums as host ints (one read of each device sum), then empty."""
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
        self.reset()
        return part


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
