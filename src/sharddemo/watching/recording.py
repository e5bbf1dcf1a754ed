"""What the watch records of each batch on one rank: the loader described once per loader
attached (its dataset's length, batch size, whether it is meant to shuffle), each batch's
ids (read by id_field, or the indices its sampler's tap noted) into the epoch's recorder,
the open window (watching/step_windows.py) and the lineage; the N every rank counts the epoch
over where the ranks' datasets differ in length (agreed_size).

Recording is a part of WatchState (watching/state.py), kept here: its methods read and set
the watch's own attributes (recorder, n, batch_size, description, mapping, noted,
unattributed, field_error, windows, lineage)."""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch

from sharddemo.watching.hooks import Tap

# Batches whose indices (a batch sampler's lists) the watch keeps as they came before
# converting them in one go (WatchState.note_batches): one conversion and one booking for
# these many, instead of one a batch (cheaper a step: docs/benchmarks.md, "Figures behind
# design choices"). Every read of the record converts them first.
NOTED_BATCHES = 32
# What a rank that does not speak for its data-parallel group counts of each step (a mesh's
# replica peers: watching/mesh.py): a step, no ids
NO_IDS = torch.empty(0, dtype=torch.int64)


class Recording:
    """The per-batch part of WatchState: describe the loader, open the epoch's recorder, and
    take each batch's ids (add, note_batches)."""

    def describe(self, loader) -> None:
        """What `loader` is made of (the loader that runs now: prepare and skip_first_batches
        make new ones), its batch size, its dataset's length and a Subset's mapping to the
        root dataset's ids."""
        from sharddemo.rank.describe import (base_loader, describe_loader, loader_batch_size,
                                             root_length, subset_mapping)
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
        library = type(dataset).__module__.split(".")[0]
        if self.description.get("iterable_dataset") and library in ("datasets", "litdata"):
            # a stream whose own state a loader's state restores: a datasets stream (a
            # map-style datasets.Dataset is dealt by the loader's sampler: not tagged), or
            # litdata's, which splits by rank itself and whose StreamingDataLoader keeps its
            # position (docs/resume.md, "litdata")
            self.description["stream"] = library
        if library == "litdata":
            self.say_litdata_ranks(dataset)
        if self.n is None:
            self.n = root_length(dataset)
        if self.id_field is None and self.mapping is None:
            self.mapping = subset_mapping(dataset)

    def say_litdata_ranks(self, dataset) -> None:
        """Say once, from this rank, where litdata's dataset reads itself as another rank.

        litdata splits by rank itself and reads the ranks when the dataset is built: from the
        process group, else from the environment (WORLD_SIZE, GLOBAL_RANK). Built before
        init_process_group under torchrun (which sets WORLD_SIZE and RANK, not GLOBAL_RANK),
        every rank reads itself as rank 0 and receives rank 0's share (measured: docs/watch.md,
        "litdata"). The watch's verdicts show the replication at the epoch's end; only this rank
        knows why, so it says so now, as a per-rank line."""
        import torch.distributed as dist

        if getattr(self, "litdata_said", False) or not (dist.is_available()
                                                        and dist.is_initialized()):
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        for part in [dataset, *(getattr(dataset, "_datasets", None) or [])]:
            env = getattr(part, "distributed_env", None)
            read = (getattr(env, "global_rank", None), getattr(env, "world_size", None))
            if None in read or read == (rank, world):
                continue
            self.litdata_said = True
            warnings.warn(f"[rank {rank}/{world}] sharddemo.watch: {self.name}: litdata's "
                          f"{type(part).__name__} on this rank reads itself as rank {read[0]} "
                          f"of {read[1]} (it reads the ranks when it is built): it deals that "
                          "rank's share here; build it after init_process_group (or set "
                          "GLOBAL_RANK and WORLD_SIZE)", RuntimeWarning, stacklevel=4)
            return

    def new_recorder(self):
        """The open epoch's recorder (rank.recorder.Recorder, as `audit`'s), on the watch's
        ranks."""
        from sharddemo.rank.recorder import Recorder

        how = "count" if self.n is not None else "epoch"
        # the epoch's end: one all-reduce (the count path, up to 15 ranks), after which every
        # rank holds the record, so that on_violation="raise" needs no collective of its own;
        # from BITS_FROM samples the count path's two bits a sample instead (two_bits)
        whole = not self.two_bits()
        # (the slots of that all-reduce must be as wide on every rank: sized from this rank's
        # batch size they would not be where the ranks' batch sizes differ, a fault the watch
        # is there to name, not to crash on: gloo aborts on collectives of unequal sizes. Sized
        # for 64 ids a batch on every rank, a larger batch costs one more gather an epoch)
        return Recorder(self.ranks, how=how, n=self.n, background=False, keep_present=whole,
                        one_collective=whole)

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

    def agreed_size(self) -> tuple:
        """The N the epoch is counted over on every rank, from every rank's dataset length
        as the epoch's exchange told it (sizes): (self.n, None) where the ranks agree; (the
        smallest, sizes) where every rank has a length below BITS_FROM (each rank's byte
        counter, sized from its own, is cut to it before the epoch's collectives: gloo aborts
        on collectives of unequal sizes); (False, sizes) where no one N can be counted alike
        (a rank without a length, or one counting two bits a sample: their epoch's ends take
        other collectives). The same answer on every rank."""
        from sharddemo.options import BITS_FROM

        sizes = self.sizes
        if not sizes or len(set(sizes)) == 1:
            return self.n, None
        if min(sizes) >= 0 and max(sizes) < BITS_FROM:
            return min(sizes), sizes
        return False, sizes

    def uncounted(self, sizes: list[int]) -> None:
        """An epoch no one N counts alike on every rank (agreed_size): no collective of the
        recorder's (they would differ by rank), no entry; said once an epoch by the main
        process, and raised on every rank with on_violation="raise"."""
        self.recorder = None
        self.closed = True
        said = ", ".join(f"rank {r} has {'no length' if size < 0 else f'{size:,}'}"
                         for r, size in enumerate(sizes))
        message = (f"sharddemo: epoch {self.epoch} {self.name}: FAIL ranks-agree-on-dataset: "
                   f"the ranks' datasets differ in length: {said}; the epoch was not counted "
                   "(pass watch(..., dataset_size=N) to count it)")
        self.epoch += 1
        if self.on_violation == "raise":
            self.retire()
            from sharddemo.errors import ShardingViolation

            raise ShardingViolation(message, {})
        if self.ranks.is_main_process and self.on_violation != "ignore":
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return None

    def add(self, batch, tap: Optional[Tap]) -> None:
        """One batch the loop received: its ids (by id_field, or the indices the sampler's
        tap noted for it) into the recorder, the window and the lineage.

        The common batch (its sampler's list of indices noted, no lineage, off a mesh, and
        with tokens= or sources= its fields tensors read at once: TokenMeter.direct) is taken
        here in one function, with no call into another but at a window's step and every
        NOTED_BATCHES batches: on the caches a training step has emptied, each Python call a
        batch costs about a microsecond, and the calls add() made for it (open_steps, the
        recorder's steps, the windows' at_batch, the meter's add) were a quarter of the
        watch's time a step (docs/benchmarks.md, "Figures behind design choices"). What it
        does is add_any()'s for such a batch, in the same order."""
        recorder, noted = self.recorder, self.noted
        if (recorder is not None and tap is not None and self.lineage is None
                and self.peer_log is None and self.field_error is None):
            fifo = tap.fifo
            if fifo and type(fifo[0]) is list:
                # (TokenMeter.add's direct path, inline: a change to one goes to the other;
                # off a mesh every rank speaks)
                meter = self.meter
                values = None
                if meter is not None:
                    if type(batch) is not meter.direct:
                        return self.add_any(batch, tap)
                    try:
                        values = meter.get(batch)
                    except (KeyError, IndexError, TypeError):
                        return self.add_any(batch, tap)
                    for value in values:
                        if type(value) is not torch.Tensor:
                            return self.add_any(batch, tap)
                # (open_steps, from the recorder's log's own count; at_batch acts only at
                # these steps)
                steps = recorder.log.steps + len(noted)
                windows = self.windows
                started = windows.pending
                if steps == windows.due or started is not None and steps >= started["due"]:
                    windows.at_batch(steps)
                    noted = self.noted  # (a window's row took those kept: a new list)
                if values is not None:
                    kept = meter.pending  # (read after at_batch: a window's settle empties it)
                    kept.append(values)
                    if len(kept) >= meter.settle_at:
                        meter.settle()
                noted.append(fifo.popleft().copy())
                if len(noted) >= NOTED_BATCHES:
                    self.note_batches()
                return
        self.add_any(batch, tap)

    def add_any(self, batch, tap: Optional[Tap]) -> None:
        """add() for any batch."""
        if self.recorder is None:
            self.recorder = self.new_recorder()
        windows = self.windows
        windows.at_batch(self.open_steps())  # (a window's exchange started or judged)
        field = None  # the batch's token field, for the lineage
        if self.meter is not None and self.field_error is None:
            try:  # (tokens= / sources=: summed where they are, no host sync)
                if self.speaks:
                    field = self.meter.add(batch)
                elif self.lineage:  # (a mesh's peer counts none, but its lineage has them)
                    field = self.meter.token_field(batch)
            except ValueError as error:
                if self.ranks.num_processes == 1:
                    raise
                self.field_error = str(error)  # (said to every rank at the next exchange)
        if self.id_field is not None:
            try:
                ids = (read_field(batch, self.id_field, self.packs)
                       if self.field_error is None else None)
            except ValueError as error:
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
                self.lineage.append(self.epoch, None, field)
            if self.peer_log is not None:
                self.peer_log.add(NO_IDS)
            return
        else:
            self.note_batches()  # (those kept before this one come first)
            index = tap.fifo.popleft()
            # (numpy then a view: cheaper than torch.as_tensor; docs/benchmarks.md)
            ids = torch.from_numpy(np.asarray(index if isinstance(index, (list, tuple))
                                              else [index], dtype=np.int64))
            if self.mapping is not None:
                ids = self.mapping[ids]
        if self.lineage:
            self.lineage.append(self.epoch, ids, field)
        self.book(ids, rows=False)

    def book(self, ids: torch.Tensor, rows: bool, host: Optional[np.ndarray] = None) -> None:
        """One batch's ids (or, `rows`, a 2-D block of batches of one size) into the recorder
        and the window (`host`: the same ids as a numpy array, where they were made on the
        host: the window keeps it, and reads it with no call into torch). On a mesh every
        rank hashes them for the peer check, and only its group's first rank counts them: the
        others book steps with no ids."""
        if self.peer_log is not None:
            self.peer_log.add(ids)
            if not self.speaks:
                for _ in range(ids.shape[0] if rows else 1):
                    self.recorder.add_ids(NO_IDS)
                return
        if rows:
            self.recorder.add_rows(ids)
        else:
            self.recorder.add_ids(ids)
        if self.windows.check_every:
            self.windows.ids.append(ids if host is None else host)

    def note_batches(self) -> None:
        """The batches whose indices add() kept as lists, into the recorder (and the window):
        those of one size as one 2-D block (one conversion, one booking), the rest one by one.
        Called before anything reads the recorder or the window (every exchange, a
        checkpoint, the epoch's end), so that they see every batch received so far."""
        if not self.noted:
            return
        noted, self.noted = self.noted, []
        try:  # (lists of several lengths: numpy refuses them, no check a batch first)
            joined = np.array(noted, dtype=np.int64)
        except ValueError:
            joined = None
        if joined is not None:
            arrays = [joined.reshape(len(noted), len(noted[0]))]
        else:
            arrays = [np.asarray(index, dtype=np.int64).reshape(1, -1) for index in noted]
        for array in arrays:
            block = torch.from_numpy(array)
            if self.mapping is not None:  # (a Subset's positions: the root's ids, as tensors)
                self.book(self.mapping[block], rows=True)
            else:
                self.book(block, rows=True, host=array)


