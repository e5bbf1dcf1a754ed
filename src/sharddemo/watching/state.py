"""The watch's state on one rank (WatchState): the ranks it exchanges with (an Accelerator, or
torch.distributed alone), the epoch count, the passes of the loader, and the epoch's end: one
exchange, the judgement (analysis.entry), the line and the report; then the run's close, and
the exit handler for a watch the loop left open.

WatchState's other jobs each have a module of their own:
- watching/recording.py (Recording, a part of WatchState): the loader described, each batch's
  ids into the epoch's recorder;
- watching/checkpointing.py (Checkpointing, a part of WatchState): state_dict / load_state_dict,
  for accelerate's save_state / load_state and the Trainer's and Lightning's callbacks;
- watching/step_windows.py (StepWindows, an object the watch holds as `windows`): the windows
  of steps checked within the epoch;
- watching/output.py: the line printed and the entry appended to the report file."""

from __future__ import annotations

import atexit
import os
import sys
import warnings
from typing import Optional, Union

import numpy as np
import torch

from sharddemo.errors import ShardingViolation
from sharddemo.rank.collect import ranks_of
from sharddemo.rank.ids import Packs
from sharddemo.watching.checkpointing import Checkpointing
from sharddemo.watching.output import publish, run_stamp
from sharddemo.watching.recording import Recording
from sharddemo.watching.step_windows import CHECK_EVERY, StepWindows

ON_VIOLATION = ("warn", "raise", "ignore")


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
            state.close_alone("close() was not called before the process's exit")
        except Exception as error:  # the process is ending: say it, never fail the exit
            import warnings

            warnings.warn(f"sharddemo.watch: the open epoch of {state.name!r} could not be "
                          f"written at exit: {type(error).__name__}: {error}")


