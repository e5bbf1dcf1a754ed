"""TrainerWatch: sharddemo.watch inside `Trainer.train()` (transformers).

    Trainer(..., callbacks=[TrainerWatch()])

The train loader the Trainer prepares is watched from `on_train_begin` (every epoch, and the
loader `skip_first_batches` makes on a resume), and every evaluation's loader as
`get_eval_dataloader` returns it. The ids are the indices the loaders' own samplers hand out,
so no id column is needed and the default `remove_unused_columns=True` stays. The report goes
to `<output_dir>/sharddemo-watch.jsonl` unless `report=` says otherwise.

transformers hands a callback no Trainer: TrainerWatch finds the Trainer that calls it on the
call stack (the frame of the Trainer method that fires the event), once, to reach its
`get_eval_dataloader` and `get_resumed_dataloader` (where this transformers has none, 5.17.0:
the `skip_first_batches` its training loop calls).
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any, Optional

from transformers import Trainer, TrainerCallback

from sharddemo.watching import validate_measures, watch_loader
from sharddemo.watching.hooks import attach
from sharddemo.watching.lineage import validate_lineage_folder
from sharddemo.watching.state import WatchState


STATE_FILE = "sharddemo_watch.pt"


def _trainer_frames():
    """Return the frames of the Trainer methods on the call stack, innermost first.

    The callback handler's event is fired from one of them."""
    frame = inspect.currentframe()
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Trainer):
            yield frame
        frame = frame.f_back


def _resuming_from() -> Optional[str]:
    """Return the checkpoint folder the calling Trainer resumes from, or None.

    Its training loop's own `resume_from_checkpoint`, resolved by Trainer.train."""
    return next((f.f_locals["resume_from_checkpoint"] for f in _trainer_frames()
                 if isinstance(f.f_locals.get("resume_from_checkpoint"), str)), None)


