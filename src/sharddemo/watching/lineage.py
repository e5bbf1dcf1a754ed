"""The watch's lineage writer (`watch(..., lineage=DIR)`): each rank's ids, batch by batch.

Each rank appends the ids of every batch its loop receives to its own file, DIR/rank{r}.lineage,
in the format of sharddemo.lineage_format (read by sharddemo.lineage, torch-free). No collective: every rank writes its
own file; rank 0 writes the run file.

A step never waits for a device: the batch's ids (a tensor, on a GPU perhaps) are kept as they
are, and every FLUSH_BATCHES batches or FLUSH_IDS ids they are joined on their device, copied to
the host once, encoded and appended with one write. The buffer is also written at each epoch's
end and at the watch's close() (state.py calls flush(): a process that ends with os._exit, as
Ray Train's workers do, runs no exit handler), at an epoch's change, when the watch's state is
saved for a checkpoint, and at the process's exit. What was written stays readable after a
crash; a chunk cut short is skipped by the reader, and cut off by the writer before a resumed
run appends.

The lineage is the watch's own output: a fault in writing it (the folder removed, a full disk)
is one RuntimeWarning on the rank it happens on, after which that rank writes no more of it; the
training goes on. Only a folder that holds another run's lineage is refused (ValueError).
"""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from typing import Optional

import numpy as np
import torch

from sharddemo.lineage import read_run_file, write_run_file
from sharddemo.lineage_format import (BATCH, RESTART, RUN_FILE, UNKNOWN, encode, encode_many,
                                      file_header, rank_file, tokens_file, valid_length)

FLUSH_BATCHES = 256
FLUSH_IDS = 1 << 20  # 8 MB of int64 ids on the device at most


