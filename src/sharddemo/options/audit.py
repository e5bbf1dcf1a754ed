"""The options of `audit`: what to audit (a factory, a Trainer, a LightningDataModule) and how
to walk it (AuditOptions), each refused alone in validate()."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sharddemo.errors import UsageError
from sharddemo.options.declare import command_line, option
from sharddemo.options.gather import GATHER_STRATEGIES
from sharddemo.options.run import DEFAULT_TIMEOUT, mesh_of
from sharddemo.targets import FACTORY_CALLS, parse_target

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

    # A device mesh, as NAME=SIZE,... (sharddemo.mesh.parse_mesh): formed with torch's
    # init_device_mesh over the launch's ranks and set as the Accelerator's device mesh
    # (rank/mesh.py); the factory is given it (docs/audit.md, "--mesh").
    mesh: Optional[str] = option(
        None, "--mesh",
        "Audit the loader on a device mesh of these dims, e.g. dp=2,tp=2 (world = the product "
        "of the sizes; data dims: those named dp, dp_replicate, dp_shard or fsdp; the others "
        "hold replica peers, which must receive the same batches). The mesh is torch's "
        "init_device_mesh, set as the accelerator's torch_device_mesh (so accelerator.prepare "
        "deals over it, as under ParallelismConfig, which refuses CPU); the factory gets it as "
        "make_loader(accelerator, mesh=...) where it takes a mesh parameter.", type=str,
        metavar="DIMS")

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
        if self.mesh is not None:
            mesh_of(self.mesh)
            if self.framework is not None:
                raise UsageError(f"--mesh audits a make_loader FACTORY; it does not go with "
                                 f"--{self.framework} (pass make_loader(accelerator, mesh))")
            if self.gather == "count":
                raise UsageError("--mesh compares each rank's batches with its peers', and "
                                 "--gather count keeps none: pass --gather epoch (or leave "
                                 "--gather out)")
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

