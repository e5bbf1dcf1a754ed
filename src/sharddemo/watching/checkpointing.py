"""The watch's checkpointed state: what `state_dict()` saves of the open epoch (accelerate's
save_state / load_state pre-hooks, watching.hooks.checkpoint: accelerate calls them on every
rank and the main process writes the state; the Trainer's and Lightning's callbacks), and what
`load_state_dict()` takes back: the epoch, the samples delivered before the stop, the epoch's
chain of restarts (analysis/watch_resume.py judges the resumed epoch with them).

Checkpointing is a part of WatchState (watching/state.py), kept here: its methods read and set
the watch's own attributes (epoch, previous, loaded, before, again, restarts, steps_before,
unknown_before, edge_rest, lineage)."""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch

SCHEMA = "sharddemo.watch-state/1"


class Checkpointing:
    """The checkpoint part of WatchState: state_dict and load_state_dict, and a resume from a
    checkpoint that holds no state of the watch's."""

    def state_dict(self) -> dict:
        """The watch's place in the run, reduced across the ranks: the epoch, which samples
        this epoch has delivered so far (a collective, where N is known), and the last
        finished epoch's record (for the order)."""
        from sharddemo.analysis.watch_resume import id_list

        if not self.closed and not self.finished and self.at_edge():
            return self.state_at_edge()
        before, again, restarts = None, None, [dict(r) for r in self.restarts]
        self.note_batches()
        if self.n is not None and not self.two_bits():  # (every rank alike: N is the length)
            if self.recorder is None:
                self.recorder = self.new_recorder()
            before = self.recorder.log.present_so_far(self.ranks)  # since the last restart
            if self.before is not None and before is not None:  # resumed, then saved again
                # the part since the restart repeated these; the chain's parts add up
                last = (self.before > 0) & (before > 0)
                again = last if self.again is None else last | (self.again > 0)
                restarts[-1].update(seen_before=int(self.before.sum(dtype=np.int64)),
                                    repeated=id_list(np.flatnonzero(last)))
                before = np.minimum(self.before.astype(np.int64) + before, 255).astype(np.uint8)
        return self.saved(epoch=self.epoch,
                          before=None if before is None else torch.from_numpy(before),
                          again=(None if again is None
                                 else torch.from_numpy(again.astype(np.uint8))),
                          restarts=restarts, step=self.steps_before + self.open_steps(),
                          at_edge=self.at_edge(), unknown_before=self.unknown_before)

    def state_at_edge(self) -> dict:
        """state_dict() for a save after the epoch's last step, inside the loop: the epoch is
        whole, so it ends here (every rank saves at the same point) and its record goes in
        the checkpoint as `previous`, so that the first epoch after a resume is compared with
        it (a resumed loader that replays this epoch's order is caught). The loop's own end
        of the pass then finds the epoch closed."""
        epoch, step = self.epoch, self.steps_before + self.open_steps()
        restarts = [dict(r) for r in self.restarts]
        self.end_epoch(self.described, partial=False)
        return self.saved(epoch=epoch, before=None, again=None, restarts=restarts, step=step,
                          at_edge=True, unknown_before=False)

    def saved(self, **place) -> dict:
        """The watch's state as a checkpoint holds it: `place` (the epoch, the steps, what
        the open epoch delivered so far) and what every save holds alike (tensors, not numpy
        arrays: Lightning loads checkpoints with weights_only=True)."""
        return {"schema": SCHEMA, "loader": self.name,
                "dataset_size": self.n, "previous": self.previous,
                "world_size": self.ranks.num_processes,
                "lineage": self.lineage.place() if self.lineage else None, **place}

    def foreign(self, state) -> Optional[str]:
        """Why a checkpoint's watch state is not this loader's (None: it is)."""
        if not isinstance(state, dict) or state.get("schema") != SCHEMA:
            return "it is not a state sharddemo.watch saved"
        size = state.get("dataset_size")
        if size is not None and self.n is not None and int(size) != self.n:
            return (f"it was saved for a dataset of {int(size):,} samples, this loader's has "
                    f"{self.n:,}")
        if state.get("loader") != self.name:
            return (f"it was saved for the loader named {state.get('loader')!r}, not "
                    f"{self.name!r}")
        return None

    def resumed_without_state(self, why: str) -> None:
        """A resume from a checkpoint without (usable) watch state: the part of the epoch
        before the stop is unknown; the rest is judged (no missing verdict for the epoch)."""
        from sharddemo.analysis.watch_resume import restart

        if self.ranks.is_main_process:
            warnings.warn(f"sharddemo.watch: {self.name}: resumed from a checkpoint without the "
                          f"watch's state ({why}): the part of the epoch before the stop is "
                          "unknown; the rest is judged", RuntimeWarning, stacklevel=3)
        self.before, self.again, self.steps_before = None, None, 0
        self.unknown_before = True
        self.restarts = [restart(self.epoch, None, None, self.ranks.num_processes)]

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's watch state, loaded: the epoch goes on from its place (the samples
        the open epoch delivered before the stop, its chain of restarts), or, saved after the
        epoch's last step, the next epoch starts. A state that is not this loader's is said
        once and the resume judged without it (resumed_without_state)."""
        from sharddemo.analysis.watch_resume import restart

        problem = self.foreign(state)
        if problem:
            return self.resumed_without_state(f"its watch state is not this loader's: {problem}")
        self.epoch = int(state["epoch"])
        if self.lineage:  # the steps go on; the restart is recorded
            self.lineage.resume(state.get("lineage"))
        self.previous = state.get("previous")
        self.loaded = self.previous is not None  # the next epoch's order is the checkpoint's

        def array(key):
            value = state.get(key)
            return value.numpy() if isinstance(value, torch.Tensor) else value

        before, again = array("before"), array("again")
        step, saved_on = state.get("step"), state.get("world_size")
        now = self.ranks.num_processes
        self.unknown_before = bool(state.get("unknown_before"))
        if state.get("at_edge"):
            # saved after the epoch's last step: the epoch is whole, the run goes on with the
            # next one (from its first sample: nothing before it, nothing to repeat)
            self.restarts = [restart(self.epoch, step, saved_on, now, at_edge=True)]
            self.epoch += 1
            self.edge_rest = True
            before, again, step = None, None, 0
            self.unknown_before = False
        else:
            self.restarts = [*(state.get("restarts") or []),
                             restart(self.epoch, step, saved_on, now)]
        if before is None and self.n is not None and not self.unknown_before:
            before = np.zeros(self.n, dtype=np.uint8)  # (a restart at the epoch's start)
        self.before, self.again = before, again
        self.steps_before = int(step or 0)

    def note_restart(self, **facts) -> None:
        """What the framework did at the open epoch's last restart, for its words
        (analysis.watch_line.restart_words): Lightning's `from_start`."""
        if self.restarts:
            self.restarts[-1].update(facts)
