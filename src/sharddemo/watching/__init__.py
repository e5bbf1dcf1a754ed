"""`sharddemo.watch`: check the real training run's sharding, epoch by epoch, as it trains.

This package is sharddemo.watching: its state in state.py, its hooks into loaders and accelerate
in hooks.py, the Trainer and Lightning callbacks in trainer.py and lightning.py.

    from sharddemo import watch

    loader = watch(loader, accelerator)          # one line in your script
    for epoch in range(epochs):
        for batch in loader:                     # your batches, untouched
            ...
    # at the end of each epoch the main process prints one line, e.g.
    # sharddemo: epoch 1 train: 40 of 40 samples once across 2 ranks, 5 steps each, order changed: yes: ok
    # and appends one JSON object to sharddemo-watch.jsonl (docs/watch.md)

It is the recorder of `sharddemo audit` (rank.recorder.Recorder) inside your own loop, and the
report's analysis (sharddemo.analysis) at the end of each epoch: the same reasons, words and
verdicts as `audit`.

How it sees the ids without touching a batch: for a map-style dataset, the indices that the
loader's own index sampler (its batch sampler, or its sampler with batch_size=None) hands out on
this rank are noted in the main process as the loader's iterator asks for them, and each batch
the loop receives takes the oldest noted indices (a DataLoader yields its batches in the order
their indices were drawn, workers or not). A Subset's indices are mapped to the root dataset's.
With `id_field`, the ids are read from each batch instead (any dataset, streams included). Each
rank counts what reached its loop (one byte per sample where the dataset's length is known, else
the ids), and at the end of the epoch one exchange brings it together: no collective and no host
sync per step.

It follows the loader where accelerate makes a new one from it: `accelerator.prepare(loader)`
and `accelerator.skip_first_batches(loader, k)` return watched loaders when `accelerator` was
given to `watch` (the skipped batches never reach the loop, and are not counted).
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Optional, Sequence, Union

from sharddemo.errors import ShardingViolation
from sharddemo.rank.collect import guard_forks
from sharddemo.watching.hooks import attach, checkpoint, follow
from sharddemo.watching.lineage import LineageWriter, validate_lineage_folder
from sharddemo.watching.state import ON_VIOLATION, WatchState
from sharddemo.watching.step_windows import CHECK_EVERY


def watch(loader, accelerator=None, *, name: str = "train",
          report: Optional[str] = "sharddemo-watch.jsonl", id_field: Any = None,
          on_violation: str = "warn", check_every: Union[int, str, None] = CHECK_EVERY,
          dataset_size: Optional[int] = None, lineage: Optional[str] = None,
          mesh: Any = None, data_dims: Optional[Sequence[str]] = None, tokens: Any = None,
          sources: Any = None, weights: Any = None, max_token_skew: Optional[float] = None):
    """Watch `loader` in your own training loop; returns the same loader object.

    Args:
        loader: a torch DataLoader (or one accelerate, torchdata or Ray Train made), or Ray
            Data's batches (`DataIterator.iter_torch_batches()`: needs `id_field`).
        accelerator: your Accelerator (its collectives carry the exchange, and a loader it
            prepares or skips from this one stays watched); None under torch.distributed
            alone or in one process.
        name: the loader's name in the line and the report.
        report: the JSON-lines file the main process appends one entry to per epoch,
            window and partial epoch (None: no file).
        id_field: the batch's field (dict key, tuple position, or "." for a batch that is the
            ids) holding each sample's id; default: the indices the loader's own sampler
            hands out (map-style datasets).
        on_violation: "warn" (the line says FAIL), "raise" (ShardingViolation on every rank
            at the same step) or "ignore" (the report only, nothing printed).
        check_every: when the ranks meet once to check the window of steps so far
            (replication, a sample a rank received twice, ranks that disagree about the
            dataset, a rank out of data, from the second epoch an order that repeats the
            previous epoch's): "auto" (the default) after steps 50, 150, 350, 750, 1550, 3150
            of each epoch, then every 1,600 steps (each window twice as long as the one
            before, up to 1,600); an int: every this many steps; 0 or None: only at the
            epoch's end.
        dataset_size: N for a stream read with `id_field` (default: the dataset's length;
            for a stream, inferred from the largest id seen, and the line says so).
        lineage: a folder where each rank appends the ids of every batch its loop receives,
            for `sharddemo lineage DIR --step K` (docs/watch.md, "The batch behind a step").
        mesh: the run's torch DeviceMesh (default: the accelerator's own, where accelerate's
            ParallelismConfig made one): within each data-parallel group every rank must
            receive the same batches (its replica peers: tp, cp, ...), and the groups split the
            epoch, each counted once (docs/mesh.md).
        data_dims: the mesh's dims that split the data (default: those named dp,
            dp_replicate, dp_shard or fsdp); every other dim holds replica peers.
        tokens: the batch field(s) whose tokens are counted (docs/tokens.md): a 0/1 mask
            (batch x length, e.g. "attention_mask"), per-sample lengths, or labels (a field
            named with "label": its entries other than -100 are supervised tokens); a tuple
            gives a mask and labels. Tokens per group, their total, skew and padding share go
            in the line and the report.
        sources: the batch field holding each sample's source (an int index or a name): the
            realized share of each source, in samples and (with tokens) in tokens.
        weights: the mixture's weights (a list: sources 0, 1, ...; a dict: by name), for the
            verdict mixture-matches-weights (a binomial band that widens with the count).
        max_token_skew: a limit on the most tokens a data-parallel group receives over the
            mean (e.g. 1.1): a verdict only where it is given.

    Example::

        loader = watch(DataLoader(ds, batch_size=64, shuffle=True), accelerator)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for epoch in range(epochs):
            for step, batch in enumerate(loader):
                ...
        loader.close()               # the epoch stopped in is reported (partial)
        accelerator.end_training()
    """
    validate_arguments(loader, accelerator, name=name, report=report, id_field=id_field,
                    on_violation=on_violation)
    if isinstance(check_every, str) and check_every != "auto":
        raise ValueError("sharddemo.watch: check_every must be 'auto' (the default: windows "
                         "that grow), a number of steps (0: no windows) or None, got "
                         f"{check_every!r}")
    for label, value in (("check_every", None if check_every == "auto" else check_every),
                         ("dataset_size", dataset_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < (0 if label == "check_every" else 1)):
            wanted = ("'auto', a number of steps (0: no windows)" if label == "check_every"
                      else "the number of samples, at least 1")
            raise ValueError(f"sharddemo.watch: {label} must be {wanted} or None, got {value!r}")
    if lineage is not None:
        validate_lineage_folder(lineage)
    place = mesh_place(accelerator, mesh, data_dims)
    measure = validate_measures(tokens, sources, weights, max_token_skew)
    return watch_loader(loader, accelerator, name=name, report=report, id_field=id_field,
                        on_violation=on_violation, check_every=check_every,
                        dataset_size=dataset_size, lineage=lineage, mesh=place,
                        measure=measure)


def validate_measures(tokens, sources, weights, max_token_skew) -> Optional[dict]:
    """tokens=, sources=, weights=, max_token_skew= checked (one error naming the argument),
    as the watch keeps them; None where none is given."""
    def field(value) -> bool:
        return isinstance(value, (str, int)) and not isinstance(value, bool)

    if tokens is not None and not (field(tokens) or (
            isinstance(tokens, (tuple, list)) and 1 <= len(tokens) <= 2
            and all(field(f) for f in tokens))):
        raise TypeError("sharddemo.watch: tokens must be a batch field (a str key or an int "
                        "position), or a tuple of two (a mask and labels), got "
                        f"{tokens!r:.60}")
    if sources is not None and not field(sources):
        raise TypeError(f"sharddemo.watch: sources must be a batch field (a str key or an int "
                        f"position), got {sources!r:.60}")
    normalized = None
    if weights is not None:
        from sharddemo.analysis.tokens import normalized as normalize

        if sources is None:
            raise ValueError("sharddemo.watch: weights need sources=, the batch field that "
                             "holds each sample's source")
        values = list(weights.values()) if isinstance(weights, dict) else weights
        if (not isinstance(weights, (list, tuple, dict)) or not values
                or any(isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0
                       for w in values) or sum(values) <= 0):
            raise ValueError("sharddemo.watch: weights must be a list (sources 0, 1, ...) or a "
                             "dict (by source name) of numbers >= 0 with a positive sum, got "
                             f"{weights!r:.60}")
        normalized = normalize(weights)
    if max_token_skew is not None:
        if tokens is None:
            raise ValueError("sharddemo.watch: max_token_skew needs tokens=, the batch field "
                             "the tokens are counted from")
        if isinstance(max_token_skew, bool) or not isinstance(max_token_skew, (int, float)) \
                or max_token_skew < 1:
            raise ValueError("sharddemo.watch: max_token_skew must be a number >= 1 (the most "
                             "tokens a group may receive over the mean), got "
                             f"{max_token_skew!r}")
    if tokens is None and sources is None:
        return None
    return {"tokens": tokens, "sources": sources, "weights": normalized,
            "max_token_skew": max_token_skew}


def mesh_place(accelerator, mesh, data_dims):
    """(the mesh's layout, this rank) where the run is a device mesh (given, or the
    accelerator's own), else None; refused in one line where the mesh is not this run's, or
    lacks `data_dims` (every rank reads the same mesh, so every rank stops alike)."""
    from sharddemo.watching.mesh import mesh_of, read_mesh

    if mesh is None and accelerator is not None:
        mesh = mesh_of(accelerator)
    if mesh is None:
        if data_dims is not None:
            raise ValueError("sharddemo.watch: data_dims needs a mesh: give mesh=your "
                             "DeviceMesh (init_device_mesh(..., mesh_dim_names=...))")
        return None
    import torch.distributed as dist

    up = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if up else (1, 0)
    return read_mesh(mesh, data_dims, world), rank


def validate_arguments(loader, accelerator, *, name, report, id_field, on_violation) -> None:
    """Check watch()'s arguments when it is called: one error naming the argument.

    So that a mistake stops the script before its first step (never at an epoch's end, hours
    later). The report's folder is made here if it does not exist."""
    if on_violation not in ON_VIOLATION:
        raise ValueError(f"sharddemo.watch: on_violation must be one of "
                         f"{', '.join(ON_VIOLATION)}, got {on_violation!r}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"sharddemo.watch: name must be a non-empty str, got {name!r}")
    # the watch taps a DataLoader's own sampler and iterator: accelerate's and torchdata's
    # loaders are DataLoaders too; a list, a generator or a datasets stream is not one
    from torch.utils.data import DataLoader

    from sharddemo.watching.raydata import is_ray_batches

    if is_ray_batches(loader):
        # Ray Data's batches (DataIterator.iter_torch_batches()): rows with no index, so
        # their ids come from a column
        if id_field is None:
            raise ValueError("sharddemo.watch: id_field is needed for Ray Data's batches "
                             "(iter_torch_batches() yields rows, not indices): give the column "
                             "that holds each row's id, 0..N-1, and dataset_size=N")
    elif not isinstance(loader, DataLoader):
        raise TypeError("sharddemo.watch: loader must be a torch.utils.data.DataLoader (or one "
                        "that accelerate or torchdata made) or Ray Data's "
                        "iter_torch_batches(), iterated once per epoch; got "
                        f"{type(loader).__name__} (wrap a dataset in a DataLoader first)")
    if accelerator is not None:
        from accelerate import Accelerator

        if not isinstance(accelerator, Accelerator):
            raise TypeError("sharddemo.watch: accelerator must be your accelerate.Accelerator, "
                            f"or None (torch.distributed alone, or one process); got "
                            f"{type(accelerator).__name__} {accelerator!r:.40}")
        launched = os.environ.get("WORLD_SIZE", "")
        if launched.isdigit() and int(launched) > accelerator.num_processes:
            # the CPU trap (README, "Launching on CPU"): every process trains alone on the
            # whole dataset, and each one's watch, seeing one rank, would call that sharded
            warnings.warn(f"sharddemo.watch: launched for {launched} processes (WORLD_SIZE) but "
                          f"this accelerator has {accelerator.num_processes}: this process is "
                          "alone and trains on the whole dataset, and the watch sees it alone; "
                          "without GPUs build Accelerator(cpu=True) for real ranks on gloo",
                          RuntimeWarning, stacklevel=3)
    if id_field is not None and (isinstance(id_field, bool)
                                 or not isinstance(id_field, (str, int))):
        raise TypeError("sharddemo.watch: id_field must be a str (a dict key, or '.' for a "
                        "batch that is the ids) or an int (a tuple position), got "
                        f"{type(id_field).__name__} {id_field!r:.40}")
    if report is not None:
        validate_report(report, accelerator)


def validate_report(report, accelerator) -> None:
    """Check that the report file can be appended to.

    Its folder is made (by the main process, which writes it) if it does not exist; a folder in
    its place, or one that cannot be made or written, is refused. Checked on every rank, so that
    every rank stops at watch() with the same error (the others only look: they make nothing).
    """
    if not isinstance(report, (str, os.PathLike)):
        raise TypeError("sharddemo.watch: report must be a file path (str) or None, got "
                        f"{type(report).__name__}")
    if accelerator is not None:
        main = accelerator.is_main_process
    else:  # torch.distributed alone: the group may not exist yet; torchrun says the rank
        import torch.distributed as dist

        main = (dist.get_rank() == 0 if dist.is_available() and dist.is_initialized()
                else os.environ.get("RANK", "0") == "0")
    path = os.path.abspath(os.fspath(report))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        inside = os.path.join(os.fspath(report), "sharddemo-watch.jsonl")
        raise ValueError(f"sharddemo.watch: report {os.fspath(report)!r} is a folder; give a "
                         f"file path, e.g. {inside!r}")
    why = None
    if main:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as error:
            why = error.strerror or str(error)
    else:  # where the main process would make it: the nearest folder that exists
        above = folder
        while not os.path.exists(above) and os.path.dirname(above) != above:
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            why = "Not a directory"
        elif above != folder and not os.access(above, os.W_OK):
            why = "Permission denied"
    if why is not None:
        raise ValueError(f"sharddemo.watch: report {os.fspath(report)!r}: its folder cannot be "
                         f"made ({why})") from None
    if os.path.isdir(folder) and (not os.access(folder, os.W_OK)
                                  or (os.path.exists(path) and not os.access(path, os.W_OK))):
        raise ValueError(f"sharddemo.watch: report {os.fspath(report)!r} cannot be written "
                         "(no write permission); give a path you can write, or report=None")


def watch_loader(loader, accelerator=None, *, name: str, report: Optional[str], id_field: Any = None,
           on_violation: str = "warn", role: str = "train", start_epoch: int = 0,
           check_every: Union[int, str, None] = CHECK_EVERY, dataset_size: Optional[int] = None,
           lineage: Optional[str] = None, mesh=None, measure: Optional[dict] = None):
    """Watch a loader: watch(), for the framework callbacks too.

    `role` "eval" adds the eval verdict (eval-counts-each-sample-once); `start_epoch` numbers
    the first epoch (a resumed run); `lineage`: the folder of the lineage writer (checked by the
    caller); `mesh`: (sharddemo.mesh.MeshLayout, this rank) on a device mesh (mesh_place);
    `measure`: the tokens and sources to count (validate_measures)."""
    if getattr(loader, "__dict__", {}).get("_sharddemo_watch") is not None:
        return loader  # watched already (a callback called twice)
    shared = ray_watch(loader)
    if shared is not None:  # Ray Data: iter_torch_batches() called again (a new epoch's)
        attach(loader, shared)
        return loader
    state = WatchState(accelerator, name, report, id_field, on_violation, role, check_every)
    # the watch's collectives come right before a loader forks its workers (an epoch's end,
    # then the next epoch's iter()): the pause that keeps CPython 3.11's fork from deadlocking
    # a worker (rank.collect.guard_forks, docs/reliability.md)
    guard_forks()
    state.epoch = start_epoch
    if mesh is not None:
        state.on_mesh(*mesh)
    if measure is not None:
        state.measure(**measure)
    if dataset_size is not None:
        state.n = int(dataset_size)  # (before attach: the loader's own length comes second)
    if lineage is not None:
        state.lineage = LineageWriter(lineage, state)
    attach(loader, state)
    keep_ray_watch(loader, state)
    if accelerator is not None:
        follow(accelerator, state)
        if hasattr(accelerator, "register_save_state_pre_hook"):
            checkpoint(accelerator, state)
    return loader


# Ray DataIterator -> the watch of its batches (ray_watch): held weakly, never on Ray's object
# (a DataIterator is shipped between processes; the watch is not)
RAY_WATCHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ray_watch(loader) -> Optional[WatchState]:
    """Return the watch of the Ray DataIterator behind `loader`, where one was watched before.

    Ray Data's batches, where an earlier iter_torch_batches() of the same DataIterator was
    watched: a loop that calls iter_torch_batches() each epoch, and watches each, goes on with
    one watch (its epochs counted on, each pass compared with the one before)."""
    from sharddemo.watching.raydata import data_iterator, is_ray_batches

    if not is_ray_batches(loader):
        return None
    try:
        state = RAY_WATCHES.get(data_iterator(loader))
    except TypeError:  # (None, or an object that cannot be weakly referenced)
        return None
    return state if state is not None and not state.finished else None


def keep_ray_watch(loader, state: WatchState) -> None:
    """Note the watch of the Ray DataIterator behind `loader` (see ray_watch)."""
    from sharddemo.watching.raydata import data_iterator, is_ray_batches

    if is_ray_batches(loader):
        try:
            RAY_WATCHES[data_iterator(loader)] = state
        except TypeError:
            pass


__all__ = ["ShardingViolation", "watch", "watch_loader"]
