"""Ray Data's batches for the watch, and how the dataset was split among the workers.

The iterable `DataIterator.iter_torch_batches()` (or `iter_batches()`) returns, read with
`id_field`, and what the DataIterator behind it says about how the dataset was split among the
workers. Ray is imported only for the one remote call below, where Ray's own batches were handed
to the watch: the iterable is recognised by its class's name
(`ray.data.iterator._IterableFromIterator`, ray 2.60), and the DataIterator is found in the
closure that makes each pass (its `self`).

What a worker's DataIterator tells (ray 2.60, ray/train/_internal/data_config.py):

- `StreamSplitDataIterator`: its worker's part of `Dataset.streaming_split(world_size,
  equal=...)`, as `DataConfig` makes one for each dataset in `datasets_to_split` (always with
  `equal=True`). Whether the split is equal is read at its first `watch()`, from the split's own
  plan in its coordinator actor (the `StreamingSplit` operator's `equal`): with `equal=True`
  Ray gives every worker the same number of rows and drops up to world_size - 1 of them.
- `DataIteratorImpl`: the whole dataset (`ds.iterator()`), as `DataConfig` hands a dataset left
  out of `datasets_to_split` to every worker: with several workers, replication.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional


def is_ray_batches(obj) -> bool:
    """Say whether `obj` is the iterable Ray Data's iter_batches / iter_torch_batches returns.

    Those of a DataIterator: each iteration a new pass over the worker's data."""
    cls = type(obj)
    return any(c.__module__ == "ray.data.iterator" and c.__name__ == "_IterableFromIterator"
               for c in cls.__mro__)


def pass_settings(batches) -> dict[str, Any]:
    """Return the arguments the iterable was made with, as its pass-making closure holds them.

    `self`: the DataIterator; `batch_size`, `drop_last`, `local_shuffle_buffer_size`."""
    make = batches.__dict__.get("iterator_gen")
    code, cells = getattr(make, "__code__", None), getattr(make, "__closure__", None)
    if code is None or not cells:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return out


def data_iterator(batches):
    """The DataIterator whose passes `batches` makes (None where it cannot be found)."""
    return pass_settings(batches).get("self")


# StreamSplitDataIterator -> whether its split is equal (read once per DataIterator)
EQUAL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def equal_split(iterator) -> Optional[bool]:
    """Say whether a StreamSplitDataIterator's split was made with equal=True.

    Read from the StreamingSplit operator of the split's plan, in its coordinator actor (one
    remote call, once per DataIterator). None where it cannot be read."""
    try:
        return EQUAL[iterator]
    except (KeyError, TypeError):
        pass
    coordinator = getattr(iterator, "_coord_actor", None)
    if coordinator is None:
        return None
    try:
        import ray

        equal = bool(ray.get(coordinator.__ray_call__.remote(read_equal), timeout=60))
    except Exception:  # an older or newer Ray that keeps it elsewhere: not known
        return None
    try:
        EQUAL[iterator] = equal
    except TypeError:
        pass
    return equal


def read_equal(coordinator) -> bool:
    """(Runs in the SplitCoordinator actor.) The `equal` of its dataset's StreamingSplit."""
    return coordinator._base_dataset._logical_plan.dag.equal


def describe_batches(batches) -> tuple[dict, Optional[int]]:
    """Return the loader description for Ray Data's batches, and the batch size.

    The description the analysis reads: rank.describe.describe_loader's keys. `ray_data`: the
    DataIterator's class, how it was split (`"equal"`, `"unequal"`, `"none"`: the whole dataset,
    or None where not known) and the world size it was split for."""
    settings = pass_settings(batches)
    iterator = settings.get("self")
    kind = type(iterator).__name__ if iterator is not None else None
    split, world = None, None
    if kind == "StreamSplitDataIterator":
        world = getattr(iterator, "_world_size", None)
        equal = equal_split(iterator)
        split = None if equal is None else ("equal" if equal else "unequal")
    elif kind == "DataIteratorImpl":
        split = "none"
    size = settings.get("batch_size")
    description = {
        "prepared": False, "distributed_sampler": False, "batch_sampler_shard": False,
        "iterable_shard": False, "dispatcher": False, "even_batches": None,
        "split_batches": None, "drop_last": bool(settings.get("drop_last")),
        "seedable_sampler": False, "classes": [type(batches).__name__] + ([kind] if kind else []),
        "num_workers": 0, "iterable_dataset": False, "dataset_shards": None,
        "domain": None, "draws": None,
        # a local shuffle buffer's order is Ray's own: never told it forgot set_epoch
        "shuffled": False,
        "ray_data": {"iterator": kind, "split": split, "world_size": world,
                     "local_shuffle_buffer_size": settings.get("local_shuffle_buffer_size")},
    }
    return description, size if isinstance(size, int) and not isinstance(size, bool) else None
