"""The loop tests/test_ray.py runs in each Ray Train worker (a module of its own: Ray's workers
import it by name)."""

from __future__ import annotations

import json
import os

import torch
from torch.utils.data import TensorDataset


def watched_loop(config: dict) -> None:
    """A Ray Train loop as a user writes one: prepare_data_loader, set_epoch each epoch, the
    loader watched. Each worker logs the ids its loop received, per epoch."""
    import ray.train
    import ray.train.torch
    from torch.utils.data import DataLoader

    from sharddemo import watch

    rank = ray.train.get_context().get_world_rank()
    data = TensorDataset(torch.arange(config["n"]))
    loader = watch(ray.train.torch.prepare_data_loader(
        DataLoader(data, batch_size=config["batch"], shuffle=True)), report=config["report"],
        on_violation=config.get("on_violation", "warn"))
    got = []
    for epoch in range(config["epochs"]):
        if config["set_epoch"]:
            loader.sampler.set_epoch(epoch)
        got.append([batch[0].tolist() for batch in loader])
    with open(f"{config['log']}/rank{rank}.json", "w") as out:
        json.dump({"type": type(loader).__name__, "batches": got, "cwd": os.getcwd()}, out)
