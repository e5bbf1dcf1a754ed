"""The watch's state on one rank: the ranks it exchanges with (an Accelerator, or
torch.distributed alone), the loader's description, its recorder for the open epoch, the epoch
count, the checkpointed state (accelerate's register_for_checkpointing, the Trainer's and
Lightning's callbacks), and the epoch's end: one exchange, the judgement (analysis.watch), the
line and the report."""

from __future__ import annotations

import datetime
import atexit
import json
import os
import uuid
import warnings
from typing import Optional

import numpy as np
import torch

from sharddemo.errors import ShardingViolation
from sharddemo.rank.collect import ranks_of
from sharddemo.watching.hooks import Tap

ON_VIOLATION = ("warn", "raise", "ignore")

# Steps between two window checks (watch's check_every). 50: a replicated stream is named within
# the first 51 steps of a run (the window is checked as the next batch arrives), and the one
# collective a window costs is spread over 50 steps (measured: docs/benchmarks.md, about 2% of a
# 3-4.5 ms MLP step here with the windows, 0.7% without; mostly the wait in the all-gather).
CHECK_EVERY = 50

# Ids each rank sends per window at most (the first ones of the window): a fixed width, the same
# on every rank whatever its batches (an all-gather needs equal sizes), 8 KB of int64. Enough to
# see replication (an unsplit loader shares every id) and, looked up in each rank's own counter,
# overlaps with what it received earlier.
WINDOW_IDS = 1024

