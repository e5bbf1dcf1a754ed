"""What a loader is made of, read from its objects without iterating it.

The classes along loader -> batch sampler -> sampler -> dataset, the settings that decide what a
rank receives (describe_loader), the ids it can deal (index_domain), and the fingerprint every
rank must agree on before anything is walked (agree_on_fingerprint)."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import xxhash

from sharddemo.rank.streams import is_litdata, litdata_length, stream_draws


def safe_len(loader) -> Optional[int]:
    """Return the loader's length, or None where it has none.

    None where it has no length (TypeError: an IterableDataset's), or where asking raises
    ValueError (accelerate 1.16's skip_first_batches loader that skips past the epoch's end)."""
    try:
        return len(loader)
    except (TypeError, ValueError):
        return None


def is_prepared(loader) -> bool:
    """True for the loaders `accelerator.prepare` returns (they report to gradient_state)."""
    return hasattr(loader, "gradient_state") and hasattr(loader, "end_of_dataloader")


def remainder(loader) -> int:
    """Return accelerate's `gradient_state.remainder` for a prepared loader.

    The real samples in its last global batch (what gather_for_metrics keeps of the last step);
    -1 where accelerate does not know it, -2 for a loader it did not prepare (or none)."""
    if loader is None or not is_prepared(loader):
        return -2
    value = getattr(loader, "remainder", -1)
    return -1 if value is None else int(value)


def base_loader(loader):
    """The torch DataLoader inside accelerate's wrappers (they delegate to base_dataloader)."""
    return getattr(loader, "__dict__", {}).get("base_dataloader", loader)


def describe_loader(loader) -> dict:
    """Describe what the loader is made of, read from its objects (no iteration).

    The classes along loader -> batch sampler -> sampler -> dataset, and the settings that
    decide what a rank receives. The report names a duplicate's or a missing sample's reason
    only when the mechanism that causes it is really there (a DistributedSampler pads,
    accelerate's BatchSamplerShard fills, IterableDatasetShard loops around, drop_last drops).

    Two ranks, `accelerator.prepare(DataLoader(ds, batch_size=4, shuffle=True))` gives
    DataLoaderShard -> BatchSamplerShard(even_batches=True) -> BatchSampler -> RandomSampler:
    {"prepared": True, "classes": [...], "even_batches": True, "distributed_sampler": False,
    ...}.
    """
    seen: list[str] = []
    info: dict[str, Any] = {"prepared": is_prepared(loader), "distributed_sampler": False,
                            "batch_sampler_shard": False, "iterable_shard": False,
                            "dispatcher": type(loader).__name__ == "DataLoaderDispatcher",
                            "even_batches": None, "split_batches": None, "drop_last": False,
                            "seedable_sampler": False}
    todo, visited = [loader], set()
    while todo and len(visited) < 32:
        obj = todo.pop(0)
        if obj is None or id(obj) in visited:
            continue
        visited.add(id(obj))
        name = type(obj).__name__
        if name != "IndexedDataset":
            seen.append(name)
        if getattr(obj, "drop_last", False) is True:
            info["drop_last"] = True
        if name == "DistributedSampler" or (hasattr(obj, "num_replicas") and hasattr(obj, "rank")):
            info["distributed_sampler"] = True
            info.setdefault("split_over", getattr(obj, "num_replicas", None))  # (over ranks)
            # how many ids it adds to its order, by its own numbers (total_size is
            # num_replicas x num_samples): 0 where N is a multiple of num_replicas, or it cuts
            # (drop_last); kept out where it does not say (a sampler of the user's)
            try:
                info["sampler_padding"] = max(int(obj.total_size) - len(obj.dataset), 0)
            except (AttributeError, TypeError, ValueError):
                pass
        if name in ("BatchSamplerShard", "IterableDatasetShard"):
            info["batch_sampler_shard" if name == "BatchSamplerShard" else "iterable_shard"] = True
            info.setdefault("split_over", getattr(obj, "num_processes", None))
        if name == "SeedableRandomSampler":
            info["seedable_sampler"] = True
        for key in ("even_batches", "split_batches"):
            if isinstance(getattr(obj, key, None), bool) and info[key] is None:
                info[key] = getattr(obj, key)
        attrs = getattr(obj, "__dict__", {})
        # `_inner`: what sharddemo's IndexedDataset stands in for.
        for key in ("base_dataloader", "batch_sampler", "sampler", "dataset", "_inner"):
            child = attrs.get(key)
            if child is not None and not isinstance(child, (int, float, str, bool)):
                todo.append(child)
    info["classes"] = seen
    base = base_loader(loader)
    info["num_workers"] = int(getattr(base, "num_workers", 0) or 0)
    dataset = getattr(base, "dataset", None)
    dataset = getattr(dataset, "_inner", dataset)  # sharddemo's IndexedDataset
    info["iterable_dataset"] = isinstance(dataset, torch.utils.data.IterableDataset) or \
        type(dataset).__name__ == "IterableDataset"
    shards = getattr(dataset, "num_shards", None) or getattr(dataset, "n_shards", None)
    info["dataset_shards"] = int(shards) if isinstance(shards, int) else None
    info.update(index_domain(loader))
    info["shuffled"] = sampler_shuffles(base)
    info.update(_shard_batch_size(base))
    return info


def _shard_batch_size(base) -> dict:
    """Return the batch size of a user's batch sampler under BatchSamplerShard, else {}.

    {"shard_batch_size", "batch_sampler_class"} where accelerate's BatchSamplerShard wraps a
    batch sampler of the user's (not torch's BatchSampler, whose batches are all full but the
    last) that has a batch_size: BatchSamplerShard then deals a round only when its last batch
    holds that many (accelerate's _iter_with_no_split), and drops the rest."""
    shard = getattr(base, "batch_sampler", None)
    inner = getattr(shard, "batch_sampler", None)
    if type(shard).__name__ != "BatchSamplerShard" or inner is None or getattr(
            shard, "split_batches", False) or isinstance(inner, torch.utils.data.BatchSampler):
        return {}
    size = getattr(shard, "batch_size", None)
    if not isinstance(size, int):
        return {}
    return {"shard_batch_size": size, "batch_sampler_class": type(inner).__name__}


def sampler_shuffles(base) -> Optional[bool]:
    """Say whether the sampler deals a new order on every pass, as its own object says.

    That is the sampler that draws the dataset positions: False for torch's SequentialSampler
    and a DistributedSampler built with shuffle=False, True for RandomSampler (accelerate's
    SeedableRandomSampler is one), SubsetRandomSampler, WeightedRandomSampler and a shuffling
    DistributedSampler. None for anything else (a sampler of the user's, a stream): the report
    then reads the order from the ids, as unshuffled where they never decrease."""
    from torch.utils.data import (DistributedSampler, RandomSampler, SequentialSampler,
                                  SubsetRandomSampler, WeightedRandomSampler)

    sampler = _index_sampler(base)
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle)
    if isinstance(sampler, SequentialSampler):
        return False
    if isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)):
        return True
    return None


