"""`sharddemo.watch` (this module: sharddemo.watcher): check the real training run's sharding, epoch by epoch, as it trains.

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

import collections
import json
import os
from typing import Any, Optional

import numpy as np
import torch

from sharddemo.errors import ShardDemoError

ON_VIOLATION = ("warn", "raise", "ignore")
WATCH_SCHEMA = "sharddemo.watch/1"


class ShardingViolation(ShardDemoError):
    """Raised on every rank, at the same point (the end of the epoch's exchange), when a
    watched epoch fails a verdict and `on_violation="raise"`."""

    def __init__(self, message: str, entry: dict) -> None:
        super().__init__(message)
        self.entry = entry


# -- the ranks, with or without accelerate ----------------------------------------------------

class _TorchRanks:
    """What the recorder asks of an Accelerator, from torch.distributed alone (torchrun, SLURM
    srun) or a single process."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.num_processes = self.dist.get_world_size() if self.dist else 1
        self.process_index = self.dist.get_rank() if self.dist else 0
        self.is_main_process = self.process_index == 0
        backend = self.dist.get_backend() if self.dist else "none"
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if backend == "nccl" else torch.device("cpu"))

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.new_empty((self.num_processes * tensor.numel(),))
        self.dist.all_gather_into_tensor(out, tensor.contiguous())
        return out


def _ranks(accelerator):
    return accelerator if accelerator is not None else _TorchRanks()


# -- noting the indices the loader's own index sampler hands out ------------------------------

class _Tap:
    """The indices a loader's index sampler handed out, oldest first, noted while that loader
    (not another built over the same sampler) is being iterated."""

    def __init__(self) -> None:
        self.fifo: collections.deque = collections.deque()
        self.active = None  # the pass (a token) now iterating the loader; None: no pass
        self.drop = 0  # indices to let pass unnoted: drawn and thrown away (_resume_skip)


class _TapIter:
    """The index sampler's iterator, noting what it yields."""

    def __init__(self, inner, tap: _Tap) -> None:
        self._inner, self._tap = inner, tap

    def __iter__(self):
        return self

    def __next__(self):
        index = next(self._inner)
        tap = self._tap
        if tap.active:
            if tap.drop:
                tap.drop -= 1
            else:
                tap.fifo.append(index)
        return index

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_inner"], name)


class _StatefulTapIter(_TapIter):
    """The same, for an iterator with a state of its own (torchdata's StatefulDataLoader saves
    and restores it): the state passes through. Only such an iterator gets these methods, since
    torchdata asks any iterator that has them for its state."""

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state) -> None:
        self._inner.load_state_dict(state)


def _set_class(obj, cls) -> None:
    """obj.__class__ = cls, also where a class answers __class__ with a property of its own
    (accelerate's DataLoaderShard names the DataLoader it wraps)."""
    object.__dict__["__class__"].__set__(obj, cls)


def _rebuild(cls, state: dict):
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _as_plain(cls, *ours: str):
    """__reduce_ex__ of a watched object: it pickles (accelerate's save_state pickles a
    sampler; a spawned worker, a dataset) as the plain object it was, without the watch."""
    def __reduce_ex__(self, protocol):
        state = {k: v for k, v in self.__dict__.items() if k not in ours}
        return _rebuild, (cls, state)

    return __reduce_ex__


def _tap(sampler) -> _Tap:
    """Give `sampler` (the loader's batch sampler, or its sampler) a tap, keeping its class
    for isinstance and every attribute (set_epoch, batch_size, state_dict) as it was."""
    tap = sampler.__dict__.get("_sharddemo_tap")
    if tap is not None:
        return tap
    cls = type(sampler)

    def __iter__(self):
        inner = iter(cls.__iter__(self))
        kind = _StatefulTapIter if hasattr(inner, "state_dict") else _TapIter
        return kind(inner, self.__dict__["_sharddemo_tap"])

    tapped = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                          "__reduce_ex__": _as_plain(cls, "_sharddemo_tap")})
    tap = _Tap()
    sampler.__dict__["_sharddemo_tap"] = tap
    _set_class(sampler, tapped)
    return tap


