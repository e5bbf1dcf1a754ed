"""The options of `run` and `compare`: everything that decides which ids each rank receives
(RunOptions), each refused alone in validate()."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from sharddemo.errors import UsageError
from sharddemo.mesh import parse_mesh
from sharddemo.options.declare import option
from sharddemo.options.gather import GATHER_STRATEGIES, counted
from sharddemo.options.modes import (BASIC_MODES, MAP_SOURCES, MESH_MODES, MESH_PITFALL, MODES,
                                     PITFALL_MODES, SOURCE_HELP, SOURCES, WDS_MODES)

DEFAULT_SHARDS = 4
DEFAULT_DATASET_SIZE = 8
DEFAULT_BATCH_SIZE = 4
DEFAULT_EPOCHS = 2
DEFAULT_SEED = 42
DEFAULT_TIMEOUT = 60.0


def per_rank_batch(batch: int, world: int, split: bool) -> int:
    """The batch one rank receives of a loader with batch size `batch`: with split_batches
    that is the global batch, which accelerate slices across the ranks."""
    return max(1, batch // world) if split else batch


@dataclass(frozen=True)
class RunOptions:
    """Everything that decides which ids each rank receives."""

    dataset_size: int = option(DEFAULT_DATASET_SIZE, "--dataset-size",
                               "Number of samples N (sample i holds the value i + 1).")
    batch_size: int = option(DEFAULT_BATCH_SIZE, "--batch-size", "Per-rank batch size B.")
    epochs: int = option(DEFAULT_EPOCHS, "--epochs", "Epochs to walk.")
    seed: int = option(DEFAULT_SEED, "--seed",
                       "Seed for every shuffle (set_seed, sampler seed, loader generator).")
    modes: tuple[str, ...] = field(default=BASIC_MODES)
    shuffle: bool = option(True, "--shuffle/--no-shuffle",
                           "Shuffle each epoch; --no-shuffle shows the plain strided split.")
    drop_last: bool = option(False, "--drop-last", "Drop incomplete batches / rounds.")
    set_epoch: bool = option(True, "--set-epoch/--no-set-epoch",
                             "sampler mode: call sampler.set_epoch(epoch) each epoch.")
    num_workers: int = option(0, "--num-workers", "DataLoader worker processes.")
    source: str = option("toy", "--source", "Where samples come from: " + "; ".join(
        f"{k}: {v}" for k, v in SOURCE_HELP.items()) + ".", choices=SOURCES)
    shards: int = option(DEFAULT_SHARDS, "--shards",
                         "hf-stream, webdataset: number of files (shards) the stream is written "
                         "as.")
    # accelerate's DataLoaderConfiguration, for the prepared loaders. None: accelerate's
    # default (dispatch for iterable datasets, not for map-style ones).
    even_batches: bool = option(True, "--even-batches/--no-even-batches",
                                "prepared: accelerate fills the last round so every rank gets as "
                                "many batches (--no-even-batches: unequal counts, a DDP hang).")
    split_batches: bool = option(False, "--split-batches",
                                 "prepared: slice each batch of --batch-size across the ranks "
                                 "(the batch size must divide by the world size).")
    dispatch_batches: Optional[bool] = option(
        None, "--dispatch-batches/--no-dispatch-batches",
        "prepared: rank 0 reads and broadcasts slices [default: accelerate's: on for iterable "
        "sources, off for map-style].")
    # How ids reach the main process: every batch (`batch`), once per epoch (`epoch`), not at
    # all (`count`), or `auto`: as rank.walk.choose_gather decides.
    gather: str = option("auto", "--gather",
                         "batch: accelerator.gather every batch; epoch: each rank's ids once per "
                         "epoch; count: no id lists, each rank counts its ids (1 byte per sample) "
                         "and one reduce sums them; auto: count from 1,000,000 samples, else "
                         "batch up to 100 steps per rank and epoch, else epoch.",
                         choices=GATHER_STRATEGIES)
    # Seconds a rank waits on a collective before giving up (gloo's default is 30 minutes).
    timeout: float = option(DEFAULT_TIMEOUT, "--timeout",
                            "Seconds a rank waits on a collective before the run fails.")
    # A device mesh, as NAME=SIZE,... (sharddemo.mesh.parse_mesh): the ranks form it with
    # torch's init_device_mesh, and each mode is built on it (docs/compare.md, "--mesh").
    mesh: Optional[str] = option(
        None, "--mesh",
        "Run the modes on a device mesh of these dims, e.g. dp=2,tp=2 (world = the product of "
        "the sizes; data dims: those named dp, dp_replicate, dp_shard or fsdp, every other dim "
        "(tp, cp, ...) holds replica peers, which must receive the same batches). Built with "
        "torch's init_device_mesh; prepared: accelerate's prepare_data_loader("
        "torch_device_mesh=mesh) (accelerate's ParallelismConfig refuses CPU); sampler: over "
        "the data-parallel groups; pitfalls adds world-sampler.", type=str, metavar="DIMS")

    def mesh_dims(self) -> Optional[tuple[tuple[str, ...], tuple[int, ...]]]:
        """(dims, sizes) of --mesh, or None without one."""
        return None if self.mesh is None else mesh_of(self.mesh)

    def per_rank_batch(self, world: int) -> int:
        return per_rank_batch(self.batch_size, world, self.split_batches)

    def validate(self) -> "RunOptions":
        if self.dataset_size < 1:
            raise UsageError(
                f"--dataset-size must be at least 1, got {self.dataset_size}; "
                "pass the number of samples, e.g. --dataset-size 8"
            )
        if self.batch_size < 1:
            raise UsageError(
                f"--batch-size must be at least 1, got {self.batch_size}; "
                "pass the per-rank batch size, e.g. --batch-size 4"
            )
        if self.epochs < 1:
            raise UsageError(
                f"--epochs must be at least 1, got {self.epochs}; e.g. --epochs 2"
            )
        if self.num_workers < 0:
            raise UsageError(f"--num-workers must be 0 or more, got {self.num_workers}")
        if self.gather not in GATHER_STRATEGIES:
            raise UsageError(f"--gather must be one of {', '.join(GATHER_STRATEGIES)}, got {self.gather!r}")
        if not self.timeout > 0:
            raise UsageError(f"--timeout must be a positive number of seconds, got {self.timeout}")
        if not self.modes:
            raise UsageError("no mode given; pass --mode all")
        for mode in self.modes:
            if mode not in MODES:
                raise UsageError(f"unknown mode {mode!r}; choose from: " + ", ".join(MODES))
        if self.source not in SOURCES:
            raise UsageError(f"unknown source {self.source!r}; choose from: " + ", ".join(SOURCES))
        if self.source == "webdataset":
            from sharddemo.extras import require

            require("webdataset", "--source webdataset")
        if self.shards < 1:
            raise UsageError(f"--shards must be at least 1, got {self.shards}")
        if "resume" in self.modes and (len(self.modes) > 1 or self.source not in MAP_SOURCES):
            raise UsageError("mode resume runs alone, on a map-style source: pass --modes resume "
                             "(with --source toy or hf)")
        if self.source == "webdataset":
            other = [m for m in self.modes if m not in WDS_MODES]
            if other:
                raise UsageError(f"mode {other[0]} is not built over --source webdataset; its "
                                 "modes are " + ", ".join(WDS_MODES) + " (--mode all: the five)")
        else:
            only = [m for m in self.modes if m in WDS_MODES[1:]]
            if only:
                raise UsageError(f"mode {only[0]} is a WebDataset case: pass --source webdataset")
        if MESH_PITFALL in self.modes and self.mesh is None:
            raise UsageError(f"mode {MESH_PITFALL} is a device mesh's pitfall: pass --mesh "
                             "(e.g. --mesh dp=2,tp=2); without one it is mode sampler")
        if self.mesh is not None:
            self.refuse_on_mesh()
        if "split" in self.modes and self.source not in ("hf", "hf-stream", "webdataset"):
            raise UsageError("mode split uses the source's own split: pass --source hf, "
                             "hf-stream or webdataset")
        if self.source not in MAP_SOURCES + ("webdataset",):
            needs_map = [m for m in self.modes if m in ("sampler",) + PITFALL_MODES]
            if needs_map:
                valid = ("prepared,replicated" if self.source == "iterable"
                         else "prepared,replicated,split")
                raise UsageError(f"mode {needs_map[0]} needs a map-style dataset (a sampler draws "
                                 f"indices), but --source {self.source} is iterable; use "
                                 f"--source toy or hf, or --modes {valid}")
        return self

    def refuse_on_mesh(self) -> None:
        """What --mesh does not run: modes and sources built for a flat world, and the count
        path (the peers' batches are compared id by id)."""
        self.mesh_dims()
        other = [m for m in self.modes if m not in MESH_MODES]
        if other:
            raise UsageError(f"mode {other[0]} is not built on a mesh; with --mesh choose from "
                             + ", ".join(MESH_MODES) + " (--modes all, or pitfalls)")
        if self.source not in MAP_SOURCES:
            raise UsageError(f"--mesh runs over a map-style source (--source toy or hf), not "
                             f"--source {self.source}")
        if self.dispatch_batches:
            raise UsageError("--dispatch-batches is not built with --mesh (accelerate's "
                             "dispatcher deals a mesh by its own rules); leave it out")
        if counted(self.gather, self.dataset_size):
            raise UsageError("--mesh compares each rank's batches with its peers', and the count "
                             "path keeps no batches (--gather count, or auto from 1,000,000 "
                             "samples): pass --gather epoch")

    def validate_split_batches(self, world: int) -> "RunOptions":
        """Refuse --split-batches where the batch size does not divide by the world size (the
        one check that needs the world size: make_launch asks it before any rank starts, each
        rank again with the world it is in)."""
        if self.split_batches and self.batch_size % world:
            raise UsageError(
                f"--split-batches slices each batch of {self.batch_size} across {world} ranks, "
                f"so the batch size must divide by {world}; use --batch-size "
                f"{max(world, self.batch_size - self.batch_size % world)} or drop --split-batches")
        return self

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["modes"] = list(self.modes)
        return data



def mesh_of(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """--mesh's (dims, sizes), or its one-line Error (sharddemo.mesh.parse_mesh's words)."""
    try:
        return parse_mesh(text)
    except ValueError as error:
        raise UsageError(f"--mesh {error}") from None


def mesh_world(text: str, num_processes: Optional[int]) -> int:
    """The world a --mesh needs (the product of its sizes); one Error line where
    --num-processes says otherwise."""
    world = 1
    for size in mesh_of(text)[1]:
        world *= size
    if num_processes is not None and num_processes != world:
        raise UsageError(f"--mesh {text} holds {world} ranks but --num-processes is "
                         f"{num_processes}: give --num-processes {world} or leave it out")
    return world