def sampler_chain(base):
    """Return the batch samplers and samplers under a DataLoader, outermost first.

    Its batch_sampler (else its sampler), then what that one holds, down to the sampler that
    draws the dataset positions (accelerate's BatchSamplerShard -> BatchSampler -> sampler)."""
    obj = base
    for _ in range(9):
        found = getattr(obj, "batch_sampler", None)  # (not `or`: truth-testing a sampler
        nxt = found if found is not None else getattr(obj, "sampler", None)  # calls __len__)
        if nxt is None or nxt is obj:
            return
        yield nxt
        obj = nxt


def _index_sampler(base):
    """Return the sampler that draws the dataset positions, under any batch samplers.

    It lies inside BatchSamplerShard, BatchSampler. None where the chain ends at a batch sampler
    of the user's that holds no sampler (some object's `batch_sampler`: it deals whole batches,
    its length counts batches, not positions)."""
    holder, last = None, None
    for nxt in sampler_chain(base):
        holder, last = (base if last is None else last), nxt
    if last is not None and getattr(holder, "batch_sampler", None) is last:
        return None
    return last


def index_domain(loader) -> dict:
    """What the loader's own objects let it deal in an epoch, read from them (no iteration):

    - `domain`: how many distinct dataset ids (the ids sharddemo records: indices of the data
      under any torch Subset, table rows of a datasets.Dataset view) the loader can deal at
      all, where a Subset (random_split), a SubsetRandomSampler or a view's indices mapping
      (train_test_split, select, filter) narrows them to fewer than the whole; else None.
    - `draws`: where the index sampler does not deal each of its positions once, its draw:
      {"sampler", "replacement", "count"} (RandomSampler(replacement=True) or num_samples,
      WeightedRandomSampler); else None. A DistributedSampler is not a draw: it shards
      (over a Subset or a view it has a domain all the same).

    random_split(ds, [40, 10])[0] in a prepared DataLoader: {"domain": 40, "draws": None}.
    Read once per loader (a Subset's ids are counted in a mask of the dataset's length)."""
    base = base_loader(loader)
    try:
        return dict(_DOMAINS[base])
    except (KeyError, TypeError):
        pass
    out = _index_domain(base)
    try:
        _DOMAINS[base] = out
    except TypeError:
        pass  # not weak-referenceable: read again next time
    return dict(out)


_DOMAINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def under_subsets(dataset) -> tuple[Any, list]:
    """Return the dataset under any torch Subsets and sharddemo's IndexedDataset.

    Returns (that dataset, each Subset's indices, outermost first)."""
    chain = []
    for _ in range(16):
        if getattr(type(dataset), "notes_indices", False):  # rank.tagging.IndexedDataset
            dataset = dataset._inner
        elif isinstance(dataset, torch.utils.data.Subset):
            chain.append(dataset.indices)
            dataset = dataset.dataset
        else:
            break
    return dataset, chain


def subset_mapping(dataset) -> Optional[torch.Tensor]:
    """Map positions in a (chain of) torch Subset to the root dataset's ids.

    One int64 tensor; None where the dataset is no Subset."""
    _, chain = under_subsets(dataset)
    mapping = None
    for indices in reversed(chain):  # innermost first: each level indexes the one under it
        level = torch.as_tensor(list(indices), dtype=torch.int64)
        mapping = level if mapping is None else mapping[level]
    return mapping


def loader_batch_size(loader) -> Optional[int]:
    """Return the loader's batch size, as the fingerprint reads it.

    Its own, else its batch sampler's (accelerate's BatchSamplerShard keeps the batch it
    splits); None for a batch sampler without one."""
    base = base_loader(loader)
    return (getattr(base, "batch_size", None)
            or getattr(getattr(base, "batch_sampler", None), "batch_size", None))


def _index_domain(base) -> dict:
    import numpy as np

    dataset, chain = under_subsets(getattr(base, "dataset", None))
    rows = hf_rows(dataset)  # a datasets.Dataset view: its positions are these table rows
    if rows is not None:
        chain.append(rows)
    sampler = _index_sampler(base)
    # (a stream that draws by design: WebDataset(resampled=True), litdata's cycling stream)
    out: dict[str, Any] = {"domain": None, "draws": stream_draws(dataset)}
    if out["draws"] is not None or sampler is None:
        return out
    # A DistributedSampler shards the positions (every one, once, over the ranks): no draw
    # of its own, but a Subset or a view under it narrows them as under any sampler. One that
    # wraps the user's sampler (Lightning's DistributedSamplerWrapper, for a
    # WeightedRandomSampler say) shards that sampler's draw: the draw is the wrapped one's.
    sharded = hasattr(sampler, "num_replicas")
    wrapped = _wrapped_sampler(sampler) if sharded else None
    if wrapped is not None:
        sampler, sharded = wrapped, False
    subset_sampler = isinstance(sampler, torch.utils.data.SubsetRandomSampler)
    try:
        positions = len(sampler.indices) if subset_sampler else len(base.dataset)
        count = positions if sharded else len(sampler)
    except (TypeError, AttributeError):
        return out  # a stream, or a sampler without a length
    replacement = getattr(sampler, "replacement", False) is True
    if replacement or count != positions:
        out["draws"] = {"sampler": type(sampler).__name__, "replacement": replacement,
                        "count": int(count)}
    if chain or subset_sampler:
        ids = (np.asarray(sampler.indices, dtype=np.int64) if subset_sampler
               else np.arange(positions, dtype=np.int64))
        for indices in chain:
            ids = np.asarray(indices, dtype=np.int64)[ids]
        whole = root_length(base.dataset)
        if whole is not None and ids.size and 0 <= ids.min() and ids.max() < whole:
            seen = np.zeros(whole, dtype=bool)  # distinct ids: a mask, not a sort
            seen[ids] = True
            domain = int(np.count_nonzero(seen))
        else:
            domain = int(np.unique(ids).size)
        out["domain"] = domain if whole is None or domain < whole else None
        if domain < ids.size and out["draws"] is None:
            # indices that repeat samples (SubsetRandomSampler([0, 0, 1]), a Subset the same
            # way): the sampler deals `count` indices naming `domain` samples, repeats by design
            out["draws"] = {"sampler": type(sampler).__name__, "replacement": False,
                            "count": int(count), "repeated_indices": True}
    return out