# -- the watch ---------------------------------------------------------------------------------

class _Watch:
    """One watched loader (and the loaders accelerate makes from it): its recorder, the epoch
    count, the last epoch's record (for the order), and where the report goes."""

    def __init__(self, accelerator, name: str, report: Optional[str], id_field,
                 on_violation: str, role: str = "train") -> None:
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

    # -- checkpointing (accelerator.register_for_checkpointing: accelerate calls both on every
    # rank, and writes the main process's state_dict)
    def state_dict(self) -> dict:
        """The watch's place in the run, reduced across the ranks: the epoch, which samples
        this epoch has delivered so far (a collective, where N is known), and the last
        finished epoch's record (for the order)."""
        if self.ranks is None:
            self.ranks = _ranks(self.accelerator)
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
                "before": None if before is None else torch.from_numpy(before)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
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
        from sharddemo.rank.describe import base_loader, describe_loader, root_length

        base = base_loader(loader)
        # the loader that runs now (prepare and skip_first_batches make new ones)
        self.description = describe_loader(loader)
        self.batch_size = (getattr(base, "batch_size", None)
                           or getattr(getattr(base, "batch_sampler", None), "batch_size", None))
        dataset = getattr(base, "dataset", None)
        if self.n is None:
            self.n = root_length(dataset)
        if self.id_field is None and self.mapping is None:
            self.mapping = _subset_mapping(dataset)

    def new_recorder(self):
        from sharddemo.rank.recorder import Recorder

        if self.ranks is None:
            self.ranks = _ranks(self.accelerator)
        how = "count" if self.n is not None else "epoch"
        # the epoch's end: one all-reduce (the count path, up to 15 ranks), after which every
        # rank holds the record, so that on_violation="raise" needs no collective of its own
        return Recorder(self.ranks, how=how, n=self.n, background=False, keep_present=True,
                        one_collective=True, batch=self.batch_size)

    def add(self, batch, tap: Optional[_Tap]) -> None:
        if self.recorder is None:
            self.recorder = self.new_recorder()
        if self.id_field is not None:
            ids = _read_field(batch, self.id_field)
        elif not tap.fifo:
            # no index noted for this batch (a loader that yields batches its sampler did not
            # draw): counted as unattributed, never a failure of the user's loop
            self.unattributed += 1
            return
        else:
            index = tap.fifo.popleft()
            # (numpy then a view: a third of torch.as_tensor's 6 us for a list of 64)
            ids = torch.from_numpy(np.asarray(index if isinstance(index, (list, tuple))
                                              else [index], dtype=np.int64))
            if self.mapping is not None:
                ids = self.mapping[ids]
        self.recorder.add_ids(ids)

    def end_epoch(self, loader=None) -> Optional[dict]:
        """The epoch's end on every rank: one collective (the recorder's), then the verdict on
        the main process, the line and the report; ShardingViolation on every rank where
        asked (each rank judges the record it holds: no second collective). `loader`: the
        loader the epoch came from (what accelerate's gather_for_metrics keeps of its last
        step is read from it)."""
        from sharddemo.collect import exchange_ints

        if self.recorder is None:
            self.recorder = self.new_recorder()
        raising = self.on_violation == "raise"
        everywhere = self.recorder.delivers_everywhere
        record = self.recorder.finish(self.epoch, loader, everyone=raising and everywhere)
        self.recorder = None
        self.closed = True
        entry = None
        if record is not None:
            entry = self.judge(record)
            self.previous = record
            self.entries.append(entry)
        if self.ranks.is_main_process:
            _say(entry["line"])
            if self.report:
                _append(self.report, entry)
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
        """The record -> the report's epoch and verdicts (sharddemo.analysis, as `audit`)."""
        from sharddemo.analysis import build_report
        from sharddemo.record import loader_share

        world = self.ranks.num_processes
        n = self.n if self.n is not None else _largest_id(record) + 1
        per_rank = self.batch_size or 1
        records = [r for r in (self.previous, record) if r is not None]
        trace = {"world_size": world, "backend": "gloo", "dataset_size": n,
                 "batch_size": per_rank, "global_batch": per_rank * world,
                 "epochs": len(records), "seed": 0,
                 "options": {"audit": {"expect": "sharded"},
                             "drop_last": bool(self.description.get("drop_last"))},
                 "modes": {"audit": {"description": self.name, "epochs": records,
                                     "loader": self.description, "role": self.role,
                                     "prepared": bool(self.description.get("prepared"))}}}
        present = record.pop("_present", None)
        report = build_report(trace)["modes"]["audit"]
        e = report["epochs"][-1]
        verdicts = [v for v in report["verdicts"] if v["epoch"] == self.epoch]
        resume = None
        if self.before is not None and present is not None:
            resume = _resume_check(self.before, present, self.epoch)
            self.before = None
            # the epoch is what came before the stop and after it: no-missing-samples of the
            # part after the restart alone would count the samples delivered before it
            verdicts = [v for v in verdicts if v["verdict"] != "no-missing-samples"]
            verdicts.append(resume.pop("verdict"))
        if self.loaded:  # the first epoch after a checkpoint was loaded
            self.loaded = False
            for v in verdicts:
                if v["verdict"] == "order-changes-each-epoch" and not v["ok"]:
                    v["detail"] = ("the same shuffled order as the epoch before the checkpoint: "
                                   "the restarted loader counts its epochs from 0 again (call "
                                   "set_epoch with the real epoch, or resume the loader's "
                                   "state: use_stateful_dataloader)")
        failed = [v for v in verdicts if not v["ok"]]
        entry = {
            "schema": WATCH_SCHEMA, "loader": self.name, "epoch": self.epoch,
            "world_size": world, "dataset_size": n,
            "deals": loader_share(self.description, n),
            "seen": e["seen"], "unique": e["unique"],
            "missing": {"count": e["missing_count"], "ids": e["missing"][:100],
                        "reason": e["missing_reason"]},
            "duplicated": {"count": e["duplicate_count"],
                           "ids": [d["id"] for d in e["duplicates"]][:100],
                           "reasons": sorted({d["reason"] for d in e["duplicates"]} - {None})},
            "steps": [r["steps"] for r in e["ranks"]],
            "order_changed": e["order_changed"],
            "verdicts": verdicts, "ok": not failed,
            "reasons": e["reasons"],
        }
        if resume is not None:
            entry["resume"] = resume
            entry["seen"] += resume["seen_before"]
            entry["unique"] = n - resume["skipped"]["count"]
            entry["missing"] = {"count": resume["skipped"]["count"],
                                "ids": resume["skipped"]["ids"], "reason": None}
            entry["line"] = _line(entry, failed)
        if self.unattributed:
            entry["unattributed_batches"] = self.unattributed
        self.unattributed = 0
        entry["line"] = _line(entry, failed)
        return entry


