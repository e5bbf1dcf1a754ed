"""What a run is asked to do, checked before any process starts.

This module imports neither torch nor accelerate, so the CLI can validate input and
print help in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sharddemo.errors import UsageError

# The modes `run` and `compare` know, in the order `all` runs them.
BASIC_MODES = ("prepared", "sampler", "replicated")
MODES = BASIC_MODES

MODE_HELP = {
    "prepared": "plain DataLoader(shuffle=True) passed through accelerator.prepare, which shards it",
    "sampler": "DataLoader with an explicit DistributedSampler and set_epoch each epoch, not prepared",
    "replicated": "plain DataLoader(shuffle=True), not prepared, no sampler: every rank walks all of it",
}

DEFAULT_DATASET_SIZE = 8
DEFAULT_BATCH_SIZE = 4
DEFAULT_EPOCHS = 2
DEFAULT_SEED = 42
DEFAULT_TIMEOUT = 60.0
GATHER_STRATEGIES = ("auto", "batch", "epoch")

# Set by `sharddemo compare` for the ranks it launches: the world size it asked for.
EXPECT_ENV = "SHARDDEMO_EXPECT_WORLD_SIZE"


def parse_modes(text: str) -> tuple[str, ...]:
    """`all`, one mode, or a comma list of modes -> a tuple in the order given, no repeats."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise UsageError("no mode given; pass --mode all or a comma list of: " + ", ".join(MODES))
    out: list[str] = []
    for name in names:
        if name == "all":
            chosen = list(BASIC_MODES)
        elif name in MODES:
            chosen = [name]
        else:
            raise UsageError(
                f"unknown mode {name!r}; choose 'all' or a comma list of: " + ", ".join(MODES)
            )
        out.extend(m for m in chosen if m not in out)
    return tuple(out)


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
    # How ids reach the main process: every batch (`batch`), once per epoch (`epoch`), or
    # `auto`: every batch up to PER_BATCH_GATHER_LIMIT steps per rank and epoch (trace.py).
    gather: str = "auto"
    # Seconds a rank waits on a collective before giving up (gloo's default is 30 minutes).
    timeout: float = DEFAULT_TIMEOUT

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
        if self.gather != "auto":
            args += ["--gather", self.gather]
        if self.timeout != DEFAULT_TIMEOUT:
            args += ["--timeout", f"{self.timeout:g}"]
        return args
