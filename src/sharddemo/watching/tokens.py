"""The watch's tokens and sources on one rank (`watch(..., tokens=, sources=, weights=)`):
each batch's token fields and source field read and summed where they are (a GPU's tensors
stay there: no host sync a step), read once at the epoch's end (in the last window's rows,
else in one small collective); the judgement is analysis/tokens.py's.

A token field is one of: a 0/1 mask, batch x length (`attention_mask`: its ones are the tokens,
its size the slots, the rest padding); per-sample lengths, one number a sample; or labels,
batch x length, named with "label" (its entries other than -100 are the supervised tokens).
`tokens=("attention_mask", "labels")` gives both: the tokens from the mask, the supervised
ones from the labels. A source field holds each sample's source: an int index or a name."""

from __future__ import annotations

import math
from collections import Counter
from itertools import zip_longest
from operator import attrgetter, itemgetter
from typing import Any, Optional

import torch

# a label that is no supervised token (the loss ignores it: torch's cross_entropy default)
IGNORE_INDEX = -100
# a tensor's shape (torch.Size: a tuple), read in one C call a tensor
SHAPE = attrgetter("shape")
# Each source's samples and tokens summed in one bincount (TokenMeter.add_indexed): each row
# weighs PACK + its tokens, so a source's sum is samples x PACK + tokens. Exact while the
# tokens summed so (since the last fold) stay under PACK and the rows under PACKED_ROWS: a
# source's sum is then at most (2^26 - 1) x 2^27 + 2^27 - 1 = 2^53 - 1, and every partial sum
# of bincount's (in any order, a GPU's atomics too) is an integer no larger, which float64
# holds exactly; samples = sum >> 27, tokens = sum & (PACK - 1). One bincount a settle, not
# two and their conversions (docs/benchmarks.md, "Tokens").
PACK_BITS = 27
PACK = 1 << PACK_BITS
PACKED_ROWS = 1 << (53 - PACK_BITS)


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
        # what a batch is read for, in the order add() keeps them: its token field, its labels
        # (where they are not the token field) and its sources
        token = self.token_fields[0] if self.token_fields else None
        labels = self.label_fields[0] if self.label_fields and self.label_fields[0] != token \
            else None
        self.keys = tuple(k for k in (token, labels, sources) if k is not None)
        self.has = (token is not None, labels is not None, sources is not None)
        # each field in one C call (operator.itemgetter), for the batches of the kind whose
        # fields the first batch showed to be tensors read by key or position at once (`direct`:
        # that batch's type), so that each batch costs a handful of Python operations: no
        # field's rule looked up again a step (plain tensors only: a subclass is read by the
        # rule each time)
        self.get = itemgetter(*self.keys) if len(self.keys) > 1 else (
            (lambda batch, key=self.keys[0]: (batch[key],)) if self.keys else None)
        self.direct: Any = None
        self.reset()

    def reset(self) -> None:
        self.tokens: Any = 0  # (tensors on the batch's device once a batch came)
        self.slots: Any = 0
        self.supervised: Any = 0
        self.has_slots = None  # the token field is a mask (its size: the slots)
        self.by_source: dict = {}  # name -> [samples, tokens] (host ints)
        self.source_counts: Any = None  # int sources: per-index counts (device)
        self.source_tokens: Any = None
        # int sources' samples and tokens since the last fold, packed (PACK; float64, device),
        # and the rows and token entries they hold (the bounds that keep them exact); their
        # tokens are in neither `tokens` nor `source_tokens` (read: unpacked; moved: fold)
        self.packed: Any = None
        self.packed_rows = self.packed_entries = 0
        # the fields of the batches not yet summed (the tuple of `keys` a batch), kept as they
        # came and summed SETTLE_BATCHES at a time (settle): a handful of operations for them
        # all, not a handful a step
        self.pending: list = []
        self.settle_at = self.SETTLE_BATCHES  # (fewer for large batches: SETTLE_BYTES)
        self.pending_named = False  # (a kept batch's sources were names: its sources None)

    # batches kept before their fields are summed, and the most bytes their token fields may
    # hold (on their device; counted from the mean size of the batches summed last, and the
    # size of a batch read by its fields' rule: batches larger than those before them may
    # take a window over it). A sum's fixed part (some fifteen torch calls, each several
    # microseconds on the caches a training step has emptied) is spread over up to 256 small
    # batches; 8 MB keeps the batches a sum reads few enough to be read back from the
    # processor's cache, not memory (a quarter of a 32 MB L3; 256 batches of a mask and labels
    # in int64, 32 MB, were slower a step than 64): docs/benchmarks.md, "Tokens"
    SETTLE_BATCHES = 256
    SETTLE_BYTES = 8 << 20

    def add(self, batch):
        """One batch's fields, kept to be summed (a ValueError names a field it lacks); returns
        its token field (None without one)."""
        if type(batch) is self.direct:  # (a batch of the kind seen: its fields at once)
            try:
                values = self.get(batch)
            except (KeyError, IndexError, TypeError):
                return self.add_read(batch)
            for value in values:  # (tensors, as add_read would keep them)
                if type(value) is not torch.Tensor:
                    return self.add_read(batch)
            # (nothing else asked of a tensor here: each call into torch costs about a
            # microsecond a step on caches a training step has emptied; its size and a source's
            # type are looked at when the kept batches are summed)
            self.pending.append(values)
            if len(self.pending) >= self.settle_at:
                self.settle()
            return values[0] if self.has[0] else None
        return self.add_read(batch)

    def keep(self, values: tuple) -> None:
        """One batch's fields kept (its sources None where they are names, counted already);
        the kept ones summed once there are enough."""
        self.pending.append(values)
        if self.has[0]:  # (fewer batches kept where they are large: SETTLE_BYTES)
            size = values[0].numel() * values[0].element_size() + (
                values[1].numel() * values[1].element_size() if self.has[1] else 0)
            self.settle_at = max(1, min(self.settle_at, self.SETTLE_BYTES // max(size, 1)))
        if len(self.pending) >= self.settle_at:
            self.settle()

    def add_read(self, batch):
        """add() for any batch: each field read by its rule (read); a batch whose fields are
        tensors under a key or position makes its type the one add() reads at once."""
        tokens = labels = sources = None
        if self.has[0]:
            tokens = self.read(batch, self.token_fields[0], "tokens")
        if self.has[1]:
            labels = self.read(batch, self.label_fields[0], "tokens")
        if self.has[2]:
            sources = self.read(batch, self.sources, "sources")
            if not (torch.is_tensor(sources) and not sources.is_floating_point()):
                self.add_named(sources, tokens)  # (names: host data, counted as they come)
                sources = None
        values = tuple(v for v, has in zip((tokens, labels, sources), self.has) if has)
        if sources is not None or not self.has[2]:
            try:  # (the same objects at once: batches of this kind are read so from now on)
                if (isinstance(batch, (dict, tuple, list)) or hasattr(batch, "keys")) and all(
                        a is b for a, b in zip(self.get(batch), values)):
                    self.direct = type(batch)
            except (KeyError, IndexError, TypeError):
                pass
        if sources is None and self.has[2]:
            self.pending_named = True
            if len(values) == 1:  # (the named sources alone: nothing to keep)
                return tokens
        self.keep(values)
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
        """Sum the kept batches' fields: each field's batches joined into one tensor (a
        handful of operations for them all); where they do not join (a field wider in one
        batch than in another: summed batch by batch, their row counts joined), and where one
        field has more dimensions in one batch than in another or sources are names, those of
        one shape together, as the sums were always made there."""
        pending, self.pending = self.pending, []
        named, self.pending_named = self.pending_named, False
        if not pending:
            return
        columns = list(zip(*pending))
        if not named:
            # (no check of the batches' shapes a batch first: each check of 64 tensors costs
            # about a microsecond a step; torch's join refuses what does not join)
            saved = self.sums()
            try:
                if self.sum_batches(columns, None):
                    return
            except RuntimeError:
                pass
            self.restore(saved)
        if self.has[2]:  # (floating point sources are names, '0.0': as add_read counts them)
            named = self.name_floats(pending) or named
        columns = list(zip(*pending))
        if not named:
            shapes = [list(map(SHAPE, column)) for column in columns]
            if all(len({len(s) for s in set(column)}) == 1 for column in shapes):
                self.sum_batches(columns, shapes)
                return
        kinds: dict = {}
        for entry in pending:
            key = tuple(tuple(v.shape) if v is not None else None for v in entry)
            kinds.setdefault(key, []).append(entry)
        for key, entries in kinds.items():
            self.sum_batches(list(zip(*entries)), [[k] * len(entries) for k in key])

    def sums(self) -> tuple:
        """The sums as they stand (restore puts them back): what settle's join changes."""
        return (self.tokens, self.slots, self.supervised, self.has_slots, self.source_counts,
                self.source_tokens, self.settle_at, self.packed, self.packed_rows,
                self.packed_entries)

    def restore(self, sums: tuple) -> None:
        (self.tokens, self.slots, self.supervised, self.has_slots, self.source_counts,
         self.source_tokens, self.settle_at, self.packed, self.packed_rows,
         self.packed_entries) = sums

    def name_floats(self, pending: list) -> bool:
        """The kept batches whose sources are floating point counted by name (add_named, as
        add_read does for a batch it reads so), their sources then None; whether there were."""
        if not any(entry[-1] is not None and entry[-1].is_floating_point() for entry in pending):
            return False
        for i, entry in enumerate(pending):
            if entry[-1] is not None and entry[-1].is_floating_point():
                self.add_named(entry[-1], entry[0] if self.has[0] else None)
                pending[i] = entry[:-1] + (None,)
        return True

    def sum_batches(self, columns: list, shapes: Optional[list]) -> bool:
        """Add kept batches of one kind to the sums: `columns`, each field's tensors in the
        batches' order (the token field, the labels, the sources: those asked for), and
        `shapes`, their shapes; None: each field's batches are joined, and a RuntimeError
        (torch's, where they do not join) leaves the sums half made (settle restores them),
        False where a batch's sources are floating point (names: nothing added)."""
        fields = iter(zip(columns, shapes or [None] * len(columns)))
        tokens, token_shapes = next(fields) if self.has[0] else (None, None)
        labels, label_shapes = next(fields) if self.has[1] else (None, None)
        sources, source_shapes = next(fields) if self.has[2] else (None, None)
        if sources is not None and sources[0] is None:  # (names: counted as they came)
            sources = None
        index = None
        if sources is not None:
            if source_shapes is None or {len(s) for s in set(source_shapes)} == {1}:
                index = joined(sources)
            else:
                index = torch.cat([s.reshape(-1) for s in sources])
            if index.is_floating_point():
                return False
        token_entries, token_sizes = 0, None
        if tokens is not None:
            # the next window's length, from these batches' mean size (SETTLE_BYTES)
            token_sizes = list(map(torch.Tensor.numel, tokens))
            token_entries = sum(token_sizes)
            size = token_entries * tokens[0].element_size() + (
                sum(map(torch.Tensor.numel, labels)) * labels[0].element_size()
                if labels is not None else 0)
            self.settle_at = max(1, min(self.SETTLE_BATCHES,
                                        self.SETTLE_BYTES * len(tokens) // max(size, 1)))
        rows = None
        packed = False  # (each source's samples and tokens in one bincount: add_indexed)
        if tokens is not None:
            field = self.token_fields[0]
            if sources is not None:  # (each row's: the sources' tokens need them)
                rows = self.count(tokens, token_shapes, field, token_entries)
                # a mask's or labels' rows count at most their entries (PACK's bound); the
                # labels as the token field are the supervised tokens too: summed here
                packed = (tokens[0].dim() >= 2 and not (self.label_fields and labels is None)
                          and token_entries < PACK and index.numel() < PACKED_ROWS)
                if not packed:  # (packed: the total added when the packed sums are read)
                    total = rows.sum()
            else:  # (the total alone: no row's count)
                total = self.total(tokens, token_shapes, field, token_entries)
            if not packed:
                self.tokens = self.tokens + total
                if self.label_fields and labels is None:  # (the labels are the token field)
                    self.supervised = self.supervised + total
        if labels is not None:
            self.supervised = self.supervised + count_flags(
                labels, label_shapes is None or uniform(label_shapes), labels=True)
        if index is None:
            return True
        lengths = None  # (each batch's rows, where its sources are not one a row)
        if rows is not None and token_shapes is None:
            # (joined at once: each batch's rows against its sources, so that a batch with a
            # source too few and another with one too many are torch's error, as summed alone,
            # not sources moved between rows. Joined, the batches' rows have one width (the
            # entries over the rows), so a batch's entries, read above, are its rows times it:
            # compared with its sources' numel(), no torch.Size made a tensor)
            count = rows.numel()
            width = token_entries // count if count and rows.dim() == 1 and tokens[0].dim() \
                else 0
            if width and width * count == token_entries:
                sizes = [width * size for size in map(torch.Tensor.numel, sources)]
                if token_sizes != sizes:
                    lengths = [size // width for size in token_sizes]
            else:  # (no rows, or a 0-d token field: the shapes read, as they were)
                token_shapes = list(map(SHAPE, tokens))
                source_shapes = list(map(SHAPE, sources))
        if rows is not None and token_shapes is not None:
            shaped = list(map(itemgetter(0), token_shapes))
            if shaped != list(map(math.prod, source_shapes)):
                lengths = shaped
        if lengths is not None:
            # (a batch whose sources are not one a row: torch's own error, as when each batch
            # was summed alone; joined, a count of sources other than of rows is that error)
            for one, part in zip(sources, rows.split(lengths)):
                self.add_indexed(one, part, token_entries if packed else None)
            return True
        self.add_indexed(index, rows, token_entries if packed else None)
        return True

    def count(self, values: tuple, shapes: Optional[list], field, size: int) -> torch.Tensor:
        """Each row's tokens of the kept batches' token field (a mask, lengths or labels), in
        the batches' order (row_tokens); a mask's size (`size`: the batches' entries) goes to
        the slots. `shapes`: as sum_batches'."""
        dim = values[0].dim()
        self.has_slots = not is_labels(field) and dim >= 2
        if dim < 2:  # (lengths, or one label a sample)
            return row_tokens(joined(values), field)
        if self.has_slots:
            self.slots = self.slots + size
        if shapes is None or uniform(shapes):  # (batches of one width: one count)
            return row_sums(token_flags(values, is_labels(field)))
        return torch.cat([row_sums(token_flags((v,), is_labels(field))) for v in values])

    def total(self, values: tuple, shapes: Optional[list], field, size: int) -> torch.Tensor:
        """The kept batches' tokens of a token field, all together (`size`: their entries)."""
        labels = is_labels(field)
        dim = values[0].dim()
        self.has_slots = not labels and dim >= 2
        if not labels and dim < 2:  # (lengths)
            return joined(values).to(torch.int64).sum()
        if shapes is None and len(set(map(torch.Tensor.dim, values))) > 1:
            # (a mask counted batch by batch is never joined: torch would not refuse a
            # batch of lengths among masks, so this refuses it as a join would)
            raise RuntimeError("the token field has more dimensions in one batch than another")
        if self.has_slots:
            self.slots = self.slots + size
        return count_flags(values, shapes is None or uniform(shapes), labels)

    def add_indexed(self, values: torch.Tensor, per_sample, entries: Optional[int] = None
                    ) -> None:
        """Each int source's samples, and its rows' tokens (`per_sample`), added. `entries`:
        the token entries the rows were counted from (each row's tokens between 0 and its
        entries: a mask's or labels' rows, a fresh tensor of theirs), where samples and tokens
        may be summed packed (PACK): one bincount, its tokens in the total once folded."""
        index = values if values.dim() == 1 else values.reshape(-1)
        if index.dtype is not torch.int64:
            index = index.to(torch.int64)
        if self.source_counts is None:
            self.source_counts = torch.zeros(0, dtype=torch.int64, device=index.device)
            self.source_tokens = torch.zeros(0, dtype=torch.int64, device=index.device)
        if entries is not None:
            if (self.packed_entries + entries >= PACK
                    or self.packed_rows + index.numel() >= PACKED_ROWS):
                self.fold()  # (the bounds kept: what was packed so far read first)
            # (the weights: PACK + each row's tokens, written over the rows' own counts;
            # a batch whose sources are not one a row is torch's error, as unpacked)
            sums = torch.bincount(index, weights=per_sample.add_(PACK),
                                  minlength=0 if self.packed is None else self.packed.numel())
            self.packed = sums if self.packed is None else grow(self.packed,
                                                                sums.numel()) + sums
            self.packed_rows += index.numel()
            self.packed_entries += entries
            return
        counts = torch.bincount(index, minlength=self.source_counts.numel())
        self.source_counts = grow(self.source_counts, counts.numel()) + counts
        if per_sample is not None:
            tokens = torch.bincount(index, weights=per_sample.to(torch.float64),
                                    minlength=self.source_counts.numel()).to(torch.int64)
            self.source_tokens = grow(self.source_tokens, tokens.numel()) + tokens

    def unpacked(self) -> tuple[list[int], list[int]]:
        """The packed sums (add_indexed) read on the host: each index's samples and tokens
        (the packed tokens are in no other sum)."""
        if self.packed is None:
            return [], []
        sums = [int(v) for v in self.packed.tolist()]  # (integers below 2^53: exact)
        return [v >> PACK_BITS for v in sums], [v & (PACK - 1) for v in sums]

    def fold(self) -> None:
        """The packed sums (add_indexed) into the samples, the tokens and the total, on the
        device: before they would pass PACK's bounds."""
        if self.packed is None:
            return
        packed = self.packed.to(torch.int64)
        self.packed, self.packed_rows, self.packed_entries = None, 0, 0
        tokens = packed & (PACK - 1)
        self.source_counts = added(self.source_counts, packed >> PACK_BITS)
        self.source_tokens = added(self.source_tokens, tokens)
        self.tokens = self.tokens + tokens.sum()

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
        """The epoch's tokens so far (a window's exchange: one read of the device sums)."""
        self.settle()
        return int(self.tokens) + sum(self.unpacked()[1])

    def take(self, keep: bool = False) -> dict:
        """The epoch's sums as host ints (one read of each device sum), then empty (`keep`:
        not emptied, a checkpoint's look at the epoch so far)."""
        self.settle()
        samples, packed = self.unpacked()
        part: dict = {"tokens": int(self.tokens) + sum(packed),
                      "slots": int(self.slots) if self.has_slots else None,
                      "supervised": int(self.supervised) if self.label_fields else None}
        sources = {name: list(row) for name, row in self.by_source.items()}
        if self.source_counts is not None:
            counts = self.source_counts.tolist()
            tokens = (self.source_tokens.tolist() if self.source_tokens is not None
                      else [0] * len(counts))
            if samples:  # (the packed sums' too)
                counts = [a + b for a, b in zip_longest(counts, samples, fillvalue=0)]
                tokens = [a + b for a, b in zip_longest(tokens, packed, fillvalue=0)]
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


def added(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two per-index sums added, the shorter padded with zeros."""
    size = max(a.numel(), b.numel())
    return grow(a, size) + grow(b, size)


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
        return row_sums(mask).to(torch.int64) if mask.dim() > 1 else mask.to(torch.int64)
    if values.dim() >= 2:
        return row_sums(values.bool()).to(torch.int64)
    return values.to(torch.int64)


def row_sums(flags: torch.Tensor) -> torch.Tensor:
    """Each row's True entries of a tensor of flags (B x ...), one byte an entry, 0 or 1 (bool,
    or nonzero_bytes' int8 or uint8), as int32. Its bytes are summed eight
    at a time: read as int64 words, a row's words add up byte lane by byte lane (no carry from
    one lane to the next while a lane holds at most 255, so 255 words at a time), then each
    row's lanes are summed; the sum 4-5x faster than the bytes summed one by one
    (docs/benchmarks.md, "Tokens"). Rows of a width that is no multiple of 8, or bytes not laid out so, are summed
    byte by byte."""
    rows = flags if flags.dim() == 2 else flags.flatten(1)  # (0 rows too: no -1 to infer)
    width = rows.shape[1]
    if not width or width % 8 or not rows.is_contiguous() or rows.storage_offset() % 8:
        return rows.view(torch.uint8).sum(1, dtype=torch.int32)
    words = rows.view(torch.int64)
    lanes = (words.sum(1, keepdim=True) if width <= 8 * 255 else
             torch.stack([words[:, i:i + 255].sum(1) for i in range(0, width // 8, 255)], 1))
    return lanes.view(torch.uint8).sum(1, dtype=torch.int32)


def joined(values: tuple) -> torch.Tensor:
    """Tensors joined along their first dimension (one alone: itself, no copy)."""
    return torch.cat(values) if len(values) > 1 else values[0]


def token_flags(values: tuple, labels: bool) -> torch.Tensor:
    """The counted entries of batches of one shape beyond their first dimension (a mask's
    nonzero ones, labels other than -100), as one bool tensor, the batches joined. Entries of
    more than a byte on the CPU are made bools batch by batch, then joined: each batch read
    once and an eighth of it written, where joining them first reads, writes and reads the
    whole again (19.5 against 11.8 us a step: docs/benchmarks.md, "Tokens"); bytes, or a GPU's
    tensors, are joined first (on a GPU each operation's launch is the cost, not the bytes)."""
    flag = (lambda v: v != IGNORE_INDEX) if labels else torch.Tensor.bool
    first = values[0]
    if len(values) > 1 and first.element_size() > 1 and first.device.type == "cpu":
        return torch.cat([flag(v) for v in values])
    return flag(joined(values)) if labels else nonzero_bytes(values)


def nonzero_bytes(values: tuple) -> torch.Tensor:
    """Tensors joined along their first dimension, each entry's flag: 1 where it is nonzero,
    else 0, one byte an entry. Torch's `.bool()` of the join, byte for byte; where the join is
    int8 or uint8 (an int8 mask) in that dtype: its own fresh copy tested in place
    (`ne_(0)`), so that the mask's bytes are written once, not again into a new bool tensor
    (docs/benchmarks.md, "Tokens"). A lone tensor (joined, itself) is never changed."""
    if len(values) == 1:
        return values[0].bool()
    join = torch.cat(values)
    dtype = join.dtype
    return join.ne_(0) if dtype is torch.int8 or dtype is torch.uint8 else join.bool()


def count_flags(values: tuple, same_width: bool, labels: bool) -> torch.Tensor:
    """The counted entries of batches (a mask's nonzero ones, labels other than -100), all
    together: one count of the joined batches where they have one shape beyond their first
    dimension (`same_width`; of their flags, for labels); a mask of more than a byte on the
    CPU, or batches of several shapes, one count a batch, added (token_flags says why)."""
    first = values[0]
    if labels and same_width:
        return torch.count_nonzero(token_flags(values, labels=True))
    if len(values) > 1 and (labels or not same_width or first.element_size() > 1
                            and first.device.type == "cpu"):
        count = (lambda v: torch.count_nonzero(v != IGNORE_INDEX)) if labels \
            else torch.count_nonzero
        return torch.stack([count(v) for v in values]).sum()
    return torch.count_nonzero(joined(values))


def uniform(shapes: list) -> bool:
    """Whether tensors of these shapes have one shape beyond their first dimension (they
    join along it)."""
    return len({s[1:] for s in set(shapes)}) == 1