def _resume_check(before: np.ndarray, after: np.ndarray, epoch: int) -> dict:
    """A resumed epoch: the samples delivered both before the stop and after the restart
    (repeated) and in neither (skipped), from how many ranks received each in either part."""
    n = min(len(before), len(after))
    before, after = before[:n], after[:n]
    repeated = np.flatnonzero((before > 0) & (after > 0))
    skipped = np.flatnonzero((before == 0) & (after == 0))
    ok = not len(repeated) and not len(skipped)
    detail = "" if ok else (
        f"{len(repeated)} sample(s) delivered again after the restart and {len(skipped)} never: "
        "the resumed run did not continue where it stopped (no common seed, or the loader's "
        "position not restored; docs/resume.md)")
    return {"seen_before": int(np.count_nonzero(before)),
            "repeated": {"count": int(len(repeated)), "ids": repeated[:100].tolist()},
            "skipped": {"count": int(len(skipped)), "ids": skipped[:100].tolist()},
            "verdict": {"verdict": "resume-exact", "epoch": epoch, "ok": ok, "detail": detail}}


def _subset_mapping(dataset) -> Optional[torch.Tensor]:
    """Positions in a (chain of) torch Subset -> the root dataset's ids; None without one."""
    mapping = None
    while isinstance(dataset, torch.utils.data.Subset):
        level = torch.as_tensor(list(dataset.indices), dtype=torch.int64)
        mapping = level if mapping is None else level[mapping]
        dataset = dataset.dataset
    return mapping


