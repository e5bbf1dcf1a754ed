"""The watch's state on one rank: the ranks it exchanges with (an Accelerator, or
torch.distributed alone), the loader's description, its recorder for the open epoch, the epoch
count, the checkpointed state (accelerate's save_state / load_state pre-hooks, the Trainer's and
Lightning's callbacks), and the epoch's end: one exchange, the judgement (analysis.watch), the
line and the report."""

from __future__ import annotations

import datetime
import atexit
import json
import os
import sys
import uuid
import warnings
from typing import Optional, Union

import numpy as np
import torch

from sharddemo.errors import ShardingViolation
from sharddemo.rank.collect import ranks_of
from sharddemo.watching.hooks import Tap

ON_VIOLATION = ("warn", "raise", "ignore")

# The windows' schedule by default (watch's check_every="auto"): the first window ends at step
# FIRST_WINDOW, so that a replicated stream is named within the first 52 steps of a run (the
# window's exchange starts as the next batch arrives and is judged one batch later, WINDOW_LAG);
# each next window is twice as long as the one before, up to LONGEST_WINDOW steps, so that what
# the windows cost shrinks as the epoch goes on (a window costs about as much wherever it comes:
# measured, docs/benchmarks.md, "watch windows"): windows end at steps 50, 150, 350, 750, 1550,
# 3150, then every 1,600; each epoch starts the schedule again. An int check_every is a fixed
# number of steps between two windows.
CHECK_EVERY = "auto"
FIRST_WINDOW = 50
LONGEST_WINDOW = 1600
# A rank keeps its window's ids until the window is judged (each batch's id tensor, then one
# copy of them all): with "auto", a window after the first is shortened so that it holds at most
# WINDOW_KEEP_IDS ids on the rank that receives the most a step (4 MB of int64; read from the
# last window's exchange, where every rank says how many ids its window held, so every rank
# shortens it alike), never below FIRST_WINDOW steps. Batches of 64 never reach it (1,600 steps
# hold 102,400 ids); a stream of 8,192 ids a step has windows of 64 steps.
WINDOW_KEEP_IDS = 1 << 19

# Steps between starting a window's exchange (an all-gather started with async_op) and
# waiting for it to judge the window. Waited for at once, the exchange made the earlier rank
# wait for the later one, most of a window's cost (docs/benchmarks.md); one step of the loop's
# own work later the others have reached it. Every rank waits at the same step (the window's
# step + WINDOW_LAG), so every rank still judges the same exchange at the same step.
WINDOW_LAG = 1
# Batches whose indices (a batch sampler's lists) the watch keeps as they came before
# converting them in one go (WatchState.note_batches): one conversion and one booking for
# these many, instead of one a batch (about 3 us a step less in the MLP loop of
# benchmarks/watch_overhead.py). Every read of the record converts them first.
NOTED_BATCHES = 32

# Ids each rank sends per window at most (the first ones of the window): a fixed width, the same
# on every rank whatever its batches (an all-gather needs equal sizes), 8 KB of int64. Enough to
# see replication (an unsplit loader shares every id) and, looked up in each rank's own counter,
# overlaps with what it received earlier.
WINDOW_IDS = 1024

# The figures ahead of the ids in a rank's window row: done (0 running, 1 at its epoch's end,
# 2 closing), steps so far, its dataset's length (-1: none), how many ids follow, the samples
# it found at the previous window that another rank received in an earlier one, the samples of
# its window it has received more than once so far this epoch, whether its window repeats the
# previous epoch's ids at the same steps (1 yes, 0 no, -1 not compared), whether what
# follows is its error (1: the UTF-8 bytes of a ValueError's message in place of ids), and how
# many ids its window held (all of them, not only those sent: WINDOW_KEEP_IDS); then
# REPEAT_EXAMPLES of its repeated ids.
WINDOW_HEAD = 9
REPEAT_EXAMPLES = 4

# Ids each rank keeps of an epoch's start (its first windows' ids, 32 KB of int64), for the next
# epoch's windows to compare their ids at the same steps with: a loader meant to shuffle that
# deals the previous epoch's order again is named in the next epoch's first window. Only for a
# loader meant to shuffle, with windows on.
ORDER_PREFIX = 4096


RUN: dict = {}


