"""Lightning: the loaders a LightningDataModule gives each rank, through Lightning's own code.

The train and val loaders, under `Trainer(strategy="ddp")`.

`make_datamodule()` returns a LightningDataModule, or `(datamodule, trainer_kwargs)` to pass
Trainer arguments such as `use_distributed_sampler=False`. On every rank sharddemo builds a
Lightning Trainer for this launch (strategy "ddp", this rank's devices and nodes), attaches the
datamodule, and does what `Trainer.fit` does before its first step: `prepare_data` (Lightning's
data connector, on the ranks it chooses), the `setup("fit")` hook, then each loader hook through
Lightning's `_request_dataloader` and `_process_dataloader` (which inject the
DistributedSampler), and `_set_sampler_epoch` at the top of each epoch, as the fit loop does.
These are Lightning's internal functions (checked with lightning 2.6); no step is trained.
"""

from __future__ import annotations

import importlib
import os
from functools import partial

from sharddemo.rank.frameworks import Audited, call_factory
from sharddemo.errors import RunFailed, UsageError

# Arguments sharddemo sets for the launch; a factory's trainer_kwargs cannot change them.
FIXED = ("accelerator", "strategy", "devices", "num_nodes")


def _package(obj) -> str:
    """Return `lightning.pytorch` or `pytorch_lightning`, whichever the datamodule comes from.

    A Trainer of the other package would not accept it."""
    for cls in type(obj).__mro__:
        if cls.__module__.startswith("pytorch_lightning"):
            return "pytorch_lightning"
    return "lightning.pytorch"


def _modules(package: str) -> dict:
    fabric = "lightning_fabric" if package == "pytorch_lightning" else "lightning.fabric"
    names = {"pl": package,
             "data": f"{package}.trainer.connectors.data_connector",
             "call": f"{package}.trainer.call",
             "states": f"{package}.trainer.states",
             "combined": f"{package}.utilities.combined_loader",
             "fabric_data": f"{fabric}.utilities.data"}
    try:
        return {key: importlib.import_module(name) for key, name in names.items()}
    except ImportError as exc:
        raise RunFailed(f"this Lightning has no {exc.name}: sharddemo uses Lightning 2.x's own "
                        "data connector; install lightning>=2.6,<3") from exc


def lightning_loaders(accelerator, factory, opts) -> list[Audited]:
    made = call_factory(factory, opts.target)
    datamodule, extra = (made if isinstance(made, tuple) and len(made) == 2
                         and isinstance(made[1], dict) else (made, {}))
    package = _package(datamodule)
    try:
        m = _modules(package)
    except ModuleNotFoundError:  # the other package than the one installed
        raise UsageError(f"the datamodule comes from {package}, which is not installed")
    pl = m["pl"]
    if not isinstance(datamodule, pl.LightningDataModule):
        raise UsageError(f"the factory {opts.target} returned a {type(datamodule).__name__}, not "
                         "a LightningDataModule; --lightning takes make_datamodule() -> "
                         "LightningDataModule (or (datamodule, trainer_kwargs))")
    fixed = sorted(set(extra) & set(FIXED))
    if fixed:
        raise UsageError(f"trainer_kwargs from {opts.target} set {', '.join(fixed)}, which the "
                         "launch decides (strategy ddp on the launched ranks); leave them out")
    world = accelerator.num_processes
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    kwargs = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, max_epochs=opts.epochs)
    kwargs.update(extra)
    try:
        trainer = pl.Trainer(accelerator="gpu" if accelerator.device.type == "cuda" else "cpu",
                             strategy="ddp", devices=local, num_nodes=max(1, world // local),
                             **kwargs)
    except Exception as exc:
        raise RunFailed(f"Lightning's Trainer cannot be built for this launch: "
                        f"{type(exc).__name__}: {exc}") from exc
    sampler_kwargs = trainer.strategy.distributed_sampler_kwargs or {}
    if (sampler_kwargs.get("num_replicas"), sampler_kwargs.get("rank")) != \
            (world, accelerator.process_index):
        raise RunFailed(f"Lightning sees this rank as {sampler_kwargs}, the launch as rank "
                        f"{accelerator.process_index} of {world}")
    data, states = m["data"], m["states"]
    connector = trainer._data_connector
    try:
        connector.attach_datamodule(None, datamodule=datamodule)
        connector.prepare_data()
        m["call"]._call_lightning_datamodule_hook(trainer, "setup", stage="fit")
    except Exception as exc:
        raise RunFailed(f"the datamodule's prepare_data/setup raised {type(exc).__name__}: "
                        f"{exc}") from exc
    shown = {"use_distributed_sampler": trainer._accelerator_connector.use_distributed_sampler,
             "strategy": type(trainer.strategy).__name__, "num_replicas": world,
             "seed (PL_GLOBAL_SEED)": int(os.environ.get("PL_GLOBAL_SEED", 0))}
    fit = states.TrainerFn.FITTING
    out = []
    running = states.RunningStage
    hooks = (("train", "train_dataloader", trainer.fit_loop._data_source, running.TRAINING,
              "max_size_cycle", opts.epochs),
             ("val", "val_dataloader", trainer.fit_loop.epoch_loop.val_loop._data_source,
              running.VALIDATING, "sequential", 1))
    for role, hook, source, stage, combine, epochs in hooks:
        if not source.is_defined():
            continue
        try:
            requested = data._request_dataloader(source)
            combined = (requested if isinstance(requested, m["combined"].CombinedLoader)
                        else m["combined"].CombinedLoader(requested, combine))
            loaders = [data._process_dataloader(trainer, fit, stage, dl)
                       for dl in combined.flattened]
        except Exception as exc:
            raise RunFailed(f"the datamodule's {hook}() through Lightning raised "
                            f"{type(exc).__name__}: {exc}") from exc
        for i, (loader, written) in enumerate(zip(loaders, combined.flattened)):
            sampler = type(getattr(loader, "sampler", None)).__name__
            mode = f"lightning:{role}" + (f":{i}" if len(loaders) > 1 else "")
            out.append(Audited(mode, loader, epochs, f"{hook}() of {opts.target} under Lightning's "
                               "Trainer(strategy='ddp')", role="eval" if role == "val" else "train",
                               # the fit loop's call at the top of each epoch
                               start_epoch=partial(m["fabric_data"]._set_sampler_epoch, loader),
                               settings={**shown, "sampler": sampler},
                               grad_accum=opts.grad_accum if role == "train" else None,
                               note=shuffle_note(written, loader)))
    if not out:
        raise UsageError(f"the datamodule from {opts.target} defines neither train_dataloader "
                         "nor val_dataloader: there is no loader to audit")
    return out


def shuffle_note(written, processed):
    """Return the report's sentence where Lightning shuffles a loader the user wrote unshuffled.

    Where the loader the user wrote does not shuffle (shuffle=False: a SequentialSampler) and
    the one Lightning made of it does (its _process_dataloader asks a shuffling
    DistributedSampler for every train loader). Else None."""
    from torch.utils.data import DistributedSampler, SequentialSampler

    theirs = getattr(processed, "sampler", None)
    if not (isinstance(getattr(written, "sampler", None), SequentialSampler)
            and isinstance(theirs, DistributedSampler) and theirs.shuffle):
        return None
    return ("your train_dataloader() has shuffle=False, but Lightning gives every train loader "
            f"a shuffling {type(theirs).__name__} (use_distributed_sampler): the order below is "
            "shuffled each epoch. To keep yours, pass use_distributed_sampler=False and a "
            "DistributedSampler(shuffle=False) of your own")