def _read_field(batch, field) -> torch.Tensor:
    if field == ".":
        values = batch
    elif isinstance(batch, dict):
        values = batch[field]
    else:
        values = batch[int(field)]
    if not torch.is_tensor(values):
        from sharddemo.rank.keys import key_values

        if key_values(values) is not None:
            raise ValueError(f"sharddemo.watch: id_field {field!r} holds keys (str, bytes); "
                             "the watch counts integer ids 0..N-1 (audit a keyed loader with "
                             "`sharddemo audit --id-field`, which names samples by key)")
    values = torch.as_tensor(values)
    if values.is_floating_point() or values.dtype is torch.bool:
        raise ValueError(f"sharddemo.watch: id_field {field!r} holds {values.dtype} values; "
                         "it must hold each sample's integer id 0..N-1")
    return values.reshape(-1)


def _largest_id(record: dict) -> int:
    top = -1
    for rank in record["ranks"]:
        for batch in rank.get("batches", ()):
            top = max([top, *batch])
    return top


def _line(entry: dict, failed: list[dict]) -> str:
    n, world, deals = entry["dataset_size"], entry["world_size"], entry["deals"]
    steps = entry["steps"]
    each = (f"{steps[0]} steps each" if len(set(steps)) == 1 else f"steps per rank {steps}")
    once = ("once" if entry["seen"] == entry["unique"] else
            f"{entry['seen'] - entry['unique']} repeated")
    order = {True: "yes", False: "NO", None: "-"}[entry["order_changed"]]
    part = f"{deals} (a part of {n})" if deals < n else f"{n}"
    resumed = entry.get("resume")
    if resumed:
        once = (f"{resumed['seen_before']} before the stop, {resumed['repeated']['count']} "
                f"repeated after the restart, {resumed['skipped']['count']} skipped")
    text = (f"sharddemo: epoch {entry['epoch']} {entry['loader']}: {entry['unique']} of {part} "
            f"samples {once} across {world} rank{'s' if world != 1 else ''}, {each}, order "
            f"changed: {order}")
    if not failed:
        return text + ": ok"
    from sharddemo.analysis.reasons import REASON_LABEL

    details = "; ".join(f"{v['verdict']}: {v['detail']}" for v in failed)
    reasons = [REASON_LABEL.get(r, r) for r in
               [entry["missing"]["reason"], *entry["duplicated"]["reasons"]] if r]
    reasons = [r for r in dict.fromkeys(reasons) if r not in details]  # not said twice
    return text + ": FAIL " + details + (f" ({'; '.join(reasons)})" if reasons else "")


def _say(line: str) -> None:
    print(line, flush=True)


def _append(path: str, entry: dict) -> None:
    """One JSON object per line, written with one call (a reader never sees half a line)."""
    data = json.dumps({k: v for k, v in entry.items() if k != "line"}) + "\n"
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(data)
        handle.flush()


# -- attaching to a loader -----------------------------------------------------------------

