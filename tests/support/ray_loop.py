"""The loop tests/ranks/test_ray.py runs in each Ray Train worker (a module of its own: Ray's workers
import it by name)."""

from __future__ import annotations

import contextlib
import io
import json
import os

import torch
from torch.utils.data import DistributedSampler, TensorDataset


def watched_loop(config: dict) -> None:
    """A Ray Train loop as a user writes one: prepare_data_loader, set_epoch each epoch, the
    loader watched (with config["lineage"], a lineage folder, where given). Each worker logs
    the ids its loop received, per epoch, and the lines the watch printed there (the rank-0
    worker's)."""
    import ray.train
    import ray.train.torch
    from torch.utils.data import DataLoader

    from sharddemo import watch

    rank = ray.train.get_context().get_world_rank()
    data = TensorDataset(torch.arange(config["n"]))
    # config["replicas"]: a DistributedSampler of the user's for that many replicas (rank 0),
    # which prepare_data_loader keeps
    sampler = (DistributedSampler(data, config["replicas"], 0, shuffle=True, seed=0)
               if config.get("replicas") else None)
    loader = watch(ray.train.torch.prepare_data_loader(
        DataLoader(data, batch_size=config["batch"], shuffle=sampler is None, sampler=sampler)),
        report=config["report"], on_violation=config.get("on_violation", "warn"),
        lineage=config.get("lineage"))
    got = []
    with contextlib.redirect_stdout(io.StringIO()) as printed:  # the watch's lines
        for epoch in range(config["epochs"]):
            if config["set_epoch"]:
                loader.sampler.set_epoch(epoch)
            got.append([batch[0].tolist() for batch in loader])
    with open(f"{config['log']}/rank{rank}.json", "w") as out:
        json.dump({"type": type(loader).__name__, "batches": got, "cwd": os.getcwd(),
                   "printed": printed.getvalue().splitlines()}, out)


def shipped_loop(config: dict) -> None:
    """A Ray Train loop over a loader the driver made (and watched) and shipped in
    train_loop_config: prepare_data_loader, set_epoch each epoch. Each worker logs the ids
    its loop received, per epoch."""
    import ray.train
    import ray.train.torch

    rank = ray.train.get_context().get_world_rank()
    loader = ray.train.torch.prepare_data_loader(config["loader"])
    got = []
    for epoch in range(config["epochs"]):
        loader.sampler.set_epoch(epoch)
        got.append([batch[0].tolist() for batch in loader])
    with open(f"{config['log']}/rank{rank}.json", "w") as out:
        json.dump({"batches": got}, out)


def watched_rows(config: dict) -> None:
    """A Ray Train loop over Ray Data, as a user writes one: the worker's shard of the
    "train" dataset, read with iter_torch_batches, watched with its "id" column. Once
    (config["per_epoch"] False): one iterable, iterated each epoch; else iter_torch_batches()
    called, and watched, each epoch; config["drop_last"] is iter_torch_batches' drop_last.
    Each worker logs the ids its loop received, per epoch, and the lines the watch printed
    there."""
    import ray.train

    from sharddemo import watch

    rank = ray.train.get_context().get_world_rank()
    shard = ray.train.get_dataset_shard("train")

    def batches():
        return watch(shard.iter_torch_batches(batch_size=config["batch"],
                                              drop_last=config.get("drop_last", False)),
                     id_field="id", dataset_size=config["n"], report=config["report"],
                     on_violation=config.get("on_violation", "warn"))

    once = None if config["per_epoch"] else batches()
    got = []
    with contextlib.redirect_stdout(io.StringIO()) as printed:  # the watch's lines
        for _ in range(config["epochs"]):
            got.append([batch["id"].tolist() for batch in (once or batches())])
    with open(f"{config['log']}/rank{rank}.json", "w") as out:
        json.dump({"iterator": type(shard).__name__, "batches": got,
                   "printed": printed.getvalue().splitlines()}, out)
