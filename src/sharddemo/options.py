"""What a run is asked to do, checked before any process starts.

This module imports neither torch nor accelerate, so the CLI can validate input and
print help in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from sharddemo.errors import UsageError
from sharddemo.targets import FACTORY_CALLS, parse_target

# The modes `run` and `compare` know. `all` is the reference's three; `pitfalls` the two
# that silently lose samples; `split` is the datasets-native split for the HF sources.
BASIC_MODES = ("prepared", "sampler", "replicated")
PITFALL_MODES = ("double-split", "unseeded")
# --source webdataset has its own: the documented split and what users meet instead of it.
# `all` there means these five.
WDS_MODES = ("split", "no-nodesplitter", "silenced", "resampled", "uneven-shards")
MODES = BASIC_MODES + PITFALL_MODES + ("split", "resume") + WDS_MODES[1:]
MODE_GROUPS = {"all": BASIC_MODES, "pitfalls": PITFALL_MODES}

MODE_HELP = {
    "prepared": "plain DataLoader(shuffle=True) passed through accelerator.prepare, which shards it",
    "sampler": "DataLoader with an explicit DistributedSampler and set_epoch each epoch, not prepared",
    "replicated": "plain DataLoader(shuffle=True), not prepared, no sampler: every rank walks all of it",
    "double-split": "pitfall: a DataLoader that already has a DistributedSampler, passed through "
                    "accelerator.prepare as well, so it is split twice",
    "unseeded": "pitfall: accelerator.prepare with use_seedable_sampler=True and no seed, so every "
                "process shuffles with its own seed",
    "split": "the source's own split, then a plain DataLoader, not prepared: "
             "datasets.distributed.split_dataset_by_node per rank (hf, hf-stream), or WebDataset's "
             "nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker (webdataset)",
    "no-nodesplitter": "webdataset: wds.WebDataset(urls) with its default nodesplitter, which "
                       "raises on more than one rank rather than let every rank read every shard",
    "silenced": "webdataset pitfall: that error silenced with nodesplitter=lambda src: src, so every "
                "rank reads every shard",
    "resampled": "webdataset: resampled=True with .with_epoch(ceil(N / (ranks x workers))) per "
                 "worker: shards drawn with replacement, repeats and gaps by design",
    "uneven-shards": "webdataset: the documented split over the same samples in ranks x workers + 1 "
                     "shards, which do not divide: the ranks read unequal amounts",
    "resume": "the prepared loader stopped, saved, restarted and resumed: skip, stateful and restart "
              "strategies, mid-epoch and epoch-boundary stops, 0 and 2 workers, epochs 0..2 (compare only; "
              "--epochs, --num-workers and --gather do not apply)",
}


def mode_description(mode: str, shuffle: bool, source: str) -> str:
    """MODE_HELP as the run built the mode: its plain DataLoader shuffles only with --shuffle
    over a map-style source (a stream has no order to shuffle; loaders.plain_loader)."""
    text = MODE_HELP[mode]
    if not (shuffle and source in MAP_SOURCES):
        text = text.replace("DataLoader(shuffle=True)", "DataLoader(shuffle=False)")
    return text


# Where the samples come from. Every source carries its sample ids.
SOURCES = ("toy", "hf", "iterable", "iterable-unsplit", "hf-stream", "webdataset")
MAP_SOURCES = ("toy", "hf")
SOURCE_HELP = {
    "toy": "the reference's dataset: sample i holds the value i + 1",
    "hf": "a datasets.Dataset built in memory with an `id` column, torch format",
    "iterable": "a torch IterableDataset streaming ids 0..N-1 (no length), split by DataLoader "
                "worker",
    "iterable-unsplit": "the common mistake: an IterableDataset that ignores workers and ranks, "
                        "so every worker yields the whole stream",
    "hf-stream": "a datasets.IterableDataset streamed from JSON-lines shards written locally",
    "webdataset": "WebDataset tar shards written locally, samples keyed sample000000.. (extra "
                  "[webdataset]); modes: " + ", ".join(WDS_MODES) + " (all: these five)",
}
DEFAULT_SHARDS = 4

DEFAULT_DATASET_SIZE = 8
DEFAULT_BATCH_SIZE = 4
DEFAULT_EPOCHS = 2
DEFAULT_SEED = 42
DEFAULT_TIMEOUT = 60.0
GATHER_STRATEGIES = ("auto", "batch", "epoch", "count")
# `auto` takes the count path (rank/counting.py) from this many samples on. Here, torch-free, so the
# command line can decide before any rank starts.
COUNT_FROM = 1_000_000


def counted(gather: str, n: Optional[int]) -> bool:
    """Whether a walk of n samples takes the count path (rank.walk.choose_gather decides the same on
    the ranks)."""
    return n is not None and (gather == "count" or (gather == "auto" and n >= COUNT_FROM))


def code_width(world: int) -> tuple[int, int]:
    """(shift, bytes) of the count path's per-sample code for `world` ranks: a code is 0, 1 or
    1 + shift, and the sum of `world` codes must fit, with the ranks that received a sample
    below `shift`: 16 in one byte up to 15 ranks, 256 in two up to 255, else 65536 in four.
    (counting.code_layout gives the numpy dtype; here no numpy, for the CLI's own checks.)"""
    if world <= 15:
        return 16, 1
    if world <= 255:
        return 256, 2
    return 65536, 4


# From this many samples the count path keeps 2 bits a sample (rank.counting.BitCounts), not a
# byte: at 10^9, 250 MB a rank instead of 1 GB.
BITS_FROM = 1 << 26


def counter_bytes(n: int, world: int = 1) -> int:
    """What the count path holds per rank for an epoch of a dataset of n samples: its uint8
    counter and, where the code is wider than a byte, the code beside it (up to 15 ranks the
    counter is its own code); from BITS_FROM samples its two bitmaps (the code is made and
    sent a chunk at a time)."""
    if n >= BITS_FROM:
        return -(-int(n) // 4)
    width = code_width(world)[1]
    return int(n) * (1 + (width if width > 1 else 0))

# Set by `sharddemo compare` for the ranks it launches: the world size it asked for.
EXPECT_ENV = "SHARDDEMO_EXPECT_WORLD_SIZE"
# Set by `sharddemo compare` for its ranks: the machine rank of this node.
NODE_ENV = "SHARDDEMO_MACHINE_RANK"
# Set by `sharddemo compare` / `audit` when a person watches: the main rank reports progress.
PROGRESS_ENV = "SHARDDEMO_PROGRESS"
# Set by `sharddemo compare` / `audit`: where each rank leaves its status (trace.py).
STATUS_ENV = "SHARDDEMO_STATUS_DIR"


def parse_modes(text: str, source: str = "toy") -> tuple[str, ...]:
    """`all`, one mode, or a comma list of modes -> a tuple in the order given, no repeats.
    Over --source webdataset, `all` is that source's five modes (WDS_MODES)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise UsageError("no mode given; pass --mode all or a comma list of: " + ", ".join(MODES))
    out: list[str] = []
    for name in names:
        if name == "all" and source == "webdataset":
            chosen = list(WDS_MODES)
        elif name in MODE_GROUPS:
            chosen = list(MODE_GROUPS[name])
        elif name in MODES:
            chosen = [name]
        else:
            raise UsageError(
                f"unknown mode {name!r}; choose 'all', 'pitfalls' or a comma list of: "
                + ", ".join(MODES)
            )
        out.extend(m for m in chosen if m not in out)
    return tuple(out)


def per_rank_batch(batch: int, world: int, split: bool) -> int:
    """The batch one rank receives of a loader with batch size `batch`: with split_batches
    that is the global batch, which accelerate slices across the ranks."""
    return max(1, batch // world) if split else batch


@dataclass(frozen=True)
class RunOptions:
    """Everything that decides which ids each rank receives."""

    dataset_size: int = DEFAULT_DATASET_SIZE
    batch_size: int = DEFAULT_BATCH_SIZE
    epochs: int = DEFAULT_EPOCHS
    seed: int = DEFAULT_SEED
    modes: tuple[str, ...] = field(default=BASIC_MODES)
    shuffle: bool = True
    drop_last: bool = False
    set_epoch: bool = True
    num_workers: int = 0
    source: str = "toy"
    shards: int = DEFAULT_SHARDS
    # accelerate's DataLoaderConfiguration, for the prepared loaders. None: accelerate's
    # default (dispatch for iterable datasets, not for map-style ones).
    even_batches: bool = True
    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    # How ids reach the main process: every batch (`batch`), once per epoch (`epoch`), not at
    # all (`count`), or `auto`: as rank.walk.choose_gather decides.
    gather: str = "auto"
    # Seconds a rank waits on a collective before giving up (gloo's default is 30 minutes).
    timeout: float = DEFAULT_TIMEOUT

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
        if "split" in self.modes and self.source not in ("hf", "hf-stream", "webdataset"):
            raise UsageError("mode split uses the source's own split: pass --source hf, "
                             "hf-stream or webdataset")
        if self.source not in MAP_SOURCES + ("webdataset",):
            needs_map = [m for m in self.modes if m in ("sampler",) + PITFALL_MODES]
            if needs_map:
                raise UsageError(f"mode {needs_map[0]} needs a map-style dataset (a sampler draws "
                                 f"indices), but --source {self.source} is iterable; use "
                                 "--source toy or hf, or modes prepared, replicated, split")
        return self

    def check_world(self, world: int) -> "RunOptions":
        """The checks that need the world size."""
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

    def to_run_args(self) -> list[str]:
        """The `sharddemo run` arguments that reproduce these options in a launched run."""
        args = [
            "--mode", ",".join(self.modes),
            "--dataset-size", str(self.dataset_size),
            "--batch-size", str(self.batch_size),
            "--epochs", str(self.epochs),
            "--seed", str(self.seed),
        ]
        if not self.shuffle:
            args.append("--no-shuffle")
        if self.drop_last:
            args.append("--drop-last")
        if not self.set_epoch:
            args.append("--no-set-epoch")
        if self.num_workers:
            args += ["--num-workers", str(self.num_workers)]
        if self.source != "toy":
            args += ["--source", self.source]
        if self.shards != DEFAULT_SHARDS:
            args += ["--shards", str(self.shards)]
        if not self.even_batches:
            args.append("--no-even-batches")
        if self.split_batches:
            args.append("--split-batches")
        if self.dispatch_batches is not None:
            args.append("--dispatch-batches" if self.dispatch_batches else "--no-dispatch-batches")
        if self.gather != "auto":
            args += ["--gather", self.gather]
        if self.timeout != DEFAULT_TIMEOUT:
            args += ["--timeout", f"{self.timeout:g}"]
        return args


# --resume-at: where a run stops, how it resumes (sharddemo audit; the resume demo's scenarios)
STRATEGIES = ("skip", "stateful", "restart")


@dataclass(frozen=True)
class ResumePlan:
    epoch: int
    step: int
    strategy: str = "skip"
    num_processes: Optional[int] = None  # launch 2's world size (None: the same)

    @staticmethod
    def parse(text: str, strategy: str, epochs: int,
              num_processes: Optional[int]) -> "ResumePlan":
        epoch_text, sep, step_text = text.partition(":")
        try:
            epoch, step = int(epoch_text), int(step_text)
        except ValueError:
            epoch, step, sep = -1, -1, ""
        if not sep or epoch < 0 or step < 0:
            raise UsageError(f"--resume-at {text!r} is not EPOCH:STEP (0-based, STEP = batches "
                             "per rank completed before the stop), e.g. --resume-at 0:3")
        if epoch >= epochs:
            raise UsageError(f"--resume-at {text} stops in epoch {epoch}, beyond --epochs "
                             f"{epochs} (epochs 0..{epochs - 1}); pass --epochs {epoch + 1} or "
                             "an earlier epoch")
        if strategy not in STRATEGIES:
            raise UsageError(f"--resume-strategy must be one of {', '.join(STRATEGIES)}, "
                             f"got {strategy!r}")
        if num_processes is not None and num_processes < 1:
            raise UsageError(f"--resume-num-processes must be at least 1, got {num_processes}")
        return ResumePlan(epoch, step, strategy, num_processes)


DEMO_WORKERS = (0, 2)


def demo_scenarios(steps: int, stateful: bool = True) -> list[dict]:
    """The 12 scenarios for an epoch of `steps` steps per rank: stop in the middle of epoch 0
    and at the start of epoch 1; skip, stateful, restart; 0 and 2 workers. Without `stateful`
    (torchdata not installed) the 8 that need no StatefulDataLoader."""
    stops = [(0, steps // 2), (1, 0)]
    strategies = [s for s in STRATEGIES if stateful or s != "stateful"]
    return [{"workers": w, "epoch": e, "step": s, "strategy": strategy}
            for w in DEMO_WORKERS for e, s in stops for strategy in strategies]


EXPECTATIONS = ("sharded", "replicated")


@dataclass(frozen=True)
class AuditOptions:
    target: str
    epochs: int = 2
    id_field: Optional[str] = None
    expect: str = "sharded"
    set_epoch: bool = False
    dataset_size: Optional[int] = None
    timeout: float = 60.0
    gather: str = "auto"
    # The whole launch's limit: a loader that hangs outside any collective ends here.
    max_time: float = 3600.0
    # Set use_stateful_dataloader before the factory runs (the resume audit's `stateful`
    # strategy, for its uninterrupted reference run).
    stateful: bool = False
    # None: `target` is make_loader(accelerator); "trainer" / "lightning": it is make_trainer()
    # / make_datamodule(), and the framework builds the loaders (sharddemo.rank.frameworks).
    framework: Optional[str] = None
    # Gradient accumulation: the optimizer steps' windows of K batches (a Trainer's own
    # gradient_accumulation_steps when not given).
    grad_accum: Optional[int] = None
    # The parent needs every id (--plot draws them): `auto` never takes the count path.
    keep_ids: bool = False
    # A file of the samples' keys, one per line (the parent's: analysis.keys numbers the
    # keys the ranks saw by it, and names the missing ones).
    keys: Optional[str] = None

    def validate(self) -> "AuditOptions":
        if self.framework not in FACTORY_CALLS:
            raise UsageError(f"framework must be trainer or lightning, got {self.framework!r}")
        parse_target(self.target, self.framework)
        if self.epochs < 1:
            raise UsageError(f"--epochs must be at least 1, got {self.epochs}")
        if self.expect not in EXPECTATIONS:
            raise UsageError(f"--expect must be sharded or replicated, got {self.expect!r}")
        if self.dataset_size is not None and self.dataset_size < 1:
            raise UsageError(f"--dataset-size must be at least 1, got {self.dataset_size}")
        if not self.timeout > 0:
            raise UsageError(f"--timeout must be a positive number of seconds, got {self.timeout}")
        if not self.max_time > 0:
            raise UsageError(f"--max-time must be a positive number of seconds, got {self.max_time}")
        if self.keys is not None and self.id_field is None:
            raise UsageError(f"--keys {self.keys} names the keys an --id-field holds; pass "
                             "--id-field too (e.g. --id-field __key__)")
        if self.grad_accum is not None and self.grad_accum < 1:
            raise UsageError(f"--grad-accum must be at least 1 batch per optimizer step, got "
                             f"{self.grad_accum}")
        if self.framework is not None:
            who = "the Trainer" if self.framework == "trainer" else "Lightning"
            if self.set_epoch:
                raise UsageError(f"--set-epoch: with --{self.framework}, {who} sets the epoch "
                                 "itself, as in training; leave --set-epoch out")
            if self.expect != "sharded":
                raise UsageError(f"--expect {self.expect}: with --{self.framework} the train "
                                 "loader is meant to be sharded; leave --expect out")
        return self

    def to_run_args(self) -> list[str]:
        where = [self.target] if self.framework is None else [f"--{self.framework}", self.target]
        args = [*where, "--epochs", str(self.epochs), "--expect", self.expect,
                "--timeout", f"{self.timeout:g}"]
        if self.grad_accum is not None:
            args += ["--grad-accum", str(self.grad_accum)]
        if self.id_field is not None:
            args += ["--id-field", self.id_field]
        if self.set_epoch:
            args.append("--set-epoch")
        if self.dataset_size is not None:
            args += ["--dataset-size", str(self.dataset_size)]
        if self.gather != "auto":
            args += ["--gather", self.gather]
        if self.stateful:
            args.append("--stateful-loader")
        if self.keep_ids:
            args.append("--keep-ids")
        if self.keys is not None:
            args += ["--keys", os.path.abspath(self.keys)]
        return args
