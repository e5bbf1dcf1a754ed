"""The watch's checkpointed state: what `state_dict()` saves of the open epoch (accelerate's
save_state / load_state pre-hooks, watching.hooks.checkpoint: accelerate calls them on every
rank and the main process writes the state; the Trainer's and Lightning's callbacks; the
watched loader's own state_dict() / load_state_dict(), under the key WATCH_KEY, for loops that
checkpoint the loader itself), and what `load_state_dict()` takes back: the epoch, the samples
delivered before the stop, the epoch's chain of restarts, the topology the state was saved on
(analysis/entry_resume.py judges the resumed epoch with them).

Checkpointing is a part of WatchState (watching/state.py), kept here: its methods read and set
the watch's own attributes (epoch, previous, loaded, before, again, restarts, steps_before,
unknown_before, edge_rest, lineage)."""

from __future__ import annotations

import io
import warnings
from typing import Optional

import numpy as np
import torch

from sharddemo.rank.collect import share_from_main

SCHEMA = "sharddemo.watch-state/1"
# the key of the watch's part in a watched loader's state_dict() (hooks.attach): the loader's own
# state keeps every other key, and a loader state without it was saved before the watch
WATCH_KEY = "_sharddemo_watch"
# what a topology change is named by, in the entry (restart["changed"]) and in words
TOPOLOGY = ("world_size", "mesh", "num_workers", "batch_size")


