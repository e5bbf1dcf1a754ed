"""`sharddemo.watch` (this package: sharddemo.watching; its state in state.py, its hooks into loaders
and accelerate in hooks.py, the Trainer and Lightning callbacks in trainer.py and lightning.py): check the real training run's sharding, epoch by epoch, as it trains.

    from sharddemo import watch

    loader = watch(loader, accelerator)          # one line in your script
    for epoch in range(epochs):
        for batch in loader:                     # your batches, untouched
            ...
    # at the end of each epoch the main process prints one line, e.g.
    # sharddemo: epoch 1 train: 40 of 40 samples once across 2 ranks, 5 steps each, order changed: ok
    # and appends one JSON object to sharddemo-watch.jsonl (docs/watch.md)

It is the recorder of `sharddemo audit` (rank.recorder.Recorder) inside your own loop, and the
report's analysis (sharddemo.analysis) at the end of each epoch: the same reasons, words and
verdicts as `audit`.

How it sees the ids without touching a batch: for a map-style dataset, the indices that the
loader's own index sampler (its batch sampler, or its sampler with batch_size=None) hands out
on this rank are noted in the main process as the loader's iterator asks for them, and each
batch the loop receives takes the oldest noted indices (a DataLoader yields its batches in the
order their indices were drawn, workers or not). A Subset's indices are mapped to the root
dataset's. With `id_field`, the ids are read from each batch instead (any dataset, streams
included). Each rank counts what reached its loop (one byte per sample where the dataset's
length is known, else the ids), and at the end of the epoch one exchange brings it together:
no collective and no host sync per step.

It follows the loader where accelerate makes a new one from it: `accelerator.prepare(loader)`
and `accelerator.skip_first_batches(loader, k)` return watched loaders when `accelerator` was
given to `watch` (the skipped batches never reach the loop, and are not counted).
"""

from __future__ import annotations

from typing import Any, Optional

from sharddemo.errors import ShardingViolation
from sharddemo.watching.hooks import attach, checkpoint, follow
from sharddemo.watching.state import CHECK_EVERY, ON_VIOLATION, WatchState


def watch(loader, accelerator=None, *, name: str = "train",
          report: Optional[str] = "sharddemo-watch.jsonl", id_field: Any = None,
          on_violation: str = "warn", check_every: Optional[int] = CHECK_EVERY,
          dataset_size: Optional[int] = None):
    """Watch `loader` in your own training loop; returns the same loader object.

    `accelerator`: your Accelerator (its collectives carry the exchange, and a loader it
    prepares or skips from this one stays watched); None under torch.distributed alone or in
    one process. `name`: the loader's name in the line and the report. `report`: the JSON-lines
    file the main process appends one object to per epoch (None: no file). `id_field`: the
    batch's field (dict key, tuple position, or "." for a batch that is the ids) holding each
    sample's id; default: the indices the loader's own sampler hands out (map-style datasets).
    `on_violation`: "warn" (the line says FAIL), "raise" (ShardingViolation on every rank at
    the epoch's end) or "ignore" (the report only). `check_every`: every this many steps the
    ranks meet once to check the window of steps so far (replication, ranks that disagree
    about the dataset, a rank out of data; docs/watch.md); 0 or None: only at the epoch's
    end. `dataset_size`: N, the ids 0..N-1 a stream read with `id_field` can deliver
    (default: a map-style dataset's length; for a stream, inferred from the largest id seen,
    which cannot see ids lost at the tail, and the line says so)."""
    if on_violation not in ON_VIOLATION:
        raise ValueError(f"sharddemo.watch: on_violation must be one of "
                         f"{', '.join(ON_VIOLATION)}, got {on_violation!r}")
    if not hasattr(loader, "__iter__"):
        raise TypeError(f"sharddemo.watch: expected a DataLoader, got {type(loader).__name__}")
    return watch_loader(loader, accelerator, name=name, report=report, id_field=id_field,
                  on_violation=on_violation, check_every=check_every,
                  dataset_size=dataset_size)


def watch_loader(loader, accelerator=None, *, name: str, report: Optional[str], id_field: Any = None,
           on_violation: str = "warn", role: str = "train", start_epoch: int = 0,
           check_every: Optional[int] = CHECK_EVERY, dataset_size: Optional[int] = None):
    """watch(), for the framework callbacks too: `role` "eval" adds the eval verdict
    (eval-counts-each-sample-once); `start_epoch` numbers the first epoch (a resumed run)."""
    if getattr(loader, "__dict__", {}).get("_sharddemo_watch") is not None:
        return loader  # watched already (a callback called twice)
    state = WatchState(accelerator, name, report, id_field, on_violation, role, check_every)
    state.epoch = start_epoch
    if dataset_size is not None:
        state.n = int(dataset_size)  # (before attach: the loader's own length comes second)
    attach(loader, state)
    if accelerator is not None:
        follow(accelerator, state)
        if hasattr(accelerator, "register_for_checkpointing"):
            checkpoint(accelerator, state)
    return loader


__all__ = ["ShardingViolation", "watch", "watch_loader"]