def _wrapped_sampler(sampler):
    """Return the user's sampler inside a distributed sampler that shards its draw.

    Lightning's DistributedSamplerWrapper is a DistributedSampler over
    _DatasetSamplerWrapper(sampler), which keeps it as `_sampler` (catalyst's
    DatasetFromSampler: `sampler`). None for a DistributedSampler over the data itself."""
    inner = getattr(sampler, "dataset", None)
    for name in ("_sampler", "sampler"):
        found = getattr(inner, name, None)
        if isinstance(found, torch.utils.data.Sampler):
            try:  # such a wrapper is as long as the draw it stands for
                return found if len(inner) == len(found) else None
            except TypeError:
                return None
    return None


def hf_rows(dataset):
    """Return the table rows a datasets.Dataset view reads, position by position.

    A numpy array, where it has an indices mapping (train_test_split, select, filter, shuffle);
    else None."""
    return dataset._indices.column(0).to_numpy() if _is_hf_view(dataset) else None


def _is_hf_dataset(dataset) -> bool:
    """A datasets.Dataset: an Arrow table (`data`) and an indices mapping or None."""
    return hasattr(dataset, "_indices") and hasattr(getattr(dataset, "data", None), "slice")


def _is_hf_view(dataset) -> bool:
    """A datasets.Dataset whose positions go through an indices mapping to its table's rows."""
    return _is_hf_dataset(dataset) and dataset._indices is not None