def _attach(loader, state: _Watch):
    """Make `loader` (in place, its class kept for isinstance) hand its batches to `state` as
    they reach the loop, and end the epoch when it is exhausted."""
    from sharddemo.rank.describe import base_loader

    if "_sharddemo_watch" in loader.__dict__:
        loader.__dict__["_sharddemo_watch"] = state
        return loader
    state.describe(loader)
    tap = None
    if state.id_field is None:
        base = base_loader(loader)
        if isinstance(getattr(base, "dataset", None), torch.utils.data.IterableDataset):
            raise ValueError("sharddemo.watch: this loader reads an IterableDataset, whose "
                             "samples have no index: pass id_field= (the batch's field that "
                             "holds each sample's id, or '.' for a batch that is the ids)")
        if state.description.get("dispatcher"):
            raise ValueError("sharddemo.watch: this loader dispatches batches (rank 0 reads "
                             "them all and slices them to the ranks), so a rank's own sampler "
                             "does not say what reached it: pass id_field=")
        # the loader's index sampler, as torch's iterator draws from it (_index_sampler)
        tap = _tap(loader.batch_sampler if getattr(loader, "batch_sampler", None) is not None
                   else loader.sampler)
    cls = type(loader)

    def __iter__(self):
        watch_state = self.__dict__["_sharddemo_watch"]
        my_tap = self.__dict__.get("_sharddemo_loader_tap")
        this_pass = object()
        if my_tap is not None:
            my_tap.fifo.clear()
            my_tap.drop = _resume_skip(self)
            my_tap.active = this_pass
        watch_state.closed = False
        try:
            for batch in cls.__iter__(self):
                watch_state.add(batch, my_tap)
                yield batch
        finally:
            # (a pass left unfinished and collected late must not switch off a newer one)
            if my_tap is not None and my_tap.active is this_pass:
                my_tap.active = None
        watch_state.close_epoch(self)

    watched = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                          "__reduce_ex__": _as_plain(cls, "_sharddemo_watch",
                                                                     "_sharddemo_loader_tap")})
    loader.__dict__["_sharddemo_watch"] = state
    loader.__dict__["_sharddemo_loader_tap"] = tap
    _set_class(loader, watched)
    if tap is not None:
        _drop_untapped_iterator(loader)
    return loader


def _stateful_loaders(loader) -> list:
    """The torchdata StatefulDataLoader(s) behind `loader`: itself, or the one accelerate's
    stateful DataLoaderShard wraps (base_dataloader)."""
    found = []
    for candidate in (loader, loader.__dict__.get("base_dataloader")):
        if candidate is not None and "_initial_iter_for_state_dict" in candidate.__dict__:
            found.append(candidate)
    return found


def _drop_untapped_iterator(loader) -> None:
    """A StatefulDataLoader's state_dict() builds its first iterator ahead of time (accelerate
    calls it as it prepares one), and the first pass reuses it: built before the tap, it
    would draw the first epoch's indices unnoted (and, with workers, it has drawn some
    already). Dropped, so that the first pass builds its own through the tap, as every later
    pass does; the state it would have given is the fresh state a new one gives."""
    for base in _stateful_loaders(loader):
        built = base.__dict__.get("_iterator")
        if base.__dict__.get("_initial_iter_for_state_dict") and built is not None:
            if not isinstance(getattr(built, "_sampler_iter", None), _TapIter):
                base.__dict__["_iterator"] = None
                base.__dict__["_initial_iter_for_state_dict"] = False
                if hasattr(built, "_shutdown_workers"):
                    built._shutdown_workers()


def _resume_skip(loader) -> int:
    """How many indices a StatefulDataLoader resuming from a loaded state (torchdata) draws
    from its index sampler and throws away before its first batch: where the sampler has no
    state of its own it is fast-forwarded past what was drawn before the save
    (itertools.islice over `_sampler_iter_yielded`; a sampler, or a sampler's iterator, that
    saved a state is restored from it instead, drawing nothing through the tap), and a loader
    with workers also fetches and drops the batches made since its last snapshot
    (`_steps_since_snapshot`). 0 for a pass that does not resume."""
    for base in _stateful_loaders(loader):
        state = base.__dict__.get("next_iter_state")
        if not state:
            continue
        snapshot = state.get("_snapshot")
        main = snapshot.get("_main_snapshot", {}) if snapshot else state
        sampler = (base.batch_sampler if getattr(base, "batch_sampler", None) is not None
                   else base.sampler)
        restored = ((hasattr(sampler, "state_dict") and hasattr(sampler, "load_state_dict"))
                    or main.get("_index_sampler_state") is not None
                    or main.get("_sampler_iter_state") is not None)
        skip = 0 if restored else int(main.get("_sampler_iter_yielded", 0) or 0)
        return skip + int(state.get("_steps_since_snapshot", 0) or 0)
    return 0


