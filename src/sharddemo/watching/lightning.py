"""LightningWatch: sharddemo.watch inside Lightning's `Trainer.fit()`.

    Trainer(callbacks=[LightningWatch()])

Works with `pytorch_lightning` and with `lightning` (the callback class is the one of the
package your Trainer comes from). From `on_train_start` the DataLoaders Lightning built (with the
DistributedSampler it injects) are watched in place, and any it builds anew at an epoch's
start; the validation loaders carry the eval verdict (eval-counts-each-sample-once: Lightning pads them
like any DistributedSampler). The report goes to `<default_root_dir>/sharddemo-watch.jsonl`.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from sharddemo.watching import validate_measures, watch_loader
from sharddemo.watching.lineage import validate_lineage_folder

try:  # what most users have
    from pytorch_lightning import Callback as _PLCallback
except ImportError:  # pragma: no cover - the other package alone
    _PLCallback = None
try:
    from lightning.pytorch import Callback as _LCallback
except ImportError:  # pragma: no cover
    _LCallback = None

_BASES = tuple(b for b in (_PLCallback, _LCallback) if b is not None)


def _loaders(combined) -> list:
    """The DataLoaders inside what Lightning holds (a CombinedLoader, a list, one loader)."""
    flat = getattr(combined, "flattened", None)
    if flat is not None:
        return list(flat)
    if isinstance(combined, (list, tuple)):
        return list(combined)
    return [] if combined is None else [combined]


def _resumable(loader) -> bool:
    """Say whether Lightning restores the loader's position from a checkpoint.

    A loader with state_dict and load_state_dict does (Lightning's own test, its _Stateful
    protocol)."""
    return callable(getattr(loader, "state_dict", None)) and \
        callable(getattr(loader, "load_state_dict", None))


def _capped(trainer, loader) -> bool:
    """Say whether Lightning takes fewer batches an epoch than the loader has.

    limit_train_batches: each epoch is then a part, as the user asked."""
    try:
        return int(trainer.num_training_batches) < len(loader)
    except (TypeError, ValueError, OverflowError):  # no length (a stream), or inf
        return False


class LightningWatch(*_BASES):
    """Watch a Lightning Trainer's train loaders every epoch and its val loaders at every pass.

    Every validation pass (docs/watch.md); an epoch cut by max_steps or limit_train_batches is
    reported as partial.

    Args:
        report: the JSON-lines file (default <default_root_dir>/sharddemo-watch.jsonl).
        on_violation: "warn", "raise" (ShardingViolation on every rank) or "ignore".
        lineage: a folder for the train loader's lineage (watch(..., lineage=DIR); with
            several train loaders, the first one's).
        tokens, sources, weights, max_token_skew: as sharddemo.watch's, for the train loader
            (tokens per data-parallel group, the realized mixture of sources; docs/tokens.md).

    Example::

        from sharddemo.integrations import LightningWatch
        trainer = L.Trainer(strategy="ddp", devices=2, callbacks=[LightningWatch()])
        trainer.fit(model, datamodule)
    """

    def __init__(self, report: Optional[str] = None, on_violation: str = "warn",
                 lineage: Optional[str] = None, tokens: Any = None, sources: Any = None,
                 weights: Any = None, max_token_skew: Optional[float] = None) -> None:
        super().__init__()
        if lineage is not None:
            validate_lineage_folder(lineage)
        self.lineage = lineage
        # tokens=, sources=, weights=, max_token_skew=: as watch()'s, for the train loader
        self.measure = validate_measures(tokens, sources, weights, max_token_skew)
        self.report = report
        self.on_violation = on_violation
        self.train_states: list = []  # the train loaders' watches (the checkpoint's part)
        self.loaded: Optional[dict] = None  # from a checkpoint, until the loaders are watched
        self.restored = False  # a checkpoint gave this callback its state back
        self.val_states: dict = {}  # name -> the val loader's watch (its validation passes)
        self.val_passes: dict = {}  # name -> the passes before this process (a resumed fit)

    # Lightning saves a callback's state_dict with every checkpoint (dump_checkpoint runs on
    # every rank, so the watch's reduction, a collective, can run there) and gives it back on
    # every rank when fit(ckpt_path=...) restores.
    def state_dict(self) -> dict:
        # (the validation passes so far: a resumed fit numbers its next one on)
        return {"train": [state.state_dict() for state in self.train_states],
                "val": {**self.val_passes,
                        **{name: state.epoch for name, state in self.val_states.items()}}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = state_dict
        self.restored = True
        self.val_passes = dict(state_dict.get("val", {}))

    def _report(self, trainer) -> str:
        return self.report or os.path.join(trainer.default_root_dir, "sharddemo-watch.jsonl")

    def _watch_all(self, trainer, combined, name: str, role: str) -> None:
        loaders = _loaders(combined)
        for i, loader in enumerate(loaders):
            named = name if len(loaders) == 1 else f"{name}:{i}"
            watch_loader(loader, name=named,
                   report=self._report(trainer), on_violation=self.on_violation, role=role,
                   start_epoch=(trainer.current_epoch if role == "train" else
                                self.val_states[named].epoch if named in self.val_states
                                else int(self.val_passes.get(named, 0))),
                   lineage=self.lineage if role == "train" and i == 0 else None,
                   measure=self.measure if role == "train" else None)
            state = loader.__dict__["_sharddemo_watch"]
            if role == "train" and state not in self.train_states:
                self.train_states.append(state)
            if role == "eval":
                self.val_states[named] = state
        if role == "train" and self.loaded is not None:
            for state, saved in zip(self.train_states, self.loaded.get("train", [])):
                state.load_state_dict(saved)
            self.loaded = None

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning has built the loaders (its sampler injected) and iterates them from here:
        # the first train epoch's iterator and every validation's are made before the
        # epoch-start hooks run
        self._watch_all(trainer, trainer.train_dataloader, "train", "train")
        self._watch_all(trainer, trainer.val_dataloaders, "val", "eval")
        # fit(ckpt_path=...) from a checkpoint that holds no state of this callback (saved
        # before it was added), in the middle of an epoch: the part before the stop is unknown
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if (not self.restored and getattr(trainer, "ckpt_path", None)
                and 0 < done < trainer.num_training_batches):
            for state in self.train_states:
                state.resumed_without_state(f"{trainer.ckpt_path} holds no LightningWatch state")
        elif self.restored and 0 < done < trainer.num_training_batches and not all(
                _resumable(loader) for loader in _loaders(trainer.train_dataloader)):
            # Lightning restores its batch count, not a DataLoader's position: it iterates the
            # loader from the start of the epoch's order and stops at the epoch's step count
            # (its training epoch loop; it warns "can cause unreliable results")
            for state in self.train_states:
                state.note_restart(from_start={"by": "Lightning", "steps_before": int(done),
                                               "epoch_steps": int(trainer.num_training_batches)})
        # The fit loop made its first epoch's iterator before any hook ran (its setup_data),
        # a resumed fit's too: made again, it comes from the watched loaders. Nothing has been
        # taken from it yet (a loader with a length is not prefetched), so the epoch is the
        # same; the epoch loop adds the steps a resumed fit had taken afterwards.
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is not None and getattr(fetcher, "fetched", 1) == 0 \
                and not getattr(fetcher, "batches", None):
            iter(fetcher)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # loaders built anew (reload_dataloaders_every_n_epochs); the others are watched already
        self._watch_all(trainer, trainer.train_dataloader, "train", "train")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # the loaders' exhaustion ends their epoch; where the loop stopped short of it at the
        # epoch's own limit (limit_train_batches) the epoch ends here as partial, on every rank
        # alike. A fit stopped before that (max_steps, trainer.should_stop: a time limit, a
        # callback) leaves it open: on_train_end reports it as partial (after the checkpoint
        # of this epoch's end, which saves the watch's place mid-epoch, was written).
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if done < trainer.num_training_batches:
            return
        for loader in _loaders(trainer.train_dataloader):
            watched = getattr(loader, "__dict__", {}).get("_sharddemo_watch")
            if watched is not None:
                watched.close_epoch(loader, partial=_capped(trainer, loader))

    def on_train_end(self, trainer, pl_module) -> None:
        for loader in (*_loaders(trainer.train_dataloader), *_loaders(trainer.val_dataloaders)):
            watched = getattr(loader, "__dict__", {}).get("_sharddemo_watch")
            if watched is not None:
                watched.close()

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._watch_all(trainer, trainer.val_dataloaders, "val", "eval")

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        # the validation loop takes exactly its batches and never asks for one more
        if not trainer.sanity_checking:
            for loader in _loaders(trainer.val_dataloaders):
                watched = getattr(loader, "__dict__", {}).get("_sharddemo_watch")
                if watched is not None:
                    watched.close_epoch(loader)