def rows_digest(dataset) -> Optional[str]:
    """Return a hash of a dataset's length and of its first, middle and last rows, else None.

    Only for a dataset whose rows can be read as stored, running none of the user's code and
    drawing no RNG, so that ranks can tell whether position i is the same sample everywhere (a
    dataset split by rank before the loader is not). That is a datasets.Dataset with no indices
    mapping (its positions are its Arrow rows; split_dataset_by_node and Dataset.shard give each
    rank its own), a torch TensorDataset, a tensor or numpy array, and a list, tuple or range of
    plain values. None for anything else (a dataset class of the user's: reading a row runs its
    code)."""
    if _is_hf_dataset(dataset) and dataset._indices is None:  # positions are table rows
        data = dataset.data
        n = int(data.num_rows)
        return _rows_hash(n, [lambda i: repr(data.slice(i, 1).to_pydict()).encode()])
    import numpy as np

    if isinstance(dataset, torch.utils.data.TensorDataset):
        arrays = list(dataset.tensors)
    elif isinstance(dataset, torch.Tensor) and dataset.ndim:
        arrays = [dataset]
    elif isinstance(dataset, np.ndarray) and dataset.ndim and dataset.dtype != object:
        arrays = [dataset]  # (an object array's bytes are pointers, another in each process)
    elif isinstance(dataset, (list, tuple, range)):
        rows = dataset
        n = len(rows)
        if not all(_plain(rows[i]) for i in {0, n // 2, n - 1} if n):
            return None
        return _rows_hash(n, [lambda i: repr(rows[i]).encode()])
    else:
        return None
    if not arrays or any(len(a) != len(arrays[0]) for a in arrays):
        return None
    return _rows_hash(len(arrays[0]), [
        (lambda i, a=a: f"{a.dtype}{tuple(a.shape)}".encode() + _row_bytes(a[i]))
        for a in arrays])


def _rows_hash(n: int, readers: list) -> str:
    h = xxhash.xxh3_64(str(n).encode())
    for i in sorted({0, n // 2, n - 1}) if n else []:
        for read in readers:
            h.update(read(i))
    return h.hexdigest()


def _row_bytes(row) -> bytes:
    """One row of a tensor or array as bytes (a copy of that row alone, on the CPU)."""
    if isinstance(row, torch.Tensor):
        row = row.detach().to("cpu").reshape(-1).clone()
        return row.view(torch.uint8).numpy().tobytes() if row.numel() else b""
    import numpy as np

    return np.ascontiguousarray(row).tobytes()


def _plain(value, depth: int = 0) -> bool:
    """Say whether a value's repr runs no user code.

    A number, string, bytes, None, or a tuple of them."""
    if value is None or type(value) in (int, float, bool, str, bytes):
        return True
    return depth == 0 and type(value) is tuple and all(_plain(v, 1) for v in value)


# ---------------------------------------------------------------------------------------------
# Fingerprint: do the ranks even agree on the data, before anything is walked?


def _order_hash(sampler) -> Optional[str]:
    """Return a hash of the first epoch's index order, where that draws no RNG the loader uses.

    That is a DistributedSampler (its own generator, seeded with seed + epoch; every rank hashes
    rank 0's part of it, from a copy set to rank 0, so the ranks compare the same thing and none
    holds more than its own walk holds), accelerate's SeedableRandomSampler (reseeds itself on
    every pass), or a SequentialSampler. None for samplers whose order would consume a generator
    (RandomSampler) or says nothing new (SequentialSampler). The order is hashed as it streams,
    a chunk at a time: no second copy of it."""
    import copy
    import hashlib
    import itertools

    import numpy as np

    name = type(sampler).__name__
    if name == "DistributedSampler":
        first = copy.copy(sampler)
        first.rank, first.epoch = 0, 0
        order = iter(first)
    elif name == "SeedableRandomSampler":
        epoch = getattr(sampler, "epoch", 0)
        sampler.set_epoch(0)
        order = iter(list(sampler))
        sampler.set_epoch(epoch)
    else:
        return None  # a SequentialSampler's order says no more than the length
    digest = hashlib.sha256()
    while True:
        chunk = np.fromiter(itertools.islice(order, 1 << 16), dtype=np.int64)
        if not chunk.size:
            break
        digest.update(chunk.tobytes())
    return digest.hexdigest()[:16]


def root_length(dataset) -> Optional[int]:
    """Return the length of the data every rank starts from, None for a stream.

    Read under the views that legitimately differ by rank: a torch Subset, a datasets.Dataset
    view with an indices mapping (the whole table's rows: train_test_split, select, filter),
    sharddemo's own IndexedDataset."""
    dataset, _ = under_subsets(dataset)
    if _is_hf_view(dataset):
        return int(dataset.data.num_rows)
    if is_litdata(dataset):  # (its len() is one rank's share)
        return litdata_length(dataset)
    try:
        return len(dataset)
    except TypeError:
        return None


def fingerprint(loader, description: Optional[dict] = None) -> dict:
    """Return what this rank believes the data is; every rank must agree.

    Dataset length (None for a stream), the sampler's and batch sampler's classes and seed,
    drop_last, batch size, workers, and a hash of the first epoch's order where that costs no
    RNG draw and the dataset is smaller than COUNT_FROM (above it the hash would be a second
    pass over the whole order; the count path then reports ranks that dealt from different
    orders as `ranks-disagree`)."""
    from sharddemo.options import COUNT_FROM

    base = base_loader(loader)
    length = root_length(getattr(base, "dataset", None))
    batch_sampler = getattr(base, "batch_sampler", None)
    sampler = getattr(base, "sampler", None)
    # accelerate keeps the user's sampler inside its batch sampler shard
    inner = getattr(getattr(batch_sampler, "batch_sampler", batch_sampler), "sampler", sampler)
    seed = getattr(inner, "seed", None)
    if seed is None:
        seed = getattr(inner, "initial_seed", None)
    return {"dataset_length": length,
            "sampler": type(inner).__name__ if inner is not None else None,
            "batch_sampler": type(batch_sampler).__name__ if batch_sampler is not None else None,
            "seed": int(seed) if isinstance(seed, int) else None,
            "drop_last": bool(getattr(base, "drop_last", False)),
            "batch_size": getattr(base, "batch_size", None) or getattr(batch_sampler,
                                                                      "batch_size", None),
            "num_workers": int(getattr(base, "num_workers", 0) or 0),
            "order_hash": (_order_hash(inner) if inner is not None
                           and (length is None or length < COUNT_FROM) else None),
            "shards_itself": _shards_itself(description or describe_loader(loader)),
            "rows_digest": _safe_rows_digest(under_subsets(getattr(base, "dataset", None))[0])}


def _safe_rows_digest(dataset) -> Optional[str]:
    """Return rows_digest, or None where a row cannot be read as bytes.

    A tensor type that cannot be viewed as bytes, say: the check is then skipped, as for a
    dataset class of the user's."""
    try:
        return rows_digest(dataset)
    except Exception:  # noqa: BLE001 - a best-effort check before the walk, never a failure
        return None


def _shards_itself(info: dict) -> bool:
    """Say whether the loader splits the data across ranks itself.

    A DistributedSampler, or accelerate's BatchSamplerShard, IterableDatasetShard or dispatch:
    every rank must then start from the same data. A plain loader over data split by rank
    beforehand legitimately differs."""
    return bool(info["distributed_sampler"] or info["batch_sampler_shard"]
                or info["iterable_shard"] or info["dispatcher"])


FINGERPRINT_WORDS = {"dataset_length": "samples", "sampler": "sampler", "seed": "sampler seed",
                     "batch_sampler": "batch sampler", "drop_last": "drop_last",
                     "batch_size": "batch size", "num_workers": "DataLoader workers",
                     "order_hash": "first epoch's order (hash)"}


def agree_on_fingerprint(accelerator, loader, stop: bool = True,
                         description: Optional[dict] = None,
                         ids_by_position: bool = False) -> dict:
    """Exchange every rank's fingerprint in one gather; stop every rank where they differ.

    If they differ, every rank stops with the same one-line message naming the field and the
    ranks (a Disagreement, exit 1); with `stop=False` (compare's pitfall demos, which disagree
    on purpose) the message is returned under `disagreement` instead. `ids_by_position`: the
    walk will take the positions the DataLoader asks for as sample ids. Where the ranks read
    different rows (rows_digest), position i is not one sample: for data split by rank before
    the loader every rank stops with a UsageError asking for --id-field (by position it would
    read as replication); under a loader that shards the data itself the walk goes on (unseeded
    random data does this, harmless in a demo) and `rows_note` says what it means."""
    from sharddemo.rank.collect import exchange_objects
    from sharddemo.errors import Disagreement, UsageError

    mine = fingerprint(loader, description)
    every = exchange_objects(accelerator, mine)
    differ = len({fp["rows_digest"] for fp in every}) > 1
    same_data = any(fp["shards_itself"] for fp in every)
    if ids_by_position and differ and not same_data:
        raise UsageError(f"the ranks read different rows of a {_kind(loader)} (a dataset "
                         "split by rank before the loader: split_dataset_by_node, "
                         "Dataset.shard, or data sliced by rank), so a position the DataLoader "
                         "asks for is not the same sample on every rank; pass --id-field with "
                         "the field (column, dict key or tuple position) that holds each "
                         "sample's id")
    # each rank's own rows (a per-rank split): one rank's length is not the dataset's
    mine = {**mine, "rows_differ": differ}
    if ids_by_position and differ:
        mine["rows_note"] = (f"the ranks hold different rows of a {_kind(loader)} at the same "
                             "positions (the first, middle or last row differs: unseeded "
                             "random data, or each rank loading its own files), and the ids "
                             "here are positions: the split below is of positions, not of "
                             "samples; pass --id-field to audit by each sample's own id")
    for key, words in FINGERPRINT_WORDS.items():
        if not same_data and key not in ("sampler", "batch_sampler", "num_workers"):
            continue  # data split by rank before the loader: each rank's own may differ
        values = [fp[key] for fp in every]
        if len({repr(v) for v in values}) > 1:
            groups: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                groups.setdefault(repr(value), []).append(rank)
            # the odd ones out first, rank 0's (the reference) last
            parts = sorted(groups.values(), key=lambda ranks: (0 in ranks, len(ranks), ranks))
            said = [f"rank {', '.join(map(str, ranks))} {'has' if len(ranks) == 1 else 'have'} "
                    + _say(key, values[ranks[0]], words, first=k == 0)
                    for k, ranks in enumerate(parts)]
            message = "ranks disagree on the dataset: " + ", ".join(said)
            if stop:
                raise Disagreement(message)
            return {**mine, "disagreement": message}
    return mine


def _kind(loader) -> str:
    """The class of the dataset under any Subset, as a person names it."""
    dataset, _ = under_subsets(getattr(base_loader(loader), "dataset", None))
    if _is_hf_dataset(dataset):
        return "datasets.Dataset"
    return type(dataset).__name__


def _say(key: str, value: Any, words: str, first: bool = True) -> str:
    """`9,999 samples` the first time, then `10,000`: the words once, as a person says it."""
    if key == "dataset_length" and isinstance(value, int):
        return f"{value:,} samples" if first else f"{value:,}"
    if key == "dataset_length":
        return "a stream with no length"
    return f"{words} {value}"