def stream_shuffles(dataset) -> bool:
    """Whether a stream is built to deal a new order: a datasets IterableDataset after
    .shuffle() (a BufferShuffledExamplesIterable in its chain of example iterables), a litdata
    StreamingDataset(shuffle=True) (a new chunk and item order each epoch). Anything
    else (a stream of the user's, workers interleaving shards) is not known to shuffle."""
    from sharddemo.rank.streams import is_litdata

    if is_litdata(dataset):
        return getattr(dataset, "shuffle", None) is True  # (StreamingDataset(shuffle=...))
    inner = getattr(dataset, "_ex_iterable", None)
    for _ in range(32):
        if inner is None:
            return False
        if "Shuffled" in type(inner).__name__:
            return True
        inner = getattr(inner, "ex_iterable", None)
    return False


def read_field(batch, field, packs=None) -> torch.Tensor:
    """The ids of a batch by `id_field`, by the rule `audit --id-field` follows
    (rank.ids.field_values, packed_ids, integer_ids); keys are refused: the watch counts
    integer ids. Packed rows (several samples a row) give their samples' ids, a sample split
    across consecutive rows once: `packs` (rank.ids.Packs) carries the rank's last row from
    one batch to the next and counts the samples split."""
    from sharddemo.rank.ids import field_values, integer_ids, packed_ids
    from sharddemo.rank.keys import key_values

    label = f"sharddemo.watch: id_field {field!r}"
    values = field_values(batch, field, label, ValueError)
    if not torch.is_tensor(values) and key_values(values) is not None:
        raise ValueError(f"{label} holds keys (str, bytes); the watch counts integer ids "
                         "0..N-1 (audit a keyed loader with `sharddemo audit --id-field`, which "
                         "names samples by key)")
    packed = packed_ids(values, label, ValueError, packs, keys=False)
    if packed is not None:  # (read on the CPU: a B x W copy, for the padding and the splits)
        return packed
    return integer_ids(values, label, ValueError, keep_device=True, keys=False)