def validate_lineage_folder(lineage) -> None:
    """Check watch()'s `lineage=`: a folder this rank can write its file in.

    Made if missing."""
    if not isinstance(lineage, (str, os.PathLike)):
        raise TypeError("sharddemo.watch: lineage must be a folder path (str) or None, got "
                        f"{type(lineage).__name__}")
    folder = os.fspath(lineage)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"sharddemo.watch: lineage {folder!r} is a file; give a folder (each "
                         "rank writes rank<r>.lineage in it)")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise ValueError(f"sharddemo.watch: lineage {folder!r}: the folder cannot be made "
                         f"({error.strerror or error})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"sharddemo.watch: lineage {folder!r} cannot be written (no write "
                         "permission); give a folder you can write, or lineage=None")


def rank_and_world(accelerator) -> tuple[int, int]:
    if accelerator is not None:
        return int(accelerator.process_index), int(accelerator.num_processes)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


OPEN: "weakref.WeakSet[LineageWriter]" = weakref.WeakSet()


@atexit.register
def flush_all() -> None:
    for writer in list(OPEN):
        writer.flush()  # (a fault warns: never an error at the interpreter's exit)


class LineageWriter:
    """One watched loader's lineage on this rank.

    `append(epoch, ids)` once per batch the loop receives (ids: a tensor, or None for a batch
    whose ids are not known); `place()` and `resume(place)` carry the step count and the run id
    through the watch's checkpoint."""

    def __init__(self, folder: str, state) -> None:
        self.folder = os.fspath(folder)
        self.state = state  # the watch's state: its accelerator, loader name, dataset length
        self.step = 0
        self.run_id: Optional[str] = None
        self.continues: Optional[str] = None  # the run id a resumed launch continues
        self.resumed_at: Optional[int] = None
        self.pending: list = []  # (epoch, step, ids or None)
        self.pending_tokens: list = []  # (step, the batch's token field), with tokens=
        self.pending_ids = 0
        self.path: Optional[str] = None
        self.rank, self.world = 0, 1  # (set at open)
        self.broken = False  # a write failed (warned once): this rank writes no more

    # -- the checkpoint: the steps go on after a resume
    def place(self) -> dict:
        """Where this rank's lineage stands, for a checkpoint: the run and the step. A rank
        other than 0 takes the run's id from the run file rank 0 wrote at its first batch (a
        loader's own state_dict() is saved on every rank, each its own)."""
        self.flush()
        if self.run_id is None and self.path is not None:
            self.run_id = (read_run_file(self.folder) or {}).get("run_id")
        return {"run_id": self.run_id, "step": self.step}

    def resume(self, place: Optional[dict]) -> None:
        if not place or place.get("run_id") is None:
            return
        self.flush()
        self.continues = str(place["run_id"])
        self.step = int(place["step"])
        self.resumed_at = self.step
        if self.path is not None:  # opened already: the restart goes in now
            self.write_restart()

    # -- the steps
    def append(self, epoch: int, ids: Optional[torch.Tensor],
               tokens: Optional[torch.Tensor] = None) -> None:
        """One batch the loop received: its ids (None: not known) and, with watch's tokens=,
        its token field (its tokens go in rank<r>.tokens beside the ids)."""
        if self.path is None and not self.broken:
            self.open()
        if self.broken:  # (the steps are still counted: a checkpoint carries the count)
            self.step += 1
            return
        if self.pending and self.pending[-1][0] != epoch:
            self.flush()  # (an epoch's end: its last steps on disk)
        if ids is not None:
            if ids.dim() != 1:
                ids = ids.reshape(-1)  # (a view: no copy, no sync)
            self.pending_ids += ids.numel()
        self.pending.append((epoch, self.step, ids))
        if tokens is not None:
            self.pending_tokens.append((self.step, tokens))
        self.step += 1
        if len(self.pending) >= FLUSH_BATCHES or self.pending_ids >= FLUSH_IDS:
            self.flush()

    def flush(self) -> None:
        """Write the buffered batches (a fault warns, see fault())."""
        if not self.pending or self.path is None or self.broken:
            return
        pending, self.pending, self.pending_ids = self.pending, [], 0
        if self.broken:
            self.pending_tokens = []
        try:
            self.write(pending)
        except Exception as error:  # (a folder removed, a full disk, ids on a lost device)
            self.fault(f"steps {pending[0][1]}..{pending[-1][1]} could not be written",
                       pending[0][1], error)

    def fault(self, what: str, first: int, error: Exception) -> None:
        """Handle a failed write of the lineage: one warning on this rank, and no more writes.

        What is on disk stays readable: the reader says where this rank's lineage ends."""
        self.broken = True
        self.pending, self.pending_ids = [], 0
        OPEN.discard(self)
        warnings.warn(f"[rank {self.rank}/{self.world}] sharddemo.watch: lineage "
                      f"{self.folder!r}: {what} ({type(error).__name__}: {error}); this "
                      f"rank's lineage ends before step {first}; training goes on",
                      RuntimeWarning, stacklevel=2)

    def write(self, pending: list) -> None:
        known = [ids for _, _, ids in pending if ids is not None and ids.numel()]
        flat = np.empty(0, dtype=np.int64)
        if known:  # one copy to the host for the whole buffer
            try:
                joined = torch.cat([ids if ids.dtype == torch.int64 else ids.to(torch.int64)
                                    for ids in known])
            except RuntimeError:  # ids on several devices
                joined = torch.cat([ids.to("cpu", torch.int64) for ids in known])
            flat = joined.cpu().numpy()
        data = encode_many([BATCH if ids is not None else UNKNOWN for _, _, ids in pending],
                           [epoch for epoch, _, _ in pending], [step for _, step, _ in pending],
                           [ids.numel() if ids is not None else 0 for _, _, ids in pending],
                           flat)
        with open(self.path, "ab") as handle:
            handle.write(data)
        self.write_tokens()

    def write_tokens(self) -> None:
        """The buffered steps' tokens, appended to rank<r>.tokens as (step, tokens) int64
        pairs (one copy to the host for them all; a pair cut short by a crash is skipped by
        the reader)."""
        from sharddemo.watching.tokens import step_tokens

        pending, self.pending_tokens = self.pending_tokens, []
        meter = getattr(self.state, "meter", None)
        if not pending or meter is None or not meter.token_fields:
            return
        field = meter.token_fields[0]
        counts = torch.stack([step_tokens(torch.as_tensor(t), field).to("cpu", torch.int64)
                              for _, t in pending])
        pairs = np.empty((len(pending), 2), dtype=np.int64)
        pairs[:, 0] = [step for step, _ in pending]
        pairs[:, 1] = counts.numpy()
        with open(tokens_file(self.folder, self.rank), "ab") as handle:
            handle.write(pairs.tobytes())

    # -- the files
    def open(self) -> None:
        """Open this rank's file, at the first batch.

        A new run refuses a folder that holds another run's lineage; a resumed one continues its
        own (cut to its whole records, then a restart record)."""
        from sharddemo.watching.output import run_stamp

        rank, world = rank_and_world(self.state.accelerator)
        self.rank, self.world = rank, world
        path = rank_file(self.folder, rank)
        run = read_run_file(self.folder)
        if self.continues is not None:
            if run is not None and run.get("run_id") != self.continues:
                raise ValueError(f"sharddemo.watch: lineage {self.folder!r} holds run "
                                 f"{run.get('run_id')}'s lineage, not run {self.continues}'s "
                                 "that this checkpoint continues; give another folder")
            self.run_id = self.continues
        else:
            theirs = (rank == 0 and run is not None) or (
                os.path.exists(path) and os.path.getsize(path) > 0)
            if theirs:
                other = f"run {run.get('run_id')}" if run else "another run"
                raise ValueError(f"sharddemo.watch: lineage {self.folder!r} already holds "
                                 f"{other}'s lineage ({RUN_FILE}, rank{rank}.lineage) and "
                                 "this run does not resume it from a checkpoint; give a new "
                                 "folder, or remove that one")
            self.run_id = run_stamp()["run_id"] if rank == 0 else None
        try:
            self.open_files(path, run)
        except Exception as error:  # (the folder removed, or a file in its place)
            self.fault("this rank's lineage could not be opened", self.step, error)
            return
        self.path = path
        OPEN.add(self)
        if self.resumed_at is not None:
            self.write_restart()

    def open_files(self, path: str, run: Optional[dict]) -> None:
        """The run file (rank 0, a new run) and this rank's file, cut to its whole records."""
        from sharddemo.watching.output import run_stamp

        rank, world = self.rank, self.world
        if rank == 0 and run is None:
            write_run_file(self.folder, {
                "run_id": self.run_id, "started": run_stamp()["run_started"],
                "world_size": world, "dataset_size": self.state.n,
                "loader": self.state.name,
                "launches": [{"first_step": self.step, "world_size": world,
                              "started": run_stamp()["run_started"], **self.mesh()}]})
        if os.path.exists(path) and os.path.getsize(path) > 0:
            end = valid_length(path)
            with open(path, "r+b") as handle:
                if end < 16:
                    handle.truncate(0)
                    handle.write(file_header(rank))
                else:
                    handle.truncate(end)  # a torn last record
        else:
            with open(path, "wb") as handle:
                handle.write(file_header(rank))

    def mesh(self) -> dict:
        """The launch's device mesh for the run file (each rank's coordinates, for the reader
        to name a rank's place and its peers), or nothing off a mesh."""
        layout = getattr(self.state, "mesh", None)  # (a state that has none)
        if layout is None:
            return {}
        return {"mesh": {"dims": dict(zip(layout.dims, layout.sizes)),
                         "data_dims": list(layout.data_dims),
                         "coords": [list(c) for c in layout.coords]}}

    def close(self) -> None:
        """Write what is buffered; the process's exit does it too."""
        self.flush()
        OPEN.discard(self)

    def write_restart(self) -> None:
        """Write the restart record in this rank's file, and rank 0 the launch in the run file.

        Rank 0 adds the launch (its first step, its world size) to the run file's `launches`, so
        that the reader knows the ranks of each launch (a resume on more ranks, or on fewer)."""
        from sharddemo.watching.output import run_stamp

        self.resumed_at = None
        if self.broken:
            return
        try:
            with open(self.path, "ab") as handle:
                handle.write(encode(RESTART, int(self.state.epoch), self.step))
            run = read_run_file(self.folder) if self.rank == 0 else None
            launch = {"first_step": self.step, "world_size": self.world,
                      "started": run_stamp()["run_started"], **self.mesh()}
            launches = (run or {}).get("launches") or [
                {"first_step": 0, "world_size": (run or {}).get("world_size")}]
            if run is not None and launches[-1] != launch:  # (open wrote it: a new run file)
                write_run_file(self.folder, {
                    **{k: v for k, v in run.items() if k not in ("schema", "format")},
                    "launches": [*launches, launch]})
        except Exception as error:  # (the folder removed, a full disk)
            self.fault(f"the restart at step {self.step} could not be written", self.step,
                       error)
