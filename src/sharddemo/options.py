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
# `auto` below COUNT_FROM: up to this many steps per rank and epoch, every batch is gathered as
# it comes. Beyond it, ids stay on the rank and are gathered once at the end of the epoch: a
# small gather costs 0.3-1.5 ms on gloo here, more than a whole step of a toy loader
# (docs/benchmarks.md). (rank.walk.choose_gather decides; the parent estimates the report's
# size with it: reportsize.)
PER_BATCH_GATHER_LIMIT = 100


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
# Set by `sharddemo compare` / `audit`: where each rank leaves its status (rank/session.py).
STATUS_ENV = "SHARDDEMO_STATUS_DIR"
# Set by `sharddemo compare` / `audit` for their launch: their own pid, which each rank checks
# is still its ancestor as it starts (sharddemo.lifeline).
PARENT_ENV = "SHARDDEMO_PARENT_PID"


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


def option(default, flag: str, help: str, **more):
    """A field of an options dataclass that the command line sets: its flag (`--x`, or
    `--x/--no-x` for a switch), its help, and for the CLI what the default does not say
    (`type`, `choices`, `metavar`). The CLI builds its options from these (cli.declared), and
    `command_line` writes them back: an option is declared here and nowhere else."""
    return field(default=default, metadata={"flag": flag, "help": help, **more})


def command_line(opts) -> list[str]:
    """The flags that reproduce `opts` on the command line (those that differ from their
    defaults), for the line a user can paste to rerun a launch by hand."""
    args: list[str] = []
    for f in dataclasses.fields(opts):
        flag = f.metadata.get("flag")
        value = getattr(opts, f.name)
        if flag is None or value == f.default:
            continue
        if "/" in flag:
            on, off = flag.split("/")
            args.append(on if value else off)
        elif isinstance(value, bool):
            args.append(flag)
        else:
            text = f"{value:g}" if isinstance(value, float) else str(value)
            args += [flag, os.path.abspath(text) if f.metadata.get("path") else text]
    return args


