"""transformers.Trainer: the train and eval loaders its own methods build on this rank.

`make_trainer()` returns a Trainer (model, arguments and datasets as the user has them). The
Trainer builds its own Accelerator, which shares this rank's process group; its
`get_train_dataloader()` and `get_eval_dataloader()` build and `accelerator.prepare` the
loaders, and sharddemo walks them. No training step runs and no optimizer is made.
"""

from __future__ import annotations

from typing import Any

from sharddemo.rank.frameworks import Audited, call_factory
from sharddemo.errors import RunFailed, UsageError

# The TrainingArguments that decide how the data is split, shown in the report where set.
TRAIN_ARGUMENTS = ("per_device_train_batch_size", "per_device_eval_batch_size",
                   "gradient_accumulation_steps", "dataloader_drop_last",
                   "dataloader_num_workers", "seed", "data_seed", "train_sampling_strategy",
                   "group_by_length", "length_column_name", "world_size")
DATALOADER_CONFIG = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler")


def start_epoch(loader) -> Any:
    """Do what Trainer._run_epoch does before it iterates epoch `epoch` (transformers 5).

    Set the epoch on the prepared loader, and on the batch sampler that accelerate's
    BatchSamplerShard wraps (DataLoaderShard.set_epoch does not reach it)."""

    def call(epoch: int) -> None:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        inner = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)

    return call


def settings(trainer) -> dict:
    args = trainer.args
    out = {name: getattr(args, name) for name in TRAIN_ARGUMENTS if hasattr(args, name)}
    if out.get("train_sampling_strategy") is not None:
        out["train_sampling_strategy"] = str(getattr(out["train_sampling_strategy"], "value",
                                                     out["train_sampling_strategy"]))
    config = trainer.accelerator.dataloader_config
    out.update({f"accelerator.{name}": getattr(config, name) for name in DATALOADER_CONFIG
                if hasattr(config, name)})
    return {k: v for k, v in out.items() if v is None or isinstance(v, (bool, int, float, str))}


def trainer_loaders(accelerator, factory, opts) -> list[Audited]:
    from transformers import Trainer

    from sharddemo.rank.tagging import tagging_prepare

    trainer = call_factory(factory, opts.target)
    if not isinstance(trainer, Trainer):
        raise UsageError(f"the factory {opts.target} returned a {type(trainer).__name__}, not a "
                         "transformers.Trainer; --trainer takes make_trainer() -> Trainer")
    world = trainer.args.world_size
    if world != accelerator.num_processes:
        raise RunFailed(f"the Trainer sees world size {world}, the launch has "
                        f"{accelerator.num_processes} ranks: build the TrainingArguments inside "
                        "make_trainer(), not at import time")
    shown = settings(trainer)
    accumulate = opts.grad_accum or trainer.args.gradient_accumulation_steps
    out = []
    # Every loader the Trainer passes to its accelerator's prepare is tagged on its way in, as
    # `audit` does for a user's own accelerator.
    with tagging_prepare(trainer.accelerator, record_indices=opts.id_field is None):
        if trainer.train_dataset is not None:
            train = _built(trainer.get_train_dataloader, "get_train_dataloader")
            out.append(Audited("trainer:train", train, opts.epochs,
                               f"Trainer.get_train_dataloader() from {opts.target}",
                               role="train", start_epoch=start_epoch(train), settings=shown,
                               grad_accum=accumulate))
        evals = trainer.eval_dataset
        names = list(evals) if isinstance(evals, dict) else [None] if evals is not None else []
        for name in names:
            loader = _built(lambda: trainer.get_eval_dataloader(name), "get_eval_dataloader")
            mode = "trainer:eval" if name is None else f"trainer:eval:{name}"
            out.append(Audited(mode, loader, 1,
                               f"Trainer.get_eval_dataloader({'' if name is None else repr(name)})"
                               f" from {opts.target}", role="eval", settings=shown))
    if not out:
        raise UsageError(f"the Trainer from {opts.target} has neither a train_dataset nor an "
                         "eval_dataset: there is no loader to audit")
    return out


def _built(method, name: str):
    try:
        return method()
    except Exception as exc:
        raise RunFailed(f"Trainer.{name}() raised {type(exc).__name__}: {exc}") from exc
