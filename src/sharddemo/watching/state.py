"""The watch's state on one rank: the ranks it exchanges with (an Accelerator, or
torch.distributed alone), the loader's description, its recorder for the open epoch, the epoch
count, the checkpointed state (accelerate's register_for_checkpointing, the Trainer's and
Lightning's callbacks), and the epoch's end: one exchange, the judgement (analysis.watch), the
line and the report."""

from __future__ import annotations

import datetime
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


class WatchState:
    """One watched loader (and the loaders accelerate makes from it): its recorder, the epoch
    count, the last epoch's record (for the order), and where the report goes."""

    def __init__(self, accelerator, name: str, report: Optional[str], id_field,
                 on_violation: str, role: str = "train") -> None:
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

    def close_epoch(self, loader=None) -> None:
        """End the epoch now unless the loader's exhaustion ended it (every rank alike: a
        framework's epoch-end event)."""
        if not self.closed:
            self.end_epoch(loader)

    # -- set-up, once per loader attached
    def describe(self, loader) -> None:
        from sharddemo.rank.describe import (describe_loader, loader_batch_size, root_length,
                                             subset_mapping)

        from sharddemo.rank.describe import base_loader

        # the loader that runs now (prepare and skip_first_batches make new ones)
        self.description = describe_loader(loader)
        self.batch_size = loader_batch_size(loader)
        dataset = getattr(base_loader(loader), "dataset", None)
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

    def end_epoch(self, loader=None) -> Optional[dict]:
        """The epoch's end on every rank: one collective (the recorder's), then the verdict on
        the main process, the line and the report; ShardingViolation on every rank where
        asked (each rank judges the record it holds: no second collective). `loader`: the
        loader the epoch came from (what accelerate's gather_for_metrics keeps of its last
        step is read from it)."""
        from sharddemo.rank.collect import exchange_ints

        if self.recorder is None:
            self.recorder = self.new_recorder()
        raising = self.on_violation == "raise"
        everywhere = self.recorder.delivers_everywhere
        record = self.recorder.finish(self.epoch, loader, everyone=raising and everywhere)
        self.recorder = None
        self.closed = True
        entry = None
        try:  # the watch's own reporting: a failure here never stops the training by itself
            if record is not None:
                entry = self.judge(record)
                self.previous = record
                self.entries.append(entry)
            if self.ranks.is_main_process:
                if self.on_violation != "ignore":
                    say(entry["line"])
                if self.report:
                    append_entry(self.report, entry)
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

    def judge(self, record: dict) -> dict:
        """The record -> the report's entry and verdicts (analysis.watch, as `audit`)."""
        from sharddemo.analysis.watch import judge_epoch
        from sharddemo.rank.session import trace_header

        present = record.pop("_present", None)
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