def run_stamp() -> dict:
    """This process's run, in every entry: an id (random, 12 hex digits) and when its first
    watch started (UTC, ISO 8601), so that the lines of two runs appended to one report can be
    told apart. A resumed run is a new launch, with a new id."""
    if not RUN:
        RUN["run_id"] = uuid.uuid4().hex[:12]
        RUN["run_started"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds")
    return dict(RUN)


class MainAlone:
    """The main process on its own, where the ranks can no longer meet (the interpreter's
    exit): what the recorder asks of the ranks, answered without a collective."""

    num_processes = 1
    process_index = 0
    is_main_process = True
    device = torch.device("cpu")


# The watches whose run is not closed yet: at the interpreter's exit the main process writes
# each one's open epoch alone (close_alone), with no collective (the other ranks may be gone).
OPEN: list = []


@atexit.register
def close_open_watches() -> None:
    for state in list(OPEN):
        try:
            if not state.passes and not state.shipped:  # (shipped: said where it was)
                state.say_never_iterated()
            state.close_alone()
        except Exception as error:  # the process is ending: say it, never fail the exit
            import warnings

            warnings.warn(f"sharddemo.watch: the open epoch of {state.name!r} could not be "
                          f"written at exit: {type(error).__name__}: {error}")


class WatchState:
    """One watched loader (and the loaders accelerate makes from it): its recorder, the epoch
    count, the last epoch's record (for the order), and where the report goes."""

    def __init__(self, accelerator, name: str, report: Optional[str], id_field,
                 on_violation: str, role: str = "train",
                 check_every: Union[int, str, None] = CHECK_EVERY) -> None:
        run_stamp()  # the run starts with its first watch
        self.accelerator = accelerator
        self.role = role  # "eval": each sample must be counted once (eval padding fails)
        self.ranks = None  # resolved at the first epoch's end: the process group exists then
        self.name = name
        self.report = report
        self.id_field = id_field
        self.on_violation = on_violation
        self.epoch = 0
        self.recorder = None
        self.previous: Optional[dict] = None
        self.description: Optional[dict] = None
        self.n: Optional[int] = None
        self.mapping = None  # Subset positions -> root ids
        self.batch_size: Optional[int] = None
        self.entries: list[dict] = []
        # the epoch was ended by the framework's epoch-end event (a loop that stops pulling at
        # the epoch's last batch, as the Trainer does), not by the loader's exhaustion
        self.closed = False
        # resumed from a save after an epoch's last step: the first pass may be that epoch's
        # empty rest (see rest_of_saved_epoch)
        self.edge_rest = False
        self.unattributed = 0  # batches of this epoch whose indices were not noted
        # a resumed run: how many ranks received each sample of this epoch before the stop
        # (main process; from the checkpoint, see state_dict)
        self.before: Optional[np.ndarray] = None
        self.loaded = False
        # the open epoch's chain of restarts (analysis.watch.restart), oldest first; the
        # samples an earlier restart of the chain repeated; the main process's steps in the
        # epoch before the last restart; a resume from a checkpoint without the watch's state
        self.restarts: list[dict] = []
        self.again: Optional[np.ndarray] = None
        self.steps_before = 0
        self.unknown_before = False
        # the pass now iterating: its loader's length (None: unsized) and the step it began at,
        # and the loader the description is of
        self.pass_length: Optional[int] = None
        self.pass_first = 0
        self.described = None
        self.lineage = None  # watch(..., lineage=DIR): a watching.lineage.LineageWriter
        self.finished = False  # close() ran (or close_alone): nothing more is reported
        self.passes = 0  # passes begun, of any loader this watch is attached to
        # pickled where no process group is up (Ray's driver shipping the loader to its
        # workers): said once (pickled), and the watch, left behind, sees no pass
        self.shipped = False
        # this rank's error reading id_field, said to every rank at the next exchange
        self.field_error: Optional[str] = None
        self.previous_prefix: Optional[np.ndarray] = None  # (ORDER_PREFIX)
        OPEN.append(self)
        # windows of steps checked within the epoch (check_window): "auto" (growing, see
        # CHECK_EVERY) or a fixed number of steps; 0 or None: none
        self.check_every = check_every or 0
        self.pending: Optional[dict] = None  # a window's exchange started, not yet judged
        self.noted: list = []  # batches' indices not yet in the recorder (note_batches)
        self.new_windows()

    # -- checkpointing (accelerate's save_state / load_state pre-hooks, watching.hooks.checkpoint:
    # accelerate calls them on every rank, and the main process writes its state_dict)
    def state_dict(self) -> dict:
        """The watch's place in the run, reduced across the ranks: the epoch, which samples
        this epoch has delivered so far (a collective, where N is known), and the last
        finished epoch's record (for the order)."""
        from sharddemo.analysis.watch import id_list

        if self.ranks is None:
            self.ranks = ranks_of(self.accelerator)
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
        return {"schema": "sharddemo.watch-state/1", "loader": self.name,
                "dataset_size": self.n, "previous": self.previous,
                "world_size": self.ranks.num_processes,
                "lineage": self.lineage.place() if self.lineage else None, **place}

    def at_edge(self) -> bool:
        """The pass now iterating has delivered every batch of its loader (a save at the
        epoch's last step, inside the loop): the epoch is whole, and a run resumed from here
        goes on with the next epoch."""
        steps = self.open_steps() - self.pass_first
        return bool(self.pass_length) and steps >= self.pass_length

    def foreign(self, state) -> Optional[str]:
        """Why a checkpoint's watch state is not this loader's (None: it is)."""
        if not isinstance(state, dict) or state.get("schema") != "sharddemo.watch-state/1":
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
        from sharddemo.analysis.watch import restart

        if self.ranks is None:
            self.ranks = ranks_of(self.accelerator)
        if self.ranks.is_main_process:
            warnings.warn(f"sharddemo.watch: {self.name}: resumed from a checkpoint without the "
                          f"watch's state ({why}): the part of the epoch before the stop is "
                          "unknown; the rest is judged", RuntimeWarning, stacklevel=3)
        self.before, self.again, self.steps_before = None, None, 0
        self.unknown_before = True
        self.restarts = [restart(self.epoch, None, None, self.ranks.num_processes)]

    def pickled(self) -> None:
        """The watched loader is being pickled for another process (hooks._as_plain): the
        watch does not travel, so the process that unpickles it iterates the plain loader,
        unchecked. Where this process is no rank of a torch.distributed group, the loop runs
        elsewhere (Ray's driver shipping the loader to train_loop_per_worker, a script that
        spawns its ranks): said once, with where watch() must be called. Never raises (it
        runs inside the pickler)."""
        try:
            dist = torch.distributed
            if self.shipped or (dist.is_available() and dist.is_initialized()):
                return
            self.shipped = True
            ray = sys.modules.get("ray")
            if ray is not None and getattr(ray, "is_initialized", lambda: False)():
                where = ("Ray's workers get the plain loader, unwatched, and this watch sees no "
                         "epoch: call watch() inside train_loop_per_worker, on the loader "
                         "ray.train.torch.prepare_data_loader returns (docs/frameworks.md, "
                         "\"sharddemo.watch inside a TorchTrainer worker\")")
            else:
                where = ("the process that unpickles it gets the plain loader, unwatched: call "
                         "watch() in the process whose loop iterates the loader, once its "
                         "process group is up")
            warnings.warn(f"sharddemo.watch: {self.name!r} is being pickled in a process that "
                          f"is no rank of a torch.distributed group, and the watch does not "
                          f"travel with it: {where}", RuntimeWarning, stacklevel=3)
        except Exception:  # (a watch's own fault never stops the user's pickling)
            pass

    def note_restart(self, **facts) -> None:
        """What the framework did at the open epoch's last restart, for its words
        (analysis.watch.restart_words): Lightning's `from_start`."""
        if self.restarts:
            self.restarts[-1].update(facts)

    def start_pass(self, loader) -> None:
        """A pass of `loader` begins: its description (skip_first_batches and prepare make
        new loaders; the next epoch iterates the first one again), its length, and, for the
        first pass after a restart, the batches skip_first_batches skipped on each rank.

        A pass that begins while the epoch is still open, with steps taken, follows one the
        loop left (a `break`: an epoch capped at a number of steps, as a `for epoch` loop with
        a step budget per epoch does): that epoch ends here, on every rank (the loop begins
        its next pass at the same point on every rank, as a prepared loader's own RNG
        synchronisation needs too), as partial unless its pass delivered every batch."""
        self.passes += 1
        if not self.closed and not self.finished and self.open_steps():
            self.end_epoch(self.described, partial=not self.at_edge())
        if self.described is not loader:
            self.describe(loader)
        try:
            self.pass_length = len(loader)
        except TypeError:
            self.pass_length = None
        self.pass_first = self.open_steps()
        skipped = skipped_batches(loader)
        if skipped and self.restarts and not self.pass_first:
            last = self.restarts[-1]
            if last.get("skipped_batches") is None:
                last.update(skipped_batches=skipped, batch_size=self.batch_size)

    def load_state_dict(self, state: dict) -> None:
        from sharddemo.analysis.watch import restart

        problem = self.foreign(state)
        if problem:
            return self.resumed_without_state(f"its watch state is not this loader's: {problem}")
        if self.ranks is None:
            self.ranks = ranks_of(self.accelerator)
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

    def close_epoch(self, loader=None, partial: bool = False) -> None:
        """End the epoch now unless the loader's exhaustion ended it (every rank alike: a
        framework's epoch-end event). `partial`: the loop took only part of the epoch on
        purpose (Lightning's limit_train_batches)."""
        if not self.closed:
            self.end_epoch(loader, partial=partial)

    def flush_lineage(self) -> None:
        """What the loop has received, on disk in the lineage (watch(..., lineage=DIR)) at each
        epoch's end and at close(): a process may end without its exit handlers (Ray Train's
        workers end with os._exit), so the buffer is not left for them. A fault warns."""
        if self.lineage is not None:
            self.lineage.flush()

    def open_steps(self) -> int:
        """Steps of the open epoch on this rank (0: none open)."""
        return self.recorder.steps + len(self.noted) if self.recorder is not None else 0

    def most_open_steps(self) -> int:
        """The most steps any rank has taken in its open epoch: a collective where there are
        several ranks (every rank gets the same answer and takes the same branch)."""
        from sharddemo.rank.collect import exchange_ints

        steps = self.open_steps()
        if self.ranks.num_processes > 1:
            steps = max(row[0] for row in exchange_ints(self.ranks, [steps]))
        return steps

    def close(self) -> Optional[dict]:
        """The end of the run, on every rank at the same point (a collective, like an epoch's
        end): an epoch the loop left open (a `break`, max_steps) is reported as partial, with
        the verdicts a part of an epoch supports. Then the watch is done; a second call does
        nothing. Returns the partial epoch's entry on the main process, else None."""

        self.flush_lineage()
        if self.finished:
            return None
        if self.ranks is None:
            self.ranks = ranks_of(self.accelerator)
        dist = torch.distributed
        if self.ranks.num_processes > 1 and not (dist.is_available() and dist.is_initialized()):
            # the process group is gone (end_training came first): the ranks cannot meet
            return self.close_alone()
        self.finished = True
        if self in OPEN:
            OPEN.remove(self)
        if self.windows_on():
            # the same exchange as a window's, so that a rank still iterating, or at its
            # epoch's end, meets this one: every rank takes the same branch from its heads
            self.finish_window()
            entry = None
            while True:
                heads = self.drain(2)
                ending = any(h["done"] == 1 for h in heads)  # ranks at their epoch's end
                if ending or any(h["steps"] for h in heads):
                    # (every batch of the pass taken, the loader not asked once more: whole)
                    entry = self.end_epoch(partial=not self.at_edge(), drained=True)
                if not ending:  # (else they close next: meet them once more)
                    return entry
        # whether any rank has an epoch open (a rank whose loader ran out has none): every
        # rank takes the same branch
        if not self.most_open_steps():
            return None
        # a loop that took every batch of its pass and stopped before asking for one more (a
        # save at the epoch's last step, then the end): the epoch is whole
        return self.end_epoch(partial=not self.at_edge())

    def say_never_iterated(self) -> None:
        """At the interpreter's exit, for a watch that no pass ever reached: the loop iterated
        another loader (one made from the watched loader where the watch cannot follow), and
        the watch, silent, would look like a run with nothing to report. The main process
        says so once."""
        dist = torch.distributed
        try:
            main = self.accelerator.is_main_process
        except AttributeError:  # no accelerator, or its state reset: torch's rank, or the launcher's
            main = (dist.get_rank() == 0 if dist.is_available() and dist.is_initialized()
                    else os.environ.get("RANK", "0") == "0")
        if main:
            warnings.warn(f"sharddemo.watch: {self.name!r} was watched, but no pass of it reached "
                          "the loop, so nothing was checked: iterate the loader watch() returned, "
                          "or one accelerator.prepare() made from it (docs/watch.md, \"Where to "
                          "call watch()\")", RuntimeWarning, stacklevel=1)

    def close_alone(self) -> Optional[dict]:
        """Where the ranks can no longer meet (the process is ending: the interpreter's exit,
        an exception leaving a `with` block): the main process reports its own part of the
        open epoch, marked "ranks": "main-only", with no collective; the others say nothing."""
        self.flush_lineage()
        if self.finished:
            return None
        self.finished = True
        self.pending = None  # (the ranks can no longer meet: a started exchange is left)
        self.note_batches()
        if self in OPEN:
            OPEN.remove(self)
        if not self.open_steps() or not self.ranks.is_main_process:
            self.recorder = None
            return None
        world = self.ranks.num_processes
        recorder, self.recorder = self.recorder, None
        if world > 1:
            recorder.accelerator = MainAlone()
            recorder.log.slots = None  # (the slots are the ranks' exchange: none here)
        record = recorder.finish(self.epoch)
        entry = self.judge(record, partial=True, ranks=MainAlone() if world > 1 else None)
        if world > 1:
            from sharddemo.analysis.watch import main_only_entry

            entry = main_only_entry(entry, world)
        self.entries.append(entry)
        self.publish(entry)
        return entry

    # -- set-up, once per loader attached
    def describe(self, loader) -> None:
        from sharddemo.rank.describe import (describe_loader, loader_batch_size, root_length,
                                             subset_mapping)

        from sharddemo.rank.describe import base_loader
        from sharddemo.watching.raydata import describe_batches, is_ray_batches

        if is_ray_batches(loader):  # Ray Data's batches: no DataLoader behind them
            self.description, self.batch_size = describe_batches(loader)
            return
        # the loader that runs now (prepare and skip_first_batches make new ones)
        self.described = loader
        self.description = describe_loader(loader)
        # (a skip_first_batches loader's SkipBatchSampler names no batch size: the same)
        self.batch_size = loader_batch_size(loader) or self.batch_size
        dataset = getattr(base_loader(loader), "dataset", None)
        if self.description.get("shuffled") is None and self.description.get("iterable_dataset"):
            # a stream: its own object says whether it is built to shuffle (workers
            # interleaving its shards are no shuffle)
            self.description["shuffled"] = stream_shuffles(dataset)
        if self.n is None:
            self.n = root_length(dataset)
        if self.id_field is None and self.mapping is None:
            self.mapping = subset_mapping(dataset)

    def new_recorder(self):
        from sharddemo.rank.recorder import Recorder

        if self.ranks is None:
            self.ranks = ranks_of(self.accelerator)
        how = "count" if self.n is not None else "epoch"
        # the epoch's end: one all-reduce (the count path, up to 15 ranks), after which every
        # rank holds the record, so that on_violation="raise" needs no collective of its own;
        # from BITS_FROM samples the count path's two bits a sample instead (two_bits)
        whole = not self.two_bits()
        return Recorder(self.ranks, how=how, n=self.n, background=False, keep_present=whole,
                        one_collective=whole, batch=self.batch_size)

    def two_bits(self) -> bool:
        """From BITS_FROM (2^26) samples the watch counts as `audit` does there: two bits a
        sample a rank (rank.counting.BitCounts), not the byte counter's one byte (100 MB a
        rank at 10^8, and several times that at the epoch's end). What it gives up there: the
        epoch's end takes the bitmaps' collectives (a small exchange, a ragged gather, then
        the code reduced a chunk at a time) instead of one all-reduce, and one exchange more
        with on_violation="raise"; the windows check within a window only (no look-up of
        earlier ones); a checkpoint keeps no per-sample state (a resumed epoch is judged from
        the resume on, as a stream without a length is)."""
        from sharddemo.options import BITS_FROM

        return self.n is not None and self.n >= BITS_FROM

    def add(self, batch, tap: Optional[Tap]) -> None:
        if self.recorder is None:
            self.recorder = self.new_recorder()
        steps = self.open_steps()
        if self.pending is not None and steps >= self.pending["due"]:
            self.finish_window()  # the window started WINDOW_LAG batches ago
        if (steps and steps == self.window_due and self.windowed != steps
                and self.ranks.num_processes > 1):
            # a batch after a full window: the window held no rank's last batch (padding and
            # fill come there), so it can be judged; every rank reaches this step alike, and a
            # rank out of data answers from its epoch's end (drain)
            self.windowed = steps
            self.schedule_next(steps)
            self.start_window()
        if self.id_field is not None:
            try:
                ids = read_field(batch, self.id_field) if self.field_error is None else None
            except ValueError as error:
                if self.ranks is None:
                    self.ranks = ranks_of(self.accelerator)
                if self.ranks.num_processes == 1:
                    raise
                # the ranks must learn it together (a rank raising alone leaves the others
                # waiting in the next exchange): said to every rank at the next exchange (a
                # window, the epoch's end, close()), where every rank raises it; until then
                # this rank's batches are counted as steps without ids
                self.field_error = str(error)
                ids = None
            if ids is None:
                ids = torch.empty(0, dtype=torch.int64)
        elif tap.fifo and type(tap.fifo[0]) is list and self.lineage is None:
            # the index sampler's batch, as a list of ints: kept as it is (a copy: a sampler
            # may reuse its list) and converted with the next NOTED_BATCHES in one go
            # (note_batches), a few microseconds less a step than one at a time
            self.noted.append(tap.fifo.popleft().copy())
            if len(self.noted) >= NOTED_BATCHES:
                self.note_batches()
            return
        elif not tap.fifo:
            # no index noted for this batch (a loader that yields batches its sampler did not
            # draw): counted as unattributed, never a failure of the user's loop
            self.unattributed += 1
            if self.lineage:
                self.lineage.append(self.epoch, None)
            return
        else:
            self.note_batches()  # (those kept before this one come first)
            index = tap.fifo.popleft()
            # (numpy then a view: a third of torch.as_tensor's 6 us for a list of 64)
            ids = torch.from_numpy(np.asarray(index if isinstance(index, (list, tuple))
                                              else [index], dtype=np.int64))
            if self.mapping is not None:
                ids = self.mapping[ids]
        if self.lineage:
            self.lineage.append(self.epoch, ids)
        self.recorder.add_ids(ids)
        if self.check_every:
            self.window_ids.append(ids)

    def note_batches(self) -> None:
        """The batches whose indices add() kept as lists, into the recorder (and the window):
        those of one size as one 2-D block (one conversion, one booking), the rest one by one.
        Called before anything reads the recorder or the window (every exchange, a
        checkpoint, the epoch's end), so that they see every batch received so far."""
        if not self.noted:
            return
        noted, self.noted = self.noted, []
        size = len(noted[0])
        if all(len(index) == size for index in noted):
            blocks = [torch.from_numpy(np.array(noted, dtype=np.int64).reshape(len(noted), size))]
        else:
            blocks = [torch.from_numpy(np.asarray(index, dtype=np.int64)).reshape(1, -1)
                      for index in noted]
        for block in blocks:
            if self.mapping is not None:
                block = self.mapping[block]
            self.recorder.add_rows(block)
            if self.check_every:
                self.window_ids.append(block)

    # -- windows of steps within the epoch
    def new_windows(self) -> None:
        """The epoch's window state, empty (at the start of each epoch)."""
        self.window_ids: list = []  # the ids of this window's batches on this rank
        self.window_first = 1  # the window's first step
        self.windowed = 0  # the step count the last window was checked at
        self.found_earlier = 0  # sent at the next window (see WINDOW_HEAD)
        self.window_failed: set = set()  # verdicts a window of this epoch reported already
        self.window_offset = 0  # ids this rank received before the window (this epoch)
        self.prefix: list = []  # the epoch's first ids (ORDER_PREFIX), for the next epoch
        self.prefix_size = 0
        # the length of the next window and the step it ends at (0: no windows); the schedule
        # is a function of the step count alone, so every rank keeps the same one
        self.window_length = FIRST_WINDOW if self.check_every == "auto" else self.check_every
        self.window_due = self.window_length

    def schedule_next(self, steps: int) -> None:
        """A window ends at `steps`: when the next one ends (CHECK_EVERY: "auto" doubles the
        length up to LONGEST_WINDOW; an int is fixed)."""
        if self.check_every == "auto":
            self.window_length = min(2 * self.window_length, LONGEST_WINDOW)
        self.window_due = steps + self.window_length

    def keep_within(self, heads: list[dict], first: int, last: int) -> None:
        """The window of steps `first`..`last` was exchanged: with "auto", the next window
        (already scheduled) is shortened where it would hold more than WINDOW_KEEP_IDS ids on
        the rank that received the most a step in this one (never below FIRST_WINDOW). From
        the exchanged rows alone: every rank judging this exchange makes the same choice, at
        the same step (before the next window's end: FIRST_WINDOW > WINDOW_LAG)."""
        if self.check_every != "auto":
            return
        most = max(-(-int(h["kept"]) // (last - first + 1)) for h in heads)  # ids a step
        if most and self.window_length * most > WINDOW_KEEP_IDS:
            self.window_length = max(FIRST_WINDOW, WINDOW_KEEP_IDS // most)
            self.window_due = last + self.window_length

    def windows_on(self) -> bool:
        if self.ranks is None:
            self.ranks = ranks_of(self.accelerator)
        return bool(self.check_every) and self.ranks.num_processes > 1

    def window_row(self, done: int) -> tuple[torch.Tensor, np.ndarray]:
        """This rank's row of a window's exchange (its figures, then the first WINDOW_IDS ids
        of its window; none from a rank that is done), on the ranks' device, and all the ids
        of its window."""
        self.note_batches()
        steps = self.open_steps()
        mine = np.empty(0, dtype=np.int64)
        if not done and self.window_ids:
            mine = torch.cat([t.reshape(-1) for t in self.window_ids]).to(
                "cpu", torch.int64).numpy()
        repeats, examples, order = 0, [], -1
        if self.field_error is not None:  # its message in place of ids
            sent = np.frombuffer(self.field_error.encode()[:WINDOW_IDS], dtype=np.uint8).astype(
                np.int64)
        else:
            sent = mine[:WINDOW_IDS]
            if not done:  # (a rank at its end holds its last batch: padding, fill)
                repeats, examples = self.window_repeats(mine)
                order = self.window_order(mine)
                self.window_offset += mine.size
        start = WINDOW_HEAD + REPEAT_EXAMPLES
        row = np.full(start + WINDOW_IDS, -1, dtype=np.int64)
        row[:WINDOW_HEAD] = (done, steps, -1 if self.n is None else self.n, sent.size,
                             self.found_earlier, repeats, order, int(self.field_error is not None),
                             mine.size)
        row[WINDOW_HEAD:WINDOW_HEAD + len(examples)] = examples
        row[start:start + sent.size] = sent
        return torch.from_numpy(row).to(self.ranks.device), mine

    def gather_rows(self, row: torch.Tensor, wait: bool = True):
        """ONE collective (an all-gather of one row per rank, the same width on every rank).
        `wait=False`: started in the background (async_op), returns (work, rows): rows holds
        every rank's row once work.wait() returns."""
        from sharddemo.rank.collect import all_gather_flat, collective

        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            # (torch's own all-gather: accelerate's gather of the same row costs several
            # times more on gloo here, about 1 ms against 0.2)
            rows = row.new_empty(self.ranks.num_processes * row.numel())
            work = collective(all_gather_flat(), rows, row, async_op=not wait)
            return rows if wait else (work, rows)
        rows = collective(self.ranks.gather, row)
        return rows if wait else (None, rows)

    def read_rows(self, rows: torch.Tensor, done: int, mine: np.ndarray,
                  recent: Optional[np.ndarray] = None) -> tuple[list[dict], list[np.ndarray]]:
        """Every rank's figures and window ids from the exchanged rows; sets what this rank
        found earlier (said at the next window). `recent`: ids this rank received after the
        window (the exchange was judged WINDOW_LAG batches later): not earlier ones."""
        world = self.ranks.num_processes
        start = WINDOW_HEAD + REPEAT_EXAMPLES
        rows = rows.to("cpu").view(world, start + WINDOW_IDS).numpy()
        heads = [{"done": r[0], "steps": r[1], "n": r[2], "count": r[3], "earlier": r[4],
                  "repeats": r[5], "order": r[6], "error": r[7], "kept": r[8],
                  "examples": r[WINDOW_HEAD:WINDOW_HEAD + min(r[5], REPEAT_EXAMPLES)]}
                 for r in rows[:, :start].tolist()]
        ids = [rows[r, start:start + h["count"]] for r, h in enumerate(heads)]
        self.found_earlier = 0
        if not done and self.recorder is not None:
            # which of the others' window ids this rank received in an earlier window (it
            # holds them, and not in this window): said at the next window, to every rank
            me = self.ranks.process_index
            others = [part for r, part in enumerate(ids)
                      if r != me and len(part) and not heads[r]["error"]]
            if others:
                others = np.sort(np.concatenate(others))
                others = others[np.concatenate(([True], others[1:] != others[:-1]))]
                held = self.recorder.holds(others)
                if held is not None and held.any():  # (a sharded loader: none, no look-up)
                    later = np.isin(others, mine)
                    if recent is not None and recent.size:
                        # (held now, but maybe only from the batches after the window)
                        later |= np.isin(others, recent)
                    self.found_earlier = int(np.count_nonzero(held & ~later))
        return heads, ids

    def window_repeats(self, mine: np.ndarray) -> tuple[int, list[int]]:
        """The samples of this rank's window that it has received more than once so far this
        epoch (its counter, on the host), or, where it keeps none (ids counted on a device, a
        stream with no dataset length), more than once within the window; a few of them."""
        if self.recorder is None or not mine.size:
            return 0, []
        copies = self.recorder.copies(mine)
        if copies is None:
            ordered = np.sort(mine)
            again = ordered[1:][ordered[1:] == ordered[:-1]]
        else:
            again = mine[copies > 1]
        # distinct (a sort: np.unique's first call imports numpy.ma, 80 ms)
        again = np.sort(again)
        again = again[np.concatenate(([True], again[1:] != again[:-1]))] if again.size else again
        return int(again.size), again[:REPEAT_EXAMPLES].tolist()

    def window_order(self, mine: np.ndarray) -> int:
        """Whether this rank's window repeats the previous epoch's ids at the same steps (1),
        differs (0), or cannot be compared (-1: a loader not meant to shuffle, the first epoch,
        steps past the kept prefix). Keeps this epoch's first ORDER_PREFIX ids for the next."""
        if not (self.description or {}).get("shuffled"):
            return -1
        if self.prefix_size < ORDER_PREFIX and mine.size:
            part = mine[:ORDER_PREFIX - self.prefix_size]
            self.prefix.append(part)
            self.prefix_size += part.size
        previous, offset = self.previous_prefix, self.window_offset
        if previous is None or offset >= previous.size or not mine.size:
            return -1
        size = min(mine.size, previous.size - offset)
        return int(np.array_equal(mine[:size], previous[offset:offset + size]))

    def exchange_window(self, done: int) -> tuple[list[dict], list[np.ndarray]]:
        """ONE collective, waited for: every rank's figures and the ids of its window."""
        row, mine = self.window_row(done)
        return self.read_rows(self.gather_rows(row), done, mine)

    def start_window(self) -> None:
        """A running rank's window, at the step after it: its exchange is started in the
        background and judged WINDOW_LAG batches later (finish_window); the next window
        starts empty."""
        row, mine = self.window_row(0)
        work, rows = self.gather_rows(row, wait=False)
        first, last = self.window_first, self.open_steps()
        self.window_ids, self.window_first = [], last + 1
        self.pending = {"work": work, "rows": rows, "row": row, "mine": mine, "first": first,
                        "last": last, "due": last + WINDOW_LAG}

    def finish_window(self) -> None:
        """Wait for the window's exchange started by start_window, if any, and judge it."""
        from sharddemo.rank.collect import collective

        pending, self.pending = self.pending, None
        if pending is None:
            return
        self.note_batches()
        if pending["work"] is not None:
            collective(pending["work"].wait)
        recent = None
        if self.window_ids:  # the batches after the window, received while it was exchanged
            recent = torch.cat([t.reshape(-1) for t in self.window_ids]).to(
                "cpu", torch.int64).numpy()
        heads, ids = self.read_rows(pending["rows"], 0, pending["mine"], recent)
        self.keep_within(heads, pending["first"], pending["last"])
        self.judge_exchange(heads, ids, pending["first"], pending["last"])

    def check_window(self, done: int) -> list[dict]:
        """A window's exchange, waited for, and its judgement (analysis.watch_window), the
        same on every rank: a failing window prints its line at once and is a report entry
        (each failing verdict once an epoch); with on_violation="raise" every rank raises
        here."""
        heads, ids = self.exchange_window(done)
        first, last = self.window_first, self.open_steps()
        if not done:
            self.window_ids, self.window_first = [], last + 1
        self.judge_exchange(heads, ids, first, last)
        return heads

    def judge_exchange(self, heads: list[dict], ids: list, first: int, last: int) -> None:
        """Judge one exchange (the same heads and ids on every rank). Checked at: the step
        after the last any rank took, plus WINDOW_LAG where a rank was still running (its
        exchange was started in the background and waited for that many batches later)."""
        from sharddemo.analysis.watch_window import judge_window

        errors = [r for r, h in enumerate(heads) if h["error"]]
        if errors:  # a rank could not read id_field: every rank raises its message, here
            self.raise_field_error(bytes(ids[errors[0]].tolist()).decode(errors="replace"),
                                   errors)
        lag = WINDOW_LAG if any(not h["done"] for h in heads) else 0
        entry = judge_window(epoch=self.epoch, name=self.name, first=first, last=last,
                             at=max(h["steps"] for h in heads) + 1 + lag, heads=heads, ids=ids,
                             earlier=sum(h["earlier"] for h in heads), n=self.n,
                             loader=self.description, id_field=self.id_field)
        failed = {v["verdict"] for v in entry["verdicts"] if not v["ok"]}
        if failed - self.window_failed:
            self.window_failed |= failed
            self.entries.append(entry)
            if self.ranks.is_main_process:
                self.publish(entry)
            if self.on_violation == "raise":
                self.finished = True  # (every rank raises here: nothing more to close)
                if self in OPEN:
                    OPEN.remove(self)
                raise ShardingViolation(entry["line"], entry)

    def drain(self, done: int) -> list[dict]:
        """This rank is done with the epoch (1: its loader ran out or the epoch ended; 2: the
        run closes): it answers the others' window exchanges until every rank is done, so that
        no rank still iterating is left waiting in a collective. Returns the last heads."""
        while True:
            heads = self.check_window(done)
            if all(h["done"] for h in heads):
                return heads

    def end_epoch(self, loader=None, partial: bool = False,
                  drained: bool = False) -> Optional[dict]:
        """The epoch's end on every rank: one collective (the recorder's), then the verdict on
        the main process, the line and the report; ShardingViolation on every rank where
        asked (each rank judges the record it holds: no second collective). `loader`: the
        loader the epoch came from (what accelerate's gather_for_metrics keeps of its last
        step is read from it). `partial`: the loop stopped before the loader's end (close(),
        limit_train_batches): the entry says so and judges only what a part can show."""
        from sharddemo.rank.collect import exchange_ints

        self.flush_lineage()
        self.note_batches()
        if self.edge_rest:
            self.edge_rest = False
            if self.rest_of_saved_epoch(loader):
                return None
        if self.recorder is None:
            self.recorder = self.new_recorder()
        if self.windows_on() and not drained:
            self.finish_window()  # a window started in the last WINDOW_LAG batches
            self.drain(1)
        elif not self.windows_on() and self.ranks.num_processes > 1:
            self.share_field_error()  # (with windows, their exchanges carry it)
        # this epoch's first ids, for the next epoch's windows (not where it resumed mid-way:
        # its first steps are not the epoch's)
        self.previous_prefix = (np.concatenate(self.prefix) if self.prefix and self.before is None
                                else None)
        self.new_windows()
        raising = self.on_violation == "raise"
        everywhere = self.recorder.delivers_everywhere
        record = self.recorder.finish(self.epoch, loader, everyone=raising and everywhere)
        self.recorder = None
        self.closed = True
        entry = None
        try:  # the watch's own reporting: a failure here never stops the training by itself
            if record is not None:
                entry = self.judge(record, partial=partial)
                if not partial:  # (a part's order is no epoch's order to compare the next with)
                    self.previous = record
                self.entries.append(entry)
            if self.ranks.is_main_process:
                self.publish(entry)
        except Exception as error:
            if raising:
                raise
            warnings.warn(f"sharddemo.watch: epoch {self.epoch} {self.name}: the watch could not "
                          f"report ({type(error).__name__}: {error}); training goes on",
                          RuntimeWarning, stacklevel=2)
        self.epoch += 1
        if not raising:
            return entry if self.ranks.is_main_process else None
        if everywhere:
            ok = entry["ok"]
        else:  # more than 15 ranks: the record is the main process's alone
            ok = exchange_ints(self.ranks, [int(entry["ok"]) if entry is not None else 0])[0][0]
        if not ok:
            raise ShardingViolation(entry["line"] if entry else
                                    f"sharddemo: epoch {self.epoch - 1} {self.name}: a sharding "
                                    "verdict failed (the main process printed it)",
                                    entry or {})
        return entry

    def share_field_error(self) -> None:
        """Windows off: an id_field some rank could not read is said at the epoch's end, where
        every rank raises it (a rank raising alone would leave the others waiting in this
        exchange). One small exchange an epoch; the message only where a rank has one."""
        from sharddemo.rank.collect import exchange_ints, exchange_objects

        flags = [row[0] for row in exchange_ints(self.ranks, [int(self.field_error is not None)])]
        if not any(flags):
            return
        message = next(m for m in exchange_objects(self.ranks, self.field_error) if m)
        self.raise_field_error(message, [r for r, flag in enumerate(flags) if flag])

    def raise_field_error(self, message: str, errors: list[int]) -> None:
        """Every rank, at the same exchange: the watch is done, and the loop gets the error
        of the ranks (`errors`) that could not read id_field."""
        self.finished = True
        if self in OPEN:
            OPEN.remove(self)
        raise ValueError(message + f" (on rank{'s' if len(errors) > 1 else ''} "
                         + ", ".join(map(str, errors)) + ")")

    def rest_of_saved_epoch(self, loader) -> bool:
        """The first pass after a resume from a save after an epoch's last step, where the
        loop went back to that epoch and skip_first_batches skipped the whole of it (an empty
        pass: a loop that resumes at its saved epoch and step): that pass is the saved epoch's
        rest, with nothing left in it. No entry, and the next pass is the next epoch, as the
        checkpoint said. The same answer on every rank (their steps exchanged)."""

        if self.ranks is None:
            self.ranks = ranks_of(self.accelerator)
        if not skipped_batches(loader if loader is not None else self.described):
            return False  # (the same on every rank: the same skip_first_batches call)
        if self.most_open_steps():
            return False
        self.recorder = None
        self.closed = True
        return True

    def publish(self, entry: dict) -> None:
        """The main process's line (none with on_violation="ignore") and report entry, each
        entry stamped with its run (two runs may append to one file)."""
        entry.update(run_stamp())
        if self.on_violation != "ignore":
            say(entry["line"])
        if self.report:
            append_entry(self.report, entry)

    def judge(self, record: dict, partial: bool = False, ranks=None) -> dict:
        """The record -> the report's entry and verdicts (analysis.watch, as `audit`). A
        partial epoch's order is not compared; a resumed one is checked against what came
        before the stop as far as it went (the samples repeated so far; none is called
        skipped: its rest may still come). `ranks`: the main process alone (close_alone):
        its part holds no other rank's, so no resume check."""
        from sharddemo.analysis.watch import judge_epoch
        from sharddemo.rank.session import trace_header

        present = record.pop("_present", None)
        if partial:
            resumed = {}
            if ranks is None:  # (every rank's part: the resume as far as it went)
                resumed = dict(before=self.before, present=present, restarts=self.restarts,
                               again=self.again, unknown_before=self.unknown_before)
            entry = judge_epoch(trace_header(ranks or self.ranks), record, None,
                                epoch=self.epoch, name=self.name, role=self.role,
                                description=self.description, n=self.n,
                                batch_size=self.batch_size, unattributed=self.unattributed,
                                partial=True, id_field=self.id_field, **resumed)
            self.unattributed = 0
            self.forget_resume(present)  # (the epoch ends here)
            return entry
        previous = self.previous
        if previous is not None and len(previous.get("ranks", ())) != self.ranks.num_processes:
            previous = None  # saved on another number of ranks: its order is no comparison
        entry = judge_epoch(trace_header(self.ranks), record, previous, epoch=self.epoch,
                            name=self.name, role=self.role, description=self.description,
                            n=self.n, batch_size=self.batch_size, before=self.before,
                            present=present, loaded=self.loaded,
                            unattributed=self.unattributed, id_field=self.id_field,
                            restarts=self.restarts, again=self.again,
                            unknown_before=self.unknown_before)
        entry.update(run_stamp())  # which run wrote it (two runs may append to one file)
        self.forget_resume(present)
        self.loaded = False
        self.unattributed = 0
        return entry

    def forget_resume(self, present) -> None:
        """The resumed epoch was judged (`present`: its part after the restart, or None where
        it kept none): the next epoch starts with no restart."""
        if present is not None or self.unknown_before:
            self.before, self.again, self.restarts = None, None, []
            self.steps_before, self.unknown_before = 0, False


def skipped_batches(loader) -> int:
    """The batches accelerate's skip_first_batches made `loader` skip on this rank: a
    SkipBatchSampler's (map-style) or a SkipDataLoader's (iterable) skip_batches; 0 else."""
    own = getattr(loader, "skip_batches", 0) or 0
    sampler = getattr(loader, "batch_sampler", None)
    return int(own or getattr(sampler, "skip_batches", 0) or 0)


def stream_shuffles(dataset) -> bool:
    """Whether a stream is built to deal a new order: a datasets IterableDataset after
    .shuffle() (a BufferShuffledExamplesIterable in its chain of example iterables). Anything
    else (a stream of the user's, workers interleaving shards) is not known to shuffle."""
    inner = getattr(dataset, "_ex_iterable", None)
    for _ in range(32):
        if inner is None:
            return False
        if "Shuffled" in type(inner).__name__:
            return True
        inner = getattr(inner, "ex_iterable", None)
    return False


def read_field(batch, field) -> torch.Tensor:
    """The ids of a batch by `id_field`, by the rule `audit --id-field` follows
    (rank.ids.field_values, integer_ids); keys are refused: the watch counts integer ids."""
    from sharddemo.rank.ids import field_values, integer_ids
    from sharddemo.rank.keys import key_values

    label = f"sharddemo.watch: id_field {field!r}"
    values = field_values(batch, field, label, ValueError)
    if not torch.is_tensor(values) and key_values(values) is not None:
        raise ValueError(f"{label} holds keys (str, bytes); the watch counts integer ids "
                         "0..N-1 (audit a keyed loader with `sharddemo audit --id-field`, which "
                         "names samples by key)")
    return integer_ids(values, label, ValueError, keep_device=True)


def say(line: str) -> None:
    print(line, flush=True)


def append_entry(path: str, entry: dict) -> None:
    """One JSON object per line, written with one call (a reader never sees half a line)."""
    data = json.dumps({k: v for k, v in entry.items() if k != "line"}) + "\n"
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(data)
        handle.flush()