def _follow(accelerator, state: _Watch) -> None:
    """accelerator.prepare and accelerator.skip_first_batches return watched loaders for a
    watched one (instance attributes: this Accelerator only, nothing global)."""
    if accelerator.__dict__.get("_sharddemo_follows"):
        return
    prepare, skip = accelerator.prepare, accelerator.skip_first_batches

    def watched_prepare(*objects, **kwargs):
        out = prepare(*objects, **kwargs)
        results = out if isinstance(out, tuple) else (out,)
        for given, made in zip(objects, results):
            mine = getattr(given, "__dict__", {}).get("_sharddemo_watch")
            if mine is not None and made is not given:
                _attach(made, mine)
        return out

    def watched_skip(loader, num_batches: int = 0):
        made = skip(loader, num_batches)
        mine = getattr(loader, "__dict__", {}).get("_sharddemo_watch")
        if mine is not None and made is not loader:
            _attach(made, mine)
        return made

    accelerator.prepare = watched_prepare
    accelerator.skip_first_batches = watched_skip
    accelerator.__dict__["_sharddemo_follows"] = True


def _checkpoint(accelerator, state: _Watch) -> None:
    """Save and load the watch with accelerate's own checkpoint (save_state / load_state)."""
    accelerator.register_for_checkpointing(state)


def watch(loader, accelerator=None, *, name: str = "train",
          report: Optional[str] = "sharddemo-watch.jsonl", id_field: Any = None,
          on_violation: str = "warn"):
    """Watch `loader` in your own training loop; returns the same loader object.

    `accelerator`: your Accelerator (its collectives carry the exchange, and a loader it
    prepares or skips from this one stays watched); None under torch.distributed alone or in
    one process. `name`: the loader's name in the line and the report. `report`: the JSON-lines
    file the main process appends one object to per epoch (None: no file). `id_field`: the
    batch's field (dict key, tuple position, or "." for a batch that is the ids) holding each
    sample's id; default: the indices the loader's own sampler hands out (map-style datasets).
    `on_violation`: "warn" (the line says FAIL), "raise" (ShardingViolation on every rank at
    the epoch's end) or "ignore" (the report only)."""
    if on_violation not in ON_VIOLATION:
        raise ValueError(f"sharddemo.watch: on_violation must be one of "
                         f"{', '.join(ON_VIOLATION)}, got {on_violation!r}")
    if not hasattr(loader, "__iter__"):
        raise TypeError(f"sharddemo.watch: expected a DataLoader, got {type(loader).__name__}")
    return _watch(loader, accelerator, name=name, report=report, id_field=id_field,
                  on_violation=on_violation)


def _watch(loader, accelerator=None, *, name: str, report: Optional[str], id_field: Any = None,
           on_violation: str = "warn", role: str = "train", start_epoch: int = 0):
    """watch(), for the framework callbacks too: `role` "eval" adds the eval verdict
    (eval-counts-each-sample-once); `start_epoch` numbers the first epoch (a resumed run)."""
    if getattr(loader, "__dict__", {}).get("_sharddemo_watch") is not None:
        return loader  # watched already (a callback called twice)
    state = _Watch(accelerator, name, report, id_field, on_violation, role)
    state.epoch = start_epoch
    _attach(loader, state)
    if accelerator is not None:
        _follow(accelerator, state)
        if hasattr(accelerator, "register_for_checkpointing"):
            _checkpoint(accelerator, state)
    return loader


__all__ = ["ShardingViolation", "watch"]