class Checkpointing:
    """The checkpoint part of WatchState: state_dict and load_state_dict, and a resume from a
    checkpoint that holds no state of the watch's."""

    def moment(self) -> tuple:
        """Where the loop is: two saves (or loads) at the same moment are one (accelerate's
        save_state asks the watch's hook and then the prepared loader's state_dict() for the
        same point; no batch and no pass between them)."""
        return (self.epoch, self.passes, self.open_steps(), self.closed, self.finished)

    def state_dict(self) -> dict:
        """The watch's place in the run, reduced across the ranks: the epoch, which samples
        this epoch has delivered so far (a collective, where N is known), and the last
        finished epoch's record (for the order). Asked again at the same moment (no batch
        since: accelerate's hook, then its loader's state_dict()), the same state, with no
        second collective (every rank asks at the same points, so every rank takes it)."""
        if self.saved_at is not None and self.saved_at[0] == self.moment():
            return self.saved_at[1]
        payload = self.place_now()
        self.saved_at = (self.moment(), payload)
        return payload

    def place_now(self) -> dict:
        """state_dict(), computed."""
        from sharddemo.analysis.entry_resume import id_list

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
        # the tokens and sources so far, by group (a collective, as above), so that the
        # resumed epoch's sums include them
        tokens_before = self.token_parts(keep=True)
        return self.saved(epoch=self.epoch, tokens_before=tokens_before,
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
                "world_size": self.ranks.num_processes, "topology": self.topology(),
                "lineage": self.lineage.place() if self.lineage else None, **place}

    def topology(self) -> dict:
        """What a loader's saved position depends on besides the epoch: the ranks, the mesh,
        the loader's workers and batch size (a position counted at one is other samples at
        another; torchdata's StatefulDataLoader refuses another number of workers)."""
        mesh = None
        if self.mesh is not None:
            shape = ",".join(f"{d}={s}" for d, s in zip(self.mesh.dims, self.mesh.sizes))
            mesh = f"{shape} (data: {','.join(self.mesh.data_dims) or 'none'})"
        return {"world_size": self.ranks.num_processes, "mesh": mesh,
                "num_workers": (self.description or {}).get("num_workers"),
                "batch_size": self.batch_size}

    def topology_changes(self, state: dict) -> dict:
        """What differs between the topology a state was saved on and this run's:
        {"num_workers": [2, 4], ...}; {} where nothing does, or the state says nothing."""
        saved = state.get("topology")
        if not isinstance(saved, dict):
            return {}
        now = self.topology()
        # a mesh's None is a flat world (a mesh added or dropped is a change); any other
        # figure's None is one the watch could not read
        return {key: [saved.get(key), now[key]] for key in TOPOLOGY
                if (key in saved if key == "mesh" else
                    saved.get(key) is not None and now[key] is not None)
                and saved.get(key) != now[key]}

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
        from sharddemo.analysis.entry_resume import restart

        if self.ranks.is_main_process:
            warnings.warn(f"sharddemo.watch: {self.name}: resumed from a checkpoint without the "
                          f"watch's state ({why}): the part of the epoch before the stop is "
                          "unknown; the rest is judged", RuntimeWarning, stacklevel=3)
        self.before, self.again, self.steps_before = None, None, 0
        self.tokens_before = None
        self.unknown_before = True
        self.restarts = [restart(self.epoch, None, None, self.ranks.num_processes)]
        self.loaded_at, self.saved_at = self.moment(), None

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's watch state, loaded: the epoch goes on from its place (the samples
        the open epoch delivered before the stop, its chain of restarts), or, saved after the
        epoch's last step, the next epoch starts. A state that is not this loader's is said
        once and the resume judged without it (resumed_without_state)."""
        from sharddemo.analysis.entry_resume import restart

        problem = self.foreign(state)
        if problem:
            return self.resumed_without_state(f"its watch state is not this loader's: {problem}")
        changed = self.topology_changes(state)
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
        if changed:
            self.restarts[-1]["changed"] = changed
        if before is None and self.n is not None and not self.unknown_before:
            before = np.zeros(self.n, dtype=np.uint8)  # (a restart at the epoch's start)
        self.before, self.again = before, again
        self.steps_before = int(step or 0)
        self.tokens_before = None if state.get("at_edge") else state.get("tokens_before")
        self.loaded_at, self.saved_at = self.moment(), None

    # -- the watch's part of the watched loader's own state (hooks.attach)
    def loader_part(self) -> Optional[bytes]:
        """The watch's part of the watched loader's state_dict(): state_dict() (a collective:
        every rank asks for the loader's state at the same point, as loops that checkpoint
        the loader on every rank do), the same on every rank, as one bytes value. None where
        the watch cannot give it (said once): the loader's own state is saved without it, and
        the training goes on.

        The same on every rank: what the epoch delivered so far and the last epoch's order are
        the main process's alone, and torch.distributed.checkpoint keeps one copy of a value
        every rank saves under the same name (whichever rank's), so every rank's part is the
        main process's (one broadcast), with this rank's own lineage place. One bytes value
        (torch.save of it): DCP flattens a dict into its leaves and loads into the structure
        the fresh loader's state_dict() gives, which differs from a saved one's (no order yet,
        no restarts, no count where the save was after an epoch's last step)."""
        try:
            part = self.state_dict()
            mine = part.get("lineage")
            part = share_from_main(self.ranks, part)
            buffer = io.BytesIO()
            torch.save({**part, "lineage": mine}, buffer)
            return buffer.getvalue()
        except Exception as error:
            self.part_fault("save", error)
            return None

    def load_loader_part(self, part) -> None:
        """The watch's part of a state given to the watched loader's load_state_dict() (None:
        the state holds none, it was saved before the watch was added; bytes: loader_part's;
        a dict: as sharddemo saved it before it packed the part into bytes). A second load at
        the same moment (accelerate's load_state: the watch's file, then its loader's state) is
        the same resume: the first is kept."""
        try:
            if self.loaded_at is not None and self.loaded_at == self.moment():
                return
            if isinstance(part, (bytes, bytearray)):
                part = torch.load(io.BytesIO(part), weights_only=True)
            if part is None:
                self.resumed_without_state("the loader's state holds no part of the watch's "
                                           f"({WATCH_KEY!r}): it was saved before the watch was "
                                           "added")
            else:
                self.load_state_dict(part)
                self.restarts[-1]["loader_state"] = True
                # (a datasets stream's restored state may apply again at a later epoch)
                self.stream_restored = (self.description or {}).get("stream") == "datasets"
                self.say_refused_workers()
            self.loaded_at = self.moment()
        except Exception as error:
            self.part_fault("load", error)

    def say_refused_workers(self) -> None:
        """torchdata's StatefulDataLoader refuses a state saved with another number of
        workers (an AssertionError at the next iter(), torchdata 0.11): said once, at the
        load, where the watch can tell, since no epoch will be reported."""
        change = (self.restarts[-1].get("changed") or {}).get("num_workers")
        classes = (self.description or {}).get("classes") or []
        if change and "StatefulDataLoader" in classes and self.ranks.is_main_process:
            warnings.warn(f"sharddemo.watch: {self.name}: the loader's state was saved with "
                          f"{change[0]} DataLoader workers and is loaded into a loader with "
                          f"{change[1]}: torchdata's StatefulDataLoader refuses another number "
                          "of workers (an AssertionError at the next iter()); keep num_workers, "
                          "or resume without the loader's state", RuntimeWarning, stacklevel=4)

    def part_fault(self, doing: str, error: Exception) -> None:
        """The watch's own fault with its part of the loader's state: said once, training
        goes on (the loader's own state is saved and loaded as without the watch)."""
        if not self.part_faulted:
            self.part_faulted = True
            warnings.warn(f"sharddemo.watch: {self.name}: the watch could not {doing} its part "
                          f"of the loader's state ({type(error).__name__}: {error}); the "
                          "loader's own state is unchanged and training goes on",
                          RuntimeWarning, stacklevel=4)

    def note_restart(self, **facts) -> None:
        """What the framework did at the open epoch's last restart, for its words
        (analysis.entry_line.restart_words): Lightning's `from_start`."""
        if self.restarts:
            self.restarts[-1].update(facts)