# The figures ahead of the ids in a rank's window row: done (0 running, 1 at its epoch's end,
# 2 closing), steps so far, its dataset's length (-1: none), how many ids follow, and the
# samples it found at the previous window that another rank received in an earlier one.
WINDOW_HEAD = 5


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
                 check_every: Optional[int] = CHECK_EVERY) -> None:
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
        self.unattributed = 0  # batches of this epoch whose indices were not noted
        # a resumed run: how many ranks received each sample of this epoch before the stop
        # (main process; from the checkpoint, see state_dict)
        self.before: Optional[np.ndarray] = None
        self.loaded = False
        self.lineage = None  # watch(..., lineage=DIR): a watching.lineage.LineageWriter
        self.finished = False  # close() ran (or close_alone): nothing more is reported
        OPEN.append(self)
        # windows of steps checked within the epoch (check_window); 0 or None: none
        self.check_every = check_every or 0
        self.new_windows()

    # -- checkpointing (accelerator.register_for_checkpointing: accelerate calls both on every
    # rank, and writes the main process's state_dict)
    def state_dict(self) -> dict:
        """The watch's place in the run, reduced across the ranks: the epoch, which samples
        this epoch has delivered so far (a collective, where N is known), and the last
        finished epoch's record (for the order)."""
        if self.ranks is None:
            self.ranks = ranks_of(self.accelerator)
        before = None
        if self.n is not None:  # (every rank alike: N is the dataset's length)
            if self.recorder is None:
                self.recorder = self.new_recorder()
            before = self.recorder.log.present_so_far(self.ranks)
            if self.before is not None and before is not None:  # resumed, then saved again
                before = np.maximum(before, self.before)
        # (a tensor, not a numpy array: Lightning loads checkpoints with weights_only=True)
        return {"schema": "sharddemo.watch-state/1", "loader": self.name, "epoch": self.epoch,
                "dataset_size": self.n, "previous": self.previous,
                "before": None if before is None else torch.from_numpy(before),
                "lineage": self.lineage.place() if self.lineage else None}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        if self.lineage:  # the steps go on; the restart is recorded
            self.lineage.resume(state.get("lineage"))
        self.previous = state.get("previous")
        self.loaded = self.previous is not None  # the next epoch's order is the checkpoint's
        before = state.get("before")
        if isinstance(before, torch.Tensor):
            before = before.numpy()
        self.before = before if before is not None and int(before.sum()) > 0 else None

    def close_epoch(self, loader=None, partial: bool = False) -> None:
        """End the epoch now unless the loader's exhaustion ended it (every rank alike: a
        framework's epoch-end event). `partial`: the loop took only part of the epoch on
        purpose (Lightning's limit_train_batches)."""
        if not self.closed:
            self.end_epoch(loader, partial=partial)

    def open_steps(self) -> int:
        """Steps of the open epoch on this rank (0: none open)."""
        return self.recorder.steps if self.recorder is not None else 0

    def close(self) -> Optional[dict]:
        """The end of the run, on every rank at the same point (a collective, like an epoch's
        end): an epoch the loop left open (a `break`, max_steps) is reported as partial, with
        the verdicts a part of an epoch supports. Then the watch is done; a second call does
        nothing. Returns the partial epoch's entry on the main process, else None."""
        from sharddemo.rank.collect import exchange_ints

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
            entry = None
            while True:
                heads = self.drain(2)
                ending = any(h["done"] == 1 for h in heads)  # ranks at their epoch's end
                if ending or any(h["steps"] for h in heads):
                    entry = self.end_epoch(partial=True, drained=True)
                if not ending:  # (else they close next: meet them once more)
                    return entry
        steps = self.open_steps()
        # whether any rank has an epoch open (a rank whose loader ran out has none): every
        # rank takes the same branch
        if self.ranks.num_processes > 1:
            steps = max(row[0] for row in exchange_ints(self.ranks, [steps]))
        if not steps:
            return None
        return self.end_epoch(partial=True)

    def close_alone(self) -> Optional[dict]:
        """Where the ranks can no longer meet (the process is ending: the interpreter's exit,
        an exception leaving a `with` block): the main process reports its own part of the
        open epoch, marked "ranks": "main-only", with no collective; the others say nothing."""
        if self.finished:
            return None
        self.finished = True
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
        self.description = describe_loader(loader)
        self.batch_size = loader_batch_size(loader)
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
        # rank holds the record, so that on_violation="raise" needs no collective of its own
        return Recorder(self.ranks, how=how, n=self.n, background=False, keep_present=True,
                        one_collective=True, batch=self.batch_size)

    def add(self, batch, tap: Optional[Tap]) -> None:
        if self.recorder is None:
            self.recorder = self.new_recorder()
        steps = self.recorder.steps
        if (steps and self.check_every and steps % self.check_every == 0
                and self.windowed != steps and self.ranks.num_processes > 1):
            # a batch after a full window: the window held no rank's last batch (padding and
            # fill come there), so it can be judged; every rank reaches this step alike, and a
            # rank out of data answers from its epoch's end (drain)
            self.windowed = steps
            self.check_window(0)
        if self.id_field is not None:
            ids = read_field(batch, self.id_field)
        elif not tap.fifo:
            # no index noted for this batch (a loader that yields batches its sampler did not
            # draw): counted as unattributed, never a failure of the user's loop
            self.unattributed += 1
            if self.lineage:
                self.lineage.append(self.epoch, None)
            return
        else:
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

    # -- windows of steps within the epoch
    def new_windows(self) -> None:
        """The epoch's window state, empty (at the start of each epoch)."""
        self.window_ids: list = []  # the ids of this window's batches on this rank
        self.window_first = 1  # the window's first step
        self.windowed = 0  # the step count the last window was checked at
        self.found_earlier = 0  # sent at the next window (see WINDOW_HEAD)
        self.window_failed: set = set()  # verdicts a window of this epoch reported already

    def windows_on(self) -> bool:
        if self.ranks is None:
            self.ranks = ranks_of(self.accelerator)
        return bool(self.check_every) and self.ranks.num_processes > 1

    def exchange_window(self, done: int) -> tuple[list[dict], list[np.ndarray]]:
        """ONE collective (an all-gather of one row per rank, the same width on every rank):
        every rank's figures and the ids of its window (none from a rank that is done)."""
        from sharddemo.rank.collect import collective

        steps = self.open_steps()
        mine = torch.empty(0, dtype=torch.int64)
        if not done and self.window_ids:
            mine = torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in self.window_ids])
        sent = mine[:WINDOW_IDS]
        row = torch.full((WINDOW_HEAD + WINDOW_IDS,), -1, dtype=torch.int64)
        row[:WINDOW_HEAD] = torch.tensor([done, steps, -1 if self.n is None else self.n,
                                          sent.numel(), self.found_earlier])
        row[WINDOW_HEAD:WINDOW_HEAD + sent.numel()] = sent
        world = self.ranks.num_processes
        row = row.to(self.ranks.device)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            # (torch's own all-gather: accelerate's gather of the same row costs several
            # times more on gloo here, about 1 ms against 0.2)
            rows = row.new_empty(world * row.numel())
            collective(dist.all_gather_into_tensor, rows, row)
        else:
            rows = collective(self.ranks.gather, row)
        rows = rows.to("cpu").view(world, WINDOW_HEAD + WINDOW_IDS)
        heads = [{"done": r[0], "steps": r[1], "n": r[2], "count": r[3], "earlier": r[4]}
                 for r in rows[:, :WINDOW_HEAD].tolist()]
        ids = [rows[r, WINDOW_HEAD:WINDOW_HEAD + h["count"]].numpy() for r, h in
               enumerate(heads)]
        self.found_earlier = 0
        if not done and self.recorder is not None:
            # which of the others' window ids this rank received in an earlier window (it
            # holds them, and not in this window): said at the next window, to every rank
            me = self.ranks.process_index
            others = [part for r, part in enumerate(ids) if r != me and len(part)]
            if others:
                others = np.sort(np.concatenate(others))
                others = others[np.concatenate(([True], others[1:] != others[:-1]))]
                held = self.recorder.holds(others)
                if held is not None:
                    now = np.isin(others, mine.numpy())
                    self.found_earlier = int(np.count_nonzero(held & ~now))
        return heads, ids

    def check_window(self, done: int) -> list[dict]:
        """A window's exchange and its judgement (analysis.watch_window), the same on every
        rank: a failing window prints its line at once and is a report entry (each failing
        verdict once an epoch); with on_violation="raise" every rank raises here."""
        from sharddemo.analysis.watch_window import judge_window

        heads, ids = self.exchange_window(done)
        first, last = self.window_first, self.open_steps()
        if not done:
            self.window_ids, self.window_first = [], last + 1
        entry = judge_window(epoch=self.epoch, name=self.name, first=first, last=last,
                             at=max(h["steps"] for h in heads) + 1, heads=heads, ids=ids,
                             earlier=sum(h["earlier"] for h in heads), n=self.n)
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
        return heads

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

        if self.recorder is None:
            self.recorder = self.new_recorder()
        if self.windows_on() and not drained:
            self.drain(1)
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
        partial epoch is judged alone: no resume check (its rest may still come), and its
        order is not compared."""
        from sharddemo.analysis.watch import judge_epoch
        from sharddemo.rank.session import trace_header

        present = record.pop("_present", None)
        if partial:
            entry = judge_epoch(trace_header(ranks or self.ranks), record, None,
                                epoch=self.epoch, name=self.name, role=self.role,
                                description=self.description, n=self.n,
                                batch_size=self.batch_size, unattributed=self.unattributed,
                                partial=True)
            self.unattributed = 0
            return entry
        entry = judge_epoch(trace_header(self.ranks), record, self.previous, epoch=self.epoch,
                            name=self.name, role=self.role, description=self.description,
                            n=self.n, batch_size=self.batch_size, before=self.before,
                            present=present, loaded=self.loaded,
                            unattributed=self.unattributed)
        entry.update(run_stamp())  # which run wrote it (two runs may append to one file)
        if present is not None:
            self.before = None
        self.loaded = False
        self.unattributed = 0
        return entry


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
