"""Drive any loader on a rank exactly as a training loop does and record the ids it yields.

The public interface, used by `sharddemo run`/`compare` (rank/run.py) and `audit` alike:

    record = walk_epoch(accelerator, loader, read_ids, epoch=0, strategy="auto")

On the main process `record` is the epoch as every rank saw it (plain data, see
sharddemo.record); elsewhere it is None. `EpochWalker` walks one loader epoch after epoch (the
one epoch loop of `run`, `compare`, `audit` and the resume audit). The ids move in one of
three ways, chosen identically on every rank from exchanged loader lengths:

- per batch (the reference's way, and what a training loop does): every step, each rank says
  whether it still has a batch and how long it is, then the batch goes through
  `accelerator.gather` (padded to the longest, trimmed back) and, for prepared loaders,
  through `accelerator.gather_for_metrics` as well. The ranks walk in lockstep until EVERY
  rank is exhausted, so a rank with fewer steps keeps answering with "no batch" instead of
  leaving its peers in a collective it never joins. Where a training loop would hang (one rank
  out of batches while another still steps) this is recorded, not suffered.
- per epoch (large runs): each rank records its ids (rank.recorder.Recorder) and one ragged
  gather brings them over at the end; gloo's per-call cost would otherwise dominate a toy step.
- counted (from 1,000,000 samples): the Recorder keeps one byte per sample (two bits from
  2^26), and one reduce sums the counts (rank.counting).

Recording never changes what the loader yields: `read_ids` only reads a batch.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

from sharddemo.rank.collect import collective, exchange_ints, exchange_objects, gather_ragged
from sharddemo.errors import (LoaderRaised, PeerRaised, RunFailed, UsageError,
                              describe_exception, library_error, library_frame)
from sharddemo.rank.describe import is_prepared, remainder, safe_len
from sharddemo.rank.heartbeat import HEARTBEAT
from sharddemo.rank.ids import ReadIds, read_values, unshift
from sharddemo.rank.recorder import Recorder, epoch_record
from sharddemo.rank.tagging import UNKNOWN_WORKER, known_worker


Progress = Callable[..., None]  # (step, total, samples, scope): see progress_reporter


def choose_gather(accelerator, loader, strategy: str, n: Optional[int] = None) -> str:
    """Choose how to gather an epoch: `batch`, `epoch` or `count`, the same on every rank.

    For `auto` a collective: the lengths are exchanged. auto: counted from COUNT_FROM samples
    on, where every rank knows the same dataset length, however few the steps (a few huge
    batches of a large dataset gathered as they came would put every id on the main process,
    which the count path exists to avoid); else every batch up to PER_BATCH_GATHER_LIMIT steps
    per rank; else once per epoch. `count` without a known length falls back to `epoch`. Callers
    that walk one loader for several epochs choose once, before the first: every strategy
    reports an epoch right (only its cost and how much it lists differ), so a loader whose
    length changes between epochs is still reported right."""
    from sharddemo.options import COUNT_FROM, PER_BATCH_GATHER_LIMIT

    if strategy == "batch" or strategy == "epoch":
        return strategy
    if strategy == "count":
        return "count" if n is not None else "epoch"
    length = safe_len(loader)
    rows = exchange_ints(accelerator, [-1 if length is None else length, -1 if n is None else n])
    if n is not None and n >= COUNT_FROM and all(row[1] == n for row in rows):
        return "count"
    lengths = [row[0] for row in rows]
    if all(k >= 0 for k in lengths) and max(lengths, default=0) <= PER_BATCH_GATHER_LIMIT:
        return "batch"
    return "epoch"


def walk_epoch(accelerator, loader, read_ids: ReadIds, *, epoch: int,
               strategy: str = "auto", progress: Optional[Progress] = None,
               max_steps: Optional[int] = None, n: Optional[int] = None,
               runs: Optional[dict] = None) -> Optional[dict]:
    """Walk one epoch of `loader` on this rank, a collective: every rank calls it together.

    `max_steps`: stop after that many batches on this rank, as a run stopped mid-epoch does (the
    loader is left where it stopped). `n`: the dataset's length where known (ids are 0..n-1),
    which the count path needs. `runs`: one dict for every epoch of a loader (the id path's
    record holds a run of ids that the last epoch held as the same list:
    rank.recorder.list_ids). Returns the epoch record (sharddemo.record) on the main process;
    None elsewhere.

    A loader that raises inside a library (Guarded) ends its rank's epoch there; once every rank
    is done the ranks settle it together (settle): LoaderRaised on every rank where every rank
    raised, else the exception on the ranks that raised and PeerRaised on the others."""
    how = choose_gather(accelerator, loader, strategy, n)
    keys = getattr(read_ids, "keys", None)  # an id field that may hold keys (rank.keys)
    packs = getattr(read_ids, "packs", None)  # packed rows (rank.ids.Packs)
    if packs is not None:
        packs.reset()  # (a sample is never split across two epochs)
    if keys is not None:
        keys.counting = how == "count"  # the count path takes integer ids only
    guarded = Guarded(loader)
    if how == "batch":
        record = _walk_per_batch(accelerator, guarded, read_ids, epoch, progress, max_steps)
        settle(accelerator, guarded, epoch)
    else:
        recorder = Recorder(accelerator, read_ids, how=how, n=n, loader=loader, runs=runs)
        total = safe_len(loader) if progress is not None else None
        batches: Any = guarded
        if max_steps is not None:
            batches = itertools.islice(batches, max_steps)  # takes no batch past max_steps
        beat = HEARTBEAT.stepped
        for batch in batches:
            recorder.add(batch)
            beat(recorder.steps)
            if progress is not None:
                progress(recorder.steps, total, recorder.samples)
        # before the epoch's exchange: all finish or none; the id path's heads go with it
        mine = recorder.heads()
        heads = settle(accelerator, guarded, epoch, also=mine or ())
        record = recorder.finish(epoch, heads=heads if mine is not None else None)
    if keys is not None and how != "count":
        from sharddemo.rank.keys import exchange_tables, name_record

        tables = exchange_tables(accelerator, keys)
        if tables is not None and record is not None:
            record = name_record(record, tables)
    elif keys is not None:
        from sharddemo.rank.keys import exchange_key_events

        # counted by the known keys' index: the ids are already the keys' positions
        events = exchange_key_events(accelerator, keys)
        if events is not None and record is not None:
            record = dict(record, key_slots=events)
    return record


class EpochWalker:
    """The one epoch loop on a rank: walk `loader` epoch after epoch as a training loop does.

    The gather strategy is chosen once, before the first epoch (choose_gather: every
    strategy reports an epoch right, so a loader whose length changes between epochs is still
    reported right). Before each epoch `before_epoch(epoch)` runs where given (set_epoch, as
    the loop calls it). `label`: the progress line's name (None: no progress). An exception of
    the loader's becomes a RunFailed worded by `failure(epoch, exc)`, except one a library
    raised on every rank: that is LoaderRaised on every rank (walk_epoch), the caller's
    finding to report.

    `walk(epoch)` returns the record on the main process (None elsewhere) and keeps it in
    `records`; `walk(epoch, source=..., max_steps=...)` walks another loader over the same data
    for that epoch (accelerator.skip_first_batches) or stops after max_steps batches."""

    def __init__(self, accelerator, loader, read_ids: ReadIds, *, strategy: str = "auto",
                 n: Optional[int] = None, before_epoch: Optional[Callable[[int], None]] = None,
                 label: Optional[str] = None,
                 failure: Optional[Callable[[int, BaseException], str]] = None) -> None:
        from sharddemo.options import PROGRESS_ENV

        self.accelerator, self.loader, self.read_ids = accelerator, loader, read_ids
        self.n = n
        self.before_epoch = before_epoch
        self.label = label
        self.progress_env = PROGRESS_ENV
        self.failure = failure or (lambda epoch, exc: f"epoch {epoch}: "
                                                      f"{describe_exception(exc)}")
        self.how = choose_gather(accelerator, loader, strategy, n)
        self.records: list[dict] = []
        self.runs: dict = {}  # walk_epoch's `runs`

    def walk(self, epoch: int, source: Any = None,
             max_steps: Optional[int] = None) -> Optional[dict]:
        if self.before_epoch is not None:
            self.before_epoch(epoch)
        progress = (progress_reporter(self.accelerator, f"{self.label}:epoch{epoch}",
                                      self.progress_env) if self.label else None)
        HEARTBEAT.at(f"{self.label} epoch {epoch}" if self.label else f"epoch {epoch}")
        try:
            record = walk_epoch(self.accelerator, self.loader if source is None else source,
                                self.read_ids, epoch=epoch, strategy=self.how, n=self.n,
                                progress=progress, max_steps=max_steps, runs=self.runs)
        except (UsageError, RunFailed, LoaderRaised):
            raise
        except Exception as exc:
            raise RunFailed(self.failure(epoch, exc)) from exc
        if record is not None:
            self.records.append(record)
        return record


# A collective that fails inside the loader (accelerate's own broadcasts) is a peer's failure
# (gone, or silent up to the timeout), not the loader's: it goes on up at once, as before, so
# that no rank waits a second timeout in walk.settle and the launcher names the rank that failed.
COLLECTIVE_FRAMES = ("torch.distributed.",)


class Guarded:
    """One pass over `loader`, where a library's exception ends the pass, not the rank.

    The batches as `iter(loader)` gives them, except that an exception a library raises in
    `iter()` or `next()` (errors.library_frame: the innermost frame is an installed library's,
    not torch.distributed's) ends the pass on this rank instead of the rank: `error` then holds
    it and `steps` the batches received before it. Any other exception (the user's dataset,
    sharddemo's own, a failed collective) goes on up at once, as before."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.steps = 0
        self.error: Optional[BaseException] = None
        self.iterator: Any = None

    def __iter__(self) -> "Guarded":
        return self

    def __next__(self):
        if self.error is not None:
            raise StopIteration
        try:
            if self.iterator is None:
                self.iterator = iter(self.loader)
            batch = next(self.iterator)
        except StopIteration:
            raise
        except Exception as exc:
            frame = library_frame(exc)
            if frame is None or frame.startswith(COLLECTIVE_FRAMES):
                raise
            self.error = exc
            raise StopIteration from None
        self.steps += 1
        return batch


def settle(accelerator, guarded: Guarded, epoch: int,
           also: Sequence[int] = ()) -> list[list[int]]:
    """Settle, once every rank's pass has ended, whether a library raised in any loader.

    A collective (one exchange of ints; a second, of each rank's error line, only where one
    raised), so every rank learns it together and none is left waiting. Every rank raised:
    LoaderRaised on every rank, the entries in rank order. Some: the exception again on the
    ranks that raised (the walker words it as any loader error) and PeerRaised on the others:
    the launch ends with every rank stopped, naming the ranks that raised. `also`: ints of the
    caller's own (the same count on every rank) sent in the same exchange; returns every rank's,
    as [rank][k], where no loader raised."""
    raised = guarded.error is not None
    flags = exchange_ints(accelerator, [int(raised), *also])
    if not any(row[0] for row in flags):
        return [row[1:] for row in flags]
    mine = None
    if raised:
        said = library_error(guarded.error, loader_facts(accelerator, guarded.loader))
        mine = {"rank": accelerator.process_index, "epoch": epoch, "step": guarded.steps,
                **(said or {"error": describe_exception(guarded.error), "frame": None})}
    entries = exchange_objects(accelerator, mine)
    if all(entry is not None for entry in entries):
        raise LoaderRaised(entries)
    if raised:
        raise guarded.error
    ranks = ", ".join(str(e["rank"]) for e in entries if e is not None)
    raise PeerRaised(f"epoch {epoch}: stopped because the loader of rank {ranks} raised")


def loader_facts(accelerator, loader) -> dict:
    """Return the numbers a library's error is explained by, read from the loader's objects.

    For errors.ARITHMETIC_CAUSES: the world size, N, the batch size of the loader it wraps
    (accelerate's dispatcher reads batches of it on rank 0), drop_last, whether it is
    accelerate's DataLoaderDispatcher and whether it splits batches."""
    from sharddemo.rank.describe import base_loader, loader_batch_size

    dispatcher = type(loader).__name__ == "DataLoaderDispatcher"
    base = base_loader(loader)
    size = loader_batch_size(loader)  # (the dispatcher's base loader keeps it in its sampler)
    drop = getattr(loader, "_drop_last", None) if dispatcher else None
    return {"world": accelerator.num_processes,
            "dataset_size": safe_len(getattr(base, "dataset", None)),
            "batch_size": size if isinstance(size, int) else None,
            "drop_last": bool(drop if drop is not None else getattr(base, "drop_last", False)),
            "dispatcher": dispatcher,
            "split_batches": bool(getattr(loader, "split_batches", False))}


_END = object()


def _walk_per_batch(accelerator, batches: Guarded, read_ids, epoch: int,
                    progress: Optional[Progress],
                    max_steps: Optional[int] = None) -> Optional[dict]:
    """Walk an epoch the reference's way, for small runs: every batch gathered as it comes.

    Every step each rank says whether it still has a batch and how long it is, then the batch
    goes through `accelerator.gather` (padded to the longest, trimmed back) and, for prepared
    loaders, `accelerator.gather_for_metrics`. The ranks walk in lockstep until EVERY rank is
    exhausted (a rank with fewer steps answers "no batch"), so where a training loop would hang
    this is recorded, not suffered; a rank whose loader raised inside a library (Guarded)
    answers "no batch" too, and walk_epoch settles it after the walk. The record is what the
    gathers returned."""
    loader = batches.loader
    known = known_worker(loader)
    main = accelerator.is_main_process
    world = accelerator.num_processes
    prepared = is_prepared(loader)
    total = safe_len(loader)
    ranks: list[list[list[int]]] = [[] for _ in range(world)]
    workers: list[list[int]] = [[] for _ in range(world)]
    for_metrics: Optional[list[int]] = [] if prepared else None
    iterator = batches  # a rank whose loader raised in a library answers "no batch" from then on
    alive, step, received = True, 0, 0
    while True:
        if max_steps is not None and step >= max_steps:
            alive = False
        batch = next(iterator, _END) if alive else _END
        alive = batch is not _END
        if alive:
            values, worker, shift = read_values(read_ids, batch, known)
            ids = unshift(values, shift)
        else:
            ids, worker = torch.empty(0, dtype=torch.int64), UNKNOWN_WORKER
        heads = exchange_ints(accelerator, [int(alive), ids.numel(), worker])
        has = [h[0] for h in heads]
        if not any(has):
            break
        received += sum(h[1] for h in heads)
        sizes = [h[1] for h in heads]
        parts = gather_ragged(accelerator, ids, sizes)  # accelerator.gather, padded + trimmed
        if main:
            for r in range(world):
                if has[r]:
                    ranks[r].append(parts[r].tolist())
                    workers[r].append(heads[r][2])
        if for_metrics is not None:
            if all(has):
                got = _gather_for_metrics(accelerator, ids, sizes)
                if main:
                    for_metrics.extend(got)
            else:
                # A training loop would hang here: this rank's gather_for_metrics (or its
                # backward's all-reduce) would wait for ranks that have left the loop.
                for_metrics = None
        step += 1
        if alive:
            HEARTBEAT.stepped(step)
        if progress is not None and alive:
            progress(step, total, received, "all")
    remainders = _remainders(accelerator, loader) if prepared else [None] * world
    if not main:
        return None
    return epoch_record(epoch, "batch", ranks, workers, remainders, for_metrics)


def _gather_for_metrics(accelerator, ids: torch.Tensor, sizes: list[int]) -> list[int]:
    """Call accelerate's own gather_for_metrics on this step's batch, as a user would.

    Tensors when every rank's batch has the same shape, objects (`use_gather_object`) when they
    differ, since a tensor gather of unequal shapes aborts on gloo."""
    if max(sizes) == 0:
        return []
    if len(set(sizes)) == 1:
        got = collective(accelerator.gather_for_metrics, ids.to(accelerator.device))
        return got.to("cpu").tolist()
    got = collective(accelerator.gather_for_metrics, ids.tolist(), use_gather_object=True)
    return [int(i) for i in got]


def _remainders(accelerator, loader) -> list[Optional[int]]:
    """Return every rank's `remainder`, a collective.

    accelerate's count of real samples in the last global batch; -1 when it does not know."""
    return [row[0] for row in exchange_ints(accelerator, [remainder(loader)])]


def progress_reporter(accelerator, label: str,
                      env_var: str = "SHARDDEMO_PROGRESS") -> Optional[Progress]:
    """Return the main rank's progress reporter, when the launcher asked for it (`env_var` = 1).

    A line on stdout at most twice a second, `sharddemo-progress LABEL STEP TOTAL SAMPLES
    SCOPE`, turned into one bar there. SAMPLES counts what every rank received so far (SCOPE
    `all`, known where the walk exchanges each batch's size) or what the main rank received
    (`rank0`)."""
    if not accelerator.is_main_process or os.environ.get(env_var) != "1":
        return None
    last = [0.0]

    def report(step: int, total: Optional[int], samples: int = 0, scope: str = "rank0") -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5:
            last[0] = now
            sys.stdout.write(f"sharddemo-progress {label} {step} {total or '?'} {samples} "
                             f"{scope}\n")
            sys.stdout.flush()

    return report