class WatchState(Checkpointing, Recording):
    """One watched loader (and the loaders accelerate makes from it): its recorder, the epoch
    count, the last epoch's record (for the order), and where the report goes."""

    def __init__(self, accelerator, name: str, report: Optional[str], id_field,
                 on_violation: str, role: str = "train",
                 check_every: Union[int, str, None] = CHECK_EVERY) -> None:
        run_stamp()  # the run starts with its first watch
        self.accelerator = accelerator
        self.role = role  # "eval": each sample must be counted once (eval padding fails)
        self._ranks = None  # (the ranks property: resolved at first use)
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
        # the open epoch's chain of restarts (analysis.entry_resume.restart), oldest first; the
        # samples an earlier restart of the chain repeated; the main process's steps in the
        # epoch before the last restart; a resume from a checkpoint without the watch's state
        self.restarts: list[dict] = []
        self.again: Optional[np.ndarray] = None
        self.steps_before = 0
        self.unknown_before = False
        # the last state_dict() and the moment it was made at, the moment of the last load
        # (watching/checkpointing.py: a save or load asked twice at one point is one), and
        # whether a fault with the watch's part of the loader's state was said
        self.saved_at: Optional[tuple] = None
        self.loaded_at: Optional[tuple] = None
        self.part_faulted = False
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
        # packed rows (several samples a row): this rank's last row and the samples split
        # across two rows this epoch (rank.ids.Packs; docs/watch.md, "Packed rows")
        self.packs = Packs()
        OPEN.append(self)
        self.noted: list = []  # batches' indices not yet in the recorder (note_batches)
        # windows of steps checked within the epoch (watching/step_windows.py)
        self.windows = StepWindows(self, check_every)
        # a device mesh (watching/mesh.py): its layout, this rank's hashes of each step, and
        # whether this rank speaks for its data-parallel group (its first rank)
        self.mesh = None
        self.peer_log = None
        self.speaks = True
        # tokens= / sources= (watching/tokens.py): this rank's sums, the weights, the limit
        self.meter = None
        # a resumed epoch's token parts before the stop (the checkpoint's), by group; None
        # where it holds none (no tokens=, or no restart)
        self.tokens_before: Optional[list] = None
        # an epoch was resumed from the loader's own state over a datasets stream
        self.stream_restored = False
        self.weights: Optional[dict] = None
        self.max_token_skew: Optional[float] = None
        # every rank's dataset length (-1: none), as the last exchange told it (a window's, or
        # the epoch's end's): each rank reads its own, and ranks whose datasets differ in
        # length must agree on one N before the epoch's collectives (agreed_size)
        self.sizes: Optional[list[int]] = None

    def measure(self, tokens, sources, weights, max_token_skew) -> None:
        """Count tokens and sources too (watch's tokens=, sources=, weights=)."""
        from sharddemo.watching.tokens import TokenMeter

        self.meter = TokenMeter(tokens, sources)
        self.weights, self.max_token_skew = weights, max_token_skew

    def token_parts(self, keep: bool = False,
                    gathered: Optional[list[dict]] = None) -> Optional[list]:
        """Each data-parallel group's token and source sums for the epoch (one small
        exchange, every rank alike), None where the watch counts none. A resumed epoch's
        include what came before the stop (tokens_before, from the checkpoint), where the
        groups are as many; `keep`: the sums so far, left counting (a checkpoint's);
        `gathered`: every rank's part from the epoch's last window exchange (no exchange)."""
        from sharddemo.watching.tokens import add_parts, exchange_parts

        if self.meter is None:
            return None
        speakers = self.mesh.representatives() if self.mesh is not None else None
        if gathered is not None and not keep:
            self.meter.reset()  # (its sums went out in that exchange: the epoch is over)
            parts = [gathered[r] for r in speakers] if speakers is not None else gathered
        else:
            parts = exchange_parts(self.ranks, self.meter.take(keep=keep), speakers)
        before = self.tokens_before
        if before is not None and len(before) == len(parts):
            parts = add_parts(before, parts)
        elif self.resumed_midway():
            # resumed mid-epoch, and what came before the stop is not in these sums (a
            # checkpoint without them, or another number of data-parallel groups): said
            parts = [{**p, "after_restart": True} for p in parts]
        return parts

    def on_mesh(self, layout, rank: int) -> None:
        """The run is a device mesh (sharddemo.mesh.MeshLayout): this rank is `rank` in it."""
        from sharddemo.watching.mesh import PeerLog

        self.mesh = layout
        self.peer_log = PeerLog()
        self.speaks = layout.replica_index(rank) == 0

    def data_world(self) -> int:
        """The ranks the counts are over: the data-parallel groups on a mesh, else every rank."""
        return self.mesh.data_size if self.mesh is not None else self.ranks.num_processes

    def compare_peers(self, chains=None):
        """On a mesh of several ranks, the peer check of the epoch so far (one small exchange,
        every rank alike): None where every peer received the same batches, else the first
        difference (sharddemo.mesh.first_peer_difference). None off a mesh."""
        from sharddemo.watching.mesh import peer_exchange

        if self.mesh is None or self.ranks.num_processes == 1:
            return None
        self.note_batches()
        return peer_exchange(self.ranks, self.mesh, self.peer_log, chains)

    @property
    def ranks(self):
        """The ranks the watch exchanges with: the Accelerator, or torch.distributed's where
        there is none. Resolved at first use (a pass's first batch, a checkpoint, the epoch's
        end, close()), so that the process group exists by then."""
        if self._ranks is None:
            self._ranks = ranks_of(self.accelerator)
        return self._ranks

    def retire(self) -> None:
        """The watch is done (close(), close_alone, or every rank raising): nothing more is
        reported, and the exit handler passes it by."""
        self.finished = True
        if self in OPEN:
            OPEN.remove(self)

    # -- the passes of the loader
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

    def at_edge(self) -> bool:
        """The pass now iterating has delivered every batch of its loader (a save at the
        epoch's last step, inside the loop): the epoch is whole, and a run resumed from here
        goes on with the next epoch."""
        steps = self.open_steps() - self.pass_first
        return bool(self.pass_length) and steps >= self.pass_length

    def rest_of_saved_epoch(self, loader) -> bool:
        """The first pass after a resume from a save after an epoch's last step, where the
        loop went back to that epoch and skip_first_batches skipped the whole of it (an empty
        pass: a loop that resumes at its saved epoch and step): that pass is the saved epoch's
        rest, with nothing left in it. No entry, and the next pass is the next epoch, as the
        checkpoint said. So is the first pass of a loader that restored its own state saved
        there (torchdata's StatefulDataLoader: its restored pass is empty). The same answer
        on every rank (their steps exchanged)."""
        restored = bool(self.restarts and self.restarts[-1].get("loader_state"))
        if not restored and not skipped_batches(loader if loader is not None else self.described):
            return False  # (the same on every rank: the same skip_first_batches call, or load)
        if self.most_open_steps():
            return False
        self.recorder = None
        self.closed = True
        return True

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

    # -- the epoch's end: one exchange, the judgement, the line and the report
    def close_epoch(self, loader=None, partial: bool = False) -> None:
        """End the epoch now unless the loader's exhaustion ended it (every rank alike: a
        framework's epoch-end event). `partial`: the loop took only part of the epoch on
        purpose (Lightning's limit_train_batches)."""
        if not self.closed:
            self.end_epoch(loader, partial=partial)

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
        windows = self.windows
        split = [self.packs.split]  # samples split across packed rows, each rank's
        if windows.on() and not drained:
            windows.finish()  # a window started in the last WINDOW_LAG batches
            windows.drain(1)
        elif not windows.on() and self.ranks.num_processes > 1:
            split = self.share_field_error()  # (with windows, their exchanges carry it)
        gathered = None  # (every rank's token part, from the same exchange)
        if windows.on():  # (their last exchange, every rank done: each rank's whole epoch)
            split, gathered = windows.split, windows.parts
        self.packs.reset()
        if self.mesh is not None and len(split) == self.ranks.num_processes:
            split = [split[r] for r in self.mesh.representatives()]  # (a group's once)
        windows.next_epoch(resumed=self.before is not None)
        raising = self.on_violation == "raise"
        size, sizes = self.agreed_size()
        if size is False:  # (every rank alike: from the same exchange)
            return self.uncounted(sizes)
        everywhere = self.recorder.delivers_everywhere
        peers = self.compare_peers()
        measured = self.token_parts(gathered=gathered)
        record = self.recorder.finish(self.epoch, loader, everyone=raising and everywhere,
                                      n=size if sizes else None)
        if self.peer_log is not None:
            self.peer_log.reset()
        if record is not None and self.mesh is not None:
            from sharddemo.mesh import project_record

            record = project_record(record, self.mesh)
        self.recorder = None
        self.closed = True
        entry = None
        try:  # the watch's own reporting: a failure here never stops the training by itself
            if record is not None:
                midway = self.resumed_midway()
                entry = self.judge(record, partial=partial, peers=peers, tokens=measured,
                                   split=sum(split), sizes=sizes, size=size)
                if not partial:
                    # a part's order is no epoch's order to compare the next with, nor is the
                    # order of an epoch resumed mid-way (only the part after its restart)
                    self.previous = None if midway else record
                self.entries.append(entry)
            if self.ranks.is_main_process:
                publish(entry, self.on_violation, self.report)
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

    def judge(self, record: dict, partial: bool = False, ranks=None,
              peers: Optional[dict] = None, tokens: Optional[list] = None,
              split: int = 0, sizes: Optional[list[int]] = None,
              size: Optional[int] = None) -> dict:
        """The record -> the report's entry and verdicts (analysis.entry, as `audit`). A
        partial epoch's order is not compared; a resumed one is checked against what came
        before the stop as far as it went (the samples repeated so far; none is called
        skipped: its rest may still come). `ranks`: the main process alone (close_alone):
        its part holds no other rank's, so no resume check. `split`: the samples split
        across two packed rows (counted once: rank.ids.Packs). `sizes`: every rank's dataset
        length where they differ (agreed_size), and `size` the N the epoch was counted over."""
        from sharddemo.analysis.entry import judge_epoch
        from sharddemo.rank.session import trace_header

        n = size if sizes else self.n
        present = record.pop("_present", None)
        header = trace_header(ranks or self.ranks)
        mesh = None
        if self.mesh is not None and ranks is None:  # (counted over groups, peers checked)
            header["world_size"] = self.mesh.data_size
            mesh = self.mesh.describe()
        if partial:
            resumed = {}
            if ranks is None:  # (every rank's part: the resume as far as it went)
                resumed = dict(before=self.before, present=present, restarts=self.restarts,
                               again=self.again, unknown_before=self.unknown_before)
            entry = judge_epoch(header, record, None,
                                epoch=self.epoch, name=self.name, role=self.role,
                                description=self.description, n=n, sizes=sizes,
                                batch_size=self.batch_size, unattributed=self.unattributed,
                                partial=True, id_field=self.id_field, mesh=mesh, peers=peers,
                                tokens=tokens, weights=self.weights,
                                max_token_skew=self.max_token_skew, split_samples=split,
                                **resumed)
            self.unattributed = 0
            self.forget_resume(present)  # (the epoch ends here)
            return entry
        previous = self.previous
        if previous is not None and len(previous.get("ranks", ())) != self.data_world():
            previous = None  # saved on another number of ranks: its order is no comparison
        if self.resumed_midway():
            previous = None  # (the record holds the order after the restart alone)
        entry = judge_epoch(header, record, previous, epoch=self.epoch,
                            name=self.name, role=self.role, description=self.description,
                            n=n, sizes=sizes, batch_size=self.batch_size, before=self.before,
                            present=present, loaded=self.loaded,
                            unattributed=self.unattributed, id_field=self.id_field,
                            restarts=self.restarts, again=self.again,
                            unknown_before=self.unknown_before, mesh=mesh, peers=peers,
                            tokens=tokens, weights=self.weights,
                            max_token_skew=self.max_token_skew, split_samples=split,
                            stream_restored=self.stream_restored)
        entry.update(run_stamp())  # which run wrote it (two runs may append to one file)
        self.forget_resume(present)
        self.loaded = False
        self.unattributed = 0
        return entry

    def resumed_midway(self) -> bool:
        """Whether the open epoch was resumed after some of its steps: its record holds the
        order of the part after the restart alone (the checkpoint keeps which samples came
        before the stop, not their order), so it is compared with no other epoch's order."""
        return bool(self.unknown_before
                    or (self.before is not None and self.before.any())
                    or (self.again is not None and self.again.any()))

    def forget_resume(self, present) -> None:
        """The resumed epoch was judged (`present`: its part after the restart, or None where
        it kept none): the next epoch starts with no restart."""
        if present is not None or self.unknown_before:
            self.before, self.again, self.restarts = None, None, []
            self.steps_before, self.unknown_before = 0, False
            self.tokens_before = None

    def flush_lineage(self) -> None:
        """What the loop has received, on disk in the lineage (watch(..., lineage=DIR)) at each
        epoch's end and at close(): a process may end without its exit handlers (Ray Train's
        workers end with os._exit), so the buffer is not left for them. A fault warns."""
        if self.lineage is not None:
            self.lineage.flush()

    def share_field_error(self) -> list[int]:
        """Windows off: an id_field some rank could not read is said at the epoch's end, where
        every rank raises it (a rank raising alone would leave the others waiting in this
        exchange). One small exchange an epoch; the message only where a rank has one. The
        same exchange carries each rank's samples split across packed rows this epoch
        (returned, rank by rank) and its dataset's length (sizes)."""
        from sharddemo.rank.collect import exchange_ints, exchange_objects

        rows = exchange_ints(self.ranks, [int(self.field_error is not None), self.packs.split,
                                          -1 if self.n is None else self.n])
        self.sizes = [row[2] for row in rows]  # (each rank's dataset length: agreed_size)
        flags = [row[0] for row in rows]
        if not any(flags):
            return [row[1] for row in rows]
        message = next(m for m in exchange_objects(self.ranks, self.field_error) if m)
        self.raise_field_error(message, [r for r, flag in enumerate(flags) if flag])

    def raise_field_error(self, message: str, errors: list[int]) -> None:
        """Every rank, at the same exchange: the watch is done, and the loop gets the error
        of the ranks (`errors`) that could not read id_field."""
        self.retire()
        raise ValueError(message + f" (on rank{'s' if len(errors) > 1 else ''} "
                         + ", ".join(map(str, errors)) + ")")

    # -- the run's end
    def close(self) -> Optional[dict]:
        """The end of the run, on every rank at the same point (a collective, like an epoch's
        end): an epoch the loop left open (a `break`, max_steps) is reported as partial, with
        the verdicts a part of an epoch supports. Then the watch is done; a second call does
        nothing. Returns the partial epoch's entry on the main process, else None."""
        self.flush_lineage()
        if self.finished:
            return None
        dist = torch.distributed
        if self.ranks.num_processes > 1 and not (dist.is_available() and dist.is_initialized()):
            # the process group is gone (end_training came first): the ranks cannot meet
            return self.close_alone("the process group had ended before close()")
        self.retire()
        if self.windows.on():
            # the same exchange as a window's, so that a rank still iterating, or at its
            # epoch's end, meets this one: every rank takes the same branch from its heads
            self.windows.finish()
            entry = None
            while True:
                heads = self.windows.drain(2)
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

    def close_alone(self, why: str) -> Optional[dict]:
        """Where the ranks can no longer meet (the process is ending: the interpreter's exit,
        an exception leaving a `with` block): the main process reports its own part of the
        open epoch, marked "ranks": "main-only", with no collective; the others say nothing.
        `why`: the words for what left the ranks apart, in the entry's line."""
        self.flush_lineage()
        if self.finished:
            return None
        self.retire()
        self.windows.pending = None  # (the ranks can no longer meet: a started exchange is left)
        self.note_batches()
        if not self.open_steps() or not self.ranks.is_main_process:
            self.recorder = None
            return None
        world = self.ranks.num_processes
        recorder, self.recorder = self.recorder, None
        if world > 1:
            recorder.accelerator = MainAlone()
            recorder.log.slots = None  # (the slots are the ranks' exchange: none here)
        record = recorder.finish(self.epoch)
        entry = self.judge(record, partial=True, ranks=MainAlone() if world > 1 else None,
                           split=self.packs.reset())
        if world > 1:
            from sharddemo.analysis.entry import main_only_entry

            entry = main_only_entry(entry, world, why)
        self.entries.append(entry)
        publish(entry, self.on_violation, self.report)
        return entry

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


def skipped_batches(loader) -> int:
    """The batches accelerate's skip_first_batches made `loader` skip on this rank: a
    SkipBatchSampler's (map-style) or a SkipDataLoader's (iterable) skip_batches; 0 else."""
    own = getattr(loader, "skip_batches", 0) or 0
    sampler = getattr(loader, "batch_sampler", None)
    return int(own or getattr(sampler, "skip_batches", 0) or 0)