def mid_epoch(folder: str) -> bool:
    """Say whether the Trainer's checkpoint in `folder` was saved in the middle of an epoch.

    Its trainer_state.json's epoch is not a whole number; False where it cannot be read."""
    try:
        with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as handle:
            epoch = float(json.load(handle).get("epoch") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return False
    return epoch != int(epoch)


def _calling_trainer() -> Optional[Trainer]:
    return next((f.f_locals["self"] for f in _trainer_frames()), None)


def _watch_resumed(dataloader, made) -> None:
    """Watch the loader a resume makes from a watched one, by the same watch.

    accelerate's skip_first_batches makes it: it is what the resumed epoch's loop receives."""
    state = getattr(dataloader, "__dict__", {}).get("_sharddemo_watch")
    if state is not None and made is not dataloader:
        attach(made, state)


def _follow_module_skip() -> None:
    """Make transformers' own skip_first_batches return a watched loader for a watched one.

    For a transformers without Trainer.get_resumed_dataloader (5.17.0, which the extra's
    transformers>=5.0 allows): its training loop calls accelerate's skip_first_batches, imported
    into transformers.trainer, directly. That name is made to return a watched loader for a
    watched one, once per process (a loader no watch holds passes through unchanged, so other
    Trainers of the process are not affected)."""
    import transformers.trainer as module

    skip = getattr(module, "skip_first_batches", None)
    if skip is None or getattr(skip, "sharddemo_follows", False):
        return  # nothing to follow: a resumed epoch's loader would not be watched

    def skip_first_batches(dataloader, num_batches=0):
        made = skip(dataloader, num_batches)
        _watch_resumed(dataloader, made)
        return made

    skip_first_batches.sharddemo_follows = True
    module.skip_first_batches = skip_first_batches


class TrainerWatch(TrainerCallback):
    """Watch a Trainer's train loader every epoch and its eval loader at every evaluation.

    A transformers Trainer (docs/watch.md); the epoch open at on_train_end (max_steps) is
    reported as partial.

    Args:
        report: the JSON-lines file (default <output_dir>/sharddemo-watch.jsonl).
        on_violation: "warn", "raise" (ShardingViolation on every rank) or "ignore".
        lineage: a folder for the train loader's lineage (watch(..., lineage=DIR)).
        tokens, sources, weights, max_token_skew: as sharddemo.watch's, for the train loader
            (tokens per data-parallel group, the realized mixture of sources; docs/tokens.md).

    Example::

        from sharddemo.integrations import TrainerWatch
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TrainerWatch()])
        trainer.train()
    """

    def __init__(self, report: Optional[str] = None, on_violation: str = "warn",
                 lineage: Optional[str] = None, tokens: Any = None, sources: Any = None,
                 weights: Any = None, max_token_skew: Optional[float] = None) -> None:
        if lineage is not None:
            validate_lineage_folder(lineage)
        self.lineage = lineage
        # tokens=, sources=, weights=, max_token_skew=: as watch()'s, for the train loader
        self.measure = validate_measures(tokens, sources, weights, max_token_skew)
        self.report = report
        self.on_violation = on_violation
        self.trainer: Optional[Trainer] = None
        self.eval_state: Optional[WatchState] = None
        self.evaluations = 0  # evaluations of the run before this process (a resumed run)
        self.train_loader = None

    def _report(self, args) -> str:
        return self.report or os.path.join(args.output_dir, "sharddemo-watch.jsonl")

    def _hook(self, args) -> None:
        """Once: the calling Trainer's eval and resumed loaders come back watched."""
        if self.trainer is not None:
            return
        trainer = _calling_trainer()
        if trainer is None:
            return
        self.trainer = trainer
        get_eval = trainer.get_eval_dataloader

        def get_eval_dataloader(*a, **kw):
            loader = get_eval(*a, **kw)
            if self.eval_state is None:
                watch_loader(loader, name="eval", report=self._report(args),
                       on_violation=self.on_violation, role="eval",
                       start_epoch=self.evaluations)  # numbered per evaluation of the run
                self.eval_state = loader.__dict__["_sharddemo_watch"]
            else:  # each evaluation is one more "epoch" of the same eval loader
                attach(loader, self.eval_state)
            return loader

        trainer.get_eval_dataloader = get_eval_dataloader
        get_resumed = getattr(trainer, "get_resumed_dataloader", None)
        if get_resumed is None:  # transformers 5.17.0 and earlier (see _follow_module_skip)
            _follow_module_skip()
            return

        def get_resumed_dataloader(dataloader, num_batches):
            made = get_resumed(dataloader, num_batches)
            _watch_resumed(dataloader, made)
            return made

        trainer.get_resumed_dataloader = get_resumed_dataloader

    def on_init_end(self, args, state, control, **kwargs):
        self._hook(args)

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self._hook(args)
        if train_dataloader is not None and train_dataloader is not self.train_loader:
            self.train_loader = train_dataloader
            watch_loader(train_dataloader, name="train", report=self._report(args),
                   on_violation=self.on_violation, start_epoch=int(state.epoch or 0),
                   lineage=self.lineage, measure=self.measure)
            # a resumed run: the watch's place as the checkpoint saved it (on_save below)
            folder = _resuming_from()
            saved = os.path.join(folder, STATE_FILE) if folder else None
            if saved and os.path.exists(saved):
                import torch

                place = torch.load(saved, weights_only=False)
                train_dataloader.__dict__["_sharddemo_watch"].load_state_dict(place)
                self.evaluations = int(place.get("evaluations", 0))
            elif folder and mid_epoch(folder):
                # a checkpoint saved before the watch was added, in the middle of an epoch
                train_dataloader.__dict__["_sharddemo_watch"].resumed_without_state(
                    f"{folder} holds no {STATE_FILE}")

    def on_save(self, args, state, control, train_dataloader=None, **kwargs):
        """Save the watch's place beside the Trainer's checkpoint, reduced across the ranks.

        Every rank is here; the main process writes it."""
        watched = getattr(train_dataloader, "__dict__", {}).get("_sharddemo_watch")
        if watched is None or self.trainer is None:
            return
        saved = watched.state_dict()  # a collective
        # the evaluations so far, so that a resumed run numbers its next one on
        saved["evaluations"] = self.eval_state.epoch if self.eval_state else self.evaluations
        if watched.ranks.is_main_process:
            import torch

            folder = os.path.join(self.trainer._get_output_dir(None),
                                  f"checkpoint-{state.global_step}")
            if os.path.isdir(folder):
                torch.save(saved, os.path.join(folder, STATE_FILE))

    def on_epoch_end(self, args, state, control, train_dataloader=None, **kwargs):
        # The Trainer takes exactly the epoch's steps and never asks the loader for one more,
        # so the loader is not exhausted: the epoch ends here, on every rank alike.
        # A stop mid-epoch (max_steps, a callback, a time limit) leaves it open: the Trainer's
        # state.epoch (epoch + steps taken / steps in the epoch) is then not a whole number,
        # and on_train_end reports the part as partial.
        watched = getattr(train_dataloader, "__dict__", {}).get("_sharddemo_watch")
        mid_epoch = abs(float(state.epoch or 0) - round(float(state.epoch or 0))) > 1e-6
        if control.should_training_stop and mid_epoch:
            return
        if watched is not None:
            watched.close_epoch(train_dataloader)

    def on_train_end(self, args, state, control, train_dataloader=None, **kwargs):
        """End training, on every rank: report an epoch left open as partial, close the watches.

        An epoch left open: max_steps, a stop."""
        watched = getattr(train_dataloader, "__dict__", {}).get("_sharddemo_watch")
        for one in (watched, self.eval_state):
            if one is not None:
                one.close()

    def on_epoch_begin(self, args, state, control, train_dataloader=None, **kwargs):
        watched = getattr(train_dataloader, "__dict__", {}).get("_sharddemo_watch")
        if watched is not None and watched.recorder is None:
            watched.epoch = int(state.epoch or 0)  # the Trainer's count (a resumed run's too)