def from_dict(cls, data: dict):
    """An options dataclass from its `dataclasses.asdict` (the JSON file a launch hands its
    ranks), tuples restored."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) and k == "modes" else v
              for k, v in data.items() if k in names}
    return cls(**values)


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


# --resume-at: where a run stops, how it resumes (sharddemo audit; the resume demo's scenarios)
STRATEGIES = ("skip", "stateful", "restart")
LAST = -1  # a stop's step for `E:last`: after the epoch's last step, inside the loop


@dataclass(frozen=True)
class ResumeStop:
    """One stop of a chain: after `step` steps (batches per rank, as the loop counts them) of
    `epoch` (LAST: after the epoch's last step), the state saved and the launch ended; the next
    launch resumes from it on `num_processes` ranks (None: as many as the launch that saved)."""
    epoch: int
    step: int
    num_processes: Optional[int] = None

    def text(self) -> str:
        return f"{self.epoch}:{'last' if self.step == LAST else self.step}"

    def key(self) -> tuple:
        """Its place in the run: E:last comes after every step of E (and is E+1:0's place)."""
        return (self.epoch, float("inf") if self.step == LAST else self.step)


@dataclass(frozen=True)
class ResumePlan:
    """A chain of one or more stops and restarts, each restart resuming as `strategy` says."""
    stops: tuple[ResumeStop, ...]
    strategy: str = "skip"

    @staticmethod
    def at(epoch: int, step: int, strategy: str = "skip",
           num_processes: Optional[int] = None) -> "ResumePlan":
        """One stop and one restart."""
        return ResumePlan((ResumeStop(epoch, step, num_processes),), strategy)

    @property
    def first(self) -> ResumeStop:
        return self.stops[0]

    def text(self) -> str:
        return ",".join(stop.text() for stop in self.stops)

    @staticmethod
    def from_dict(data: dict) -> "ResumePlan":
        return ResumePlan(tuple(ResumeStop(**s) for s in data["stops"]), data["strategy"])

    @staticmethod
    def parse(text: str, strategy: str, epochs: int,
              num_processes: Optional[str]) -> "ResumePlan":
        """`--resume-at E:S[,E:S...]` (S an integer or `last`) and `--resume-num-processes
        M[,M...]` (one world size per restart) -> the plan; one UsageError naming the
        argument for anything it cannot run."""
        stops = []
        for part in text.split(","):
            epoch_text, sep, step_text = part.strip().partition(":")
            try:
                epoch = int(epoch_text)
                step = LAST if step_text.strip() == "last" else int(step_text)
            except ValueError:
                epoch, step, sep = -1, -1, ""
            if not sep or epoch < 0 or (step < 0 and step != LAST):
                raise UsageError(f"--resume-at {text!r}: {part.strip()!r} is not EPOCH:STEP "
                                 "(0-based, STEP = batches per rank completed before the stop, "
                                 "or `last` for after the epoch's last step), e.g. --resume-at "
                                 "0:3 or --resume-at 0:3,0:7,1:last")
            if epoch >= epochs:
                raise UsageError(f"--resume-at {text}: {part.strip()} stops in epoch {epoch}, "
                                 f"beyond --epochs {epochs} (epochs 0..{epochs - 1}); pass "
                                 f"--epochs {epoch + 1} or an earlier epoch")
            stops.append(ResumeStop(epoch, step))
        for before, after in zip(stops, stops[1:]):
            if after.key() < before.key():
                raise UsageError(f"--resume-at {text}: the stops are out of order ({after.text()} "
                                 f"comes before {before.text()} in the run); list them in the "
                                 "order the run reaches them")
        if strategy not in STRATEGIES:
            raise UsageError(f"--resume-strategy must be one of {', '.join(STRATEGIES)}, "
                             f"got {strategy!r}")
        if num_processes is not None:
            try:
                sizes = [int(s) for s in str(num_processes).split(",")]
            except ValueError:
                sizes = [0]
            if any(size < 1 for size in sizes):
                raise UsageError(f"--resume-num-processes {num_processes}: each world size must "
                                 "be an integer of at least 1, e.g. --resume-num-processes 3")
            if len(sizes) != len(stops):
                raise UsageError(f"--resume-num-processes {num_processes} gives {len(sizes)} "
                                 f"world size(s) for {len(stops)} restart(s) (--resume-at "
                                 f"{text}); give one per restart, e.g. --resume-num-processes "
                                 + ",".join(["3"] * len(stops)))
            stops = [dataclasses.replace(stop, num_processes=size)
                     for stop, size in zip(stops, sizes)]
        return ResumePlan(tuple(stops), strategy)


@dataclass(frozen=True)
class ResumeOptions:
    """`audit`'s resume options, as the command line gives them (ResumePlan.parse reads them)."""
    resume_at: Optional[str] = option(
        None, "--resume-at",
        "Also stop after STEP steps (batches per rank, as the loop counts them) of EPOCH "
        "(0-based; STEP `last`: after the epoch's last step), save the state, restart in fresh "
        "processes, resume, and compare with the uninterrupted run (verdict resume-exact). A "
        "comma-separated list is a chain of stops and restarts, in the order the run reaches "
        "them (e.g. 0:3,0:7,1:last).", type=str, metavar="EPOCH:STEP[,EPOCH:STEP...]")
    resume_strategy: str = option(
        "skip", "--resume-strategy",
        "How the restarted run resumes: accelerator.skip_first_batches, the stateful loader's "
        "own state (use_stateful_dataloader), or the epoch from its start.", choices=STRATEGIES)
    resume_num_processes: Optional[str] = option(
        None, "--resume-num-processes",
        "Resume on this many ranks instead (a world size that changed): one size per stop of "
        "--resume-at, e.g. 3,2.", type=str, metavar="M[,M...]")

    def plan(self, epochs: int) -> Optional[ResumePlan]:
        """The chain to run (None without --resume-at); one UsageError naming the argument
        for anything it cannot run."""
        if self.resume_at is None:
            return None
        return ResumePlan.parse(self.resume_at, self.resume_strategy, epochs,
                                self.resume_num_processes)


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
    epochs: int = option(2, "--epochs", "Epochs to walk (eval loaders: one).")
    id_field: Optional[str] = option(
        None, "--id-field",
        "The field (dict key, or tuple position) of each batch that holds the sample ids "
        "(integers 0..N-1, or keys: str or bytes, such as WebDataset's __key__; see --keys), or "
        "'.' when each batch is itself the tensor of ids. Default: the dataset indices each "
        "batch was made of, recorded as the dataset is asked for them (map-style datasets "
        "only).", type=str)
    expect: str = option("sharded", "--expect", "What the loader is meant to do across ranks.",
                         choices=EXPECTATIONS)
    set_epoch: bool = option(False, "--set-epoch",
                             "Call set_epoch(epoch) on the loader's sampler each epoch, as your "
                             "training loop does (prepared loaders do it themselves; a "
                             "DistributedSampler inside a batch sampler is found).")
    dataset_size: Optional[int] = option(
        None, "--dataset-size",
        "N, for streams without a length; a loader whose dataset has a length uses that "
        "[default: len(dataset)].", type=int)
    timeout: float = option(DEFAULT_TIMEOUT, "--timeout",
                            "Seconds a rank waits on a collective before the run fails.")
    gather: str = option("auto", "--gather", "How ids reach the main process (as in compare).",
                         choices=GATHER_STRATEGIES)
    # The whole launch's limit: a loader that hangs outside any collective ends here.
    max_time: float = option(3600.0, "--max-time",
                             "Seconds the whole audit may take before it is stopped.")
    # Set use_stateful_dataloader before the factory runs (the resume audit's `stateful`
    # strategy, for its uninterrupted reference run).
    stateful: bool = False
    # None: `target` is make_loader(accelerator); "trainer" / "lightning": it is make_trainer()
    # / make_datamodule(), and the framework builds the loaders (sharddemo.rank.frameworks).
    framework: Optional[str] = None
    # Gradient accumulation: the optimizer steps' windows of K batches (a Trainer's own
    # gradient_accumulation_steps when not given).
    grad_accum: Optional[int] = option(
        None, "--grad-accum",
        "Show the gradient-accumulation windows: which ids each optimizer step (K batches per "
        "rank) consumed, per rank and in all [default with --trainer: its "
        "gradient_accumulation_steps].", type=int, metavar="K")
    # The parent needs every id (--plot draws them): `auto` never takes the count path.
    keep_ids: bool = False
    # A file of the samples' keys, one per line (the parent's: analysis.keys numbers the
    # keys the ranks saw by it, and names the missing ones).
    keys: Optional[str] = option(
        None, "--keys",
        "With an --id-field of keys (str, bytes: a WebDataset __key__, a string id column): the "
        "samples' keys, one per line. N is then the file's length and the missing samples are "
        "named; the count path (1,000,000 samples and more) numbers the keys by it [default: a "
        "datasets.Dataset's own column of keys does the same; else N from --dataset-size or the "
        "dataset's length, missing samples counted, not named, and keys on the id path only].",
        type=str, metavar="FILE", path=True)

    def validate(self) -> "AuditOptions":
        if self.framework not in FACTORY_CALLS:
            raise UsageError(f"framework must be trainer or lightning, got {self.framework!r}")
        if self.framework is not None:
            from sharddemo.extras import require_framework

            require_framework(self.framework)
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

    def command_line(self) -> list[str]:
        """The `sharddemo audit` arguments that reproduce these options."""
        where = [self.target] if self.framework is None else [f"--{self.framework}", self.target]
        return [*where, *command_line(self)]


# -- refusals that need more than one option: every entry point (the CLI, the command functions,
# sharddemo.testing) refuses them with the same line, before any rank starts

COUNTED_NO_PLOT = ("--plot draws every id a rank received, and this run was counted (the count "
                   "path keeps no id lists; it is chosen from 1,000,000 samples on): pass "
                   "--gather epoch to draw it")
NO_EPOCHS_TO_PLOT = ("--plot draws each mode's epochs, and mode resume reports its scenarios as "
                     "rows, not epochs: drop --plot (the table, markdown and JSON show every "
                     "scenario)")


def parse_size(text: str, option: str) -> int:
    """'512MB', '2GB', '1.5G', '300' (MB) -> bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", text.upper())
    if not match:
        raise UsageError(f"{option} {text!r} is not a size; write it like 512MB or 2GB")
    value, unit = float(match.group(1)), match.group(2) or "M"
    return int(value * 1024 ** "KMGT".index(unit) * 1024)


def check_memory(opts: RunOptions, world: Optional[int], limit: int) -> None:
    """One Error line before any rank starts when the ids would not fit in `limit` bytes."""
    n = opts.dataset_size
    is_counted = counted(opts.gather, n)
    if is_counted:
        need = counter_bytes(n, world or 1)
        what, where = f"the count path's counter of {n:,} samples", "per rank"
    else:
        # Replicated modes send every rank's whole epoch: up to W x N ids.
        need = 40 * n * (world or 2)
        what, where = f"every id of an epoch of {n:,} samples (--gather {opts.gather})", "on rank 0"
    if need > limit:
        hint = "" if is_counted else "; --gather count holds 1 byte per sample"
        raise UsageError(f"--max-memory {limit / 2**20:,.0f} MB is less than {what} needs, about "
                         f"{need / 2**20:,.0f} MB {where}: raise --max-memory or lower "
                         f"--dataset-size{hint}")


def refuse_counted_plot(gather: str, n: Optional[int]) -> None:
    """--plot draws every id: refuse, before any rank starts, a run that would be counted."""
    if gather == "count" or counted(gather, n):
        raise UsageError(COUNTED_NO_PLOT)


def check_compare(opts: RunOptions, *, world: Optional[int] = None, plot: bool = False,
                  max_memory: Optional[str] = None) -> None:
    """What `compare` refuses beyond RunOptions.validate: --max-memory too small, --plot of a
    resume demo or of a counted run."""
    if max_memory is not None:
        check_memory(opts, world, parse_size(max_memory, "--max-memory"))
    if plot:
        if "resume" in opts.modes:
            raise UsageError(NO_EPOCHS_TO_PLOT)
        refuse_counted_plot(opts.gather, opts.dataset_size)


def check_audit(opts: "AuditOptions", *, plot: bool = False,
                resume: Optional["ResumePlan"] = None, keep_checkpoint: Optional[str] = None,
                resume_num_processes: Optional[str] = None) -> "AuditOptions":
    """What `audit` refuses beyond AuditOptions.validate; returns the options the launch runs
    with (--plot and --resume-at need every id: `auto` then keeps them at any size)."""
    if plot:
        refuse_counted_plot(opts.gather, opts.dataset_size)
        opts = dataclasses.replace(opts, keep_ids=True)
    if resume is None:
        if resume_num_processes is not None or keep_checkpoint is not None:
            raise UsageError("--resume-num-processes and --keep-checkpoint go with --resume-at "
                             "EPOCH:STEP")
        return opts
    if opts.keys is not None:
        raise UsageError("--keys names the samples of an --id-field of keys, which the resume "
                         "audit does not compare yet; leave --keys (or --resume-at) out")
    if opts.framework is not None:
        # (the resume audit stops and restarts a loop of sharddemo's over the factory's loader;
        # the Trainer and Lightning resume through their own loops and checkpoints, which the
        # watch follows as they run)
        who, callback = {"trainer": ("Trainer", "TrainerWatch"),
                         "lightning": ("Lightning fit", "LightningWatch")}[opts.framework]
        raise UsageError(f"--resume-at audits a make_loader factory; it does not go with "
                         f"--{opts.framework}: to check how your {who} resumes, train with "
                         f"callbacks=[{callback}()], stop and resume from its checkpoint "
                         "(docs/watch.md), or pass a make_loader FACTORY")
    if resume.strategy == "stateful":
        from sharddemo.extras import require

        require("torchdata", "--resume-strategy stateful")
    if opts.gather == "count":
        raise UsageError("--resume-at compares every id of the stopped, the resumed and the "
                         "uninterrupted run, and --gather count keeps none: pass --gather "
                         "epoch (or leave --gather out)")
    return dataclasses.replace(opts, keep_ids=True)


def audit_target(factory: Optional[str], trainer: Optional[str],
                 lightning: Optional[str]) -> tuple[str, Optional[str]]:
    """(target, framework) from audit's FACTORY, --trainer and --lightning: exactly one."""
    given = [(name, value) for name, value in (("FACTORY", factory), ("--trainer", trainer),
                                               ("--lightning", lightning)) if value]
    if len(given) != 1:
        what = " and ".join(name for name, _ in given) if given else "none"
        raise UsageError(f"audit takes one of FACTORY (make_loader), --trainer or --lightning "
                         f"(got {what}); e.g. sharddemo audit examples/good.py:make_loader")
    name, target = given[0]
    return target, None if name == "FACTORY" else name[2:]


# -- the options a launch hands its ranks: one JSON file beside the trace (launch.run_launch)

def write_rank_options(path: str, payload: dict) -> None:
    import json

    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle)


def read_rank_options(path: str) -> dict:
    """The options file a launch wrote -> its parts as objects: `run` (RunOptions), `audit`
    (AuditOptions), `plan` (ResumePlan), and the plain values beside them (phase, checkpoint,
    stateful, allow_alone)."""
    import json

    try:
        with open(path, encoding="utf-8") as handle:
            payload = json.load(handle)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--options {path}: cannot read the options a launch wrote ({exc}); "
                         "rank commands are started by sharddemo compare / audit") from None
    if "run" in payload:
        payload["run"] = from_dict(RunOptions, payload["run"]).validate()
    if "audit" in payload:
        payload["audit"] = from_dict(AuditOptions, payload["audit"]).validate()
    if "plan" in payload:
        payload["plan"] = ResumePlan.from_dict(payload["plan"])
    return payload
