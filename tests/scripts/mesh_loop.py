"""A user's loop on a device mesh, launched by torchrun (tests/ranks/test_watch_mesh.py): it builds
its meshes with torch's init_device_mesh (gloo), makes each loader as a user would, watches
it with sharddemo.watch(..., mesh=), and logs the ids every step received, with each rank's
mesh coordinate, so that the test checks the watch against what the loop really got.

    torchrun --nproc-per-node 4 tests/scripts/mesh_loop.py OUT CASE [CASE ...]

A CASE is NAME:DIMS:SIZES:LOADER[:WORKERS], e.g. ok:dp,tp:2,2:sampler:0. LOADER:
- sampler: a DistributedSampler over the data dims (the data coordinate from the mesh);
- world: a DistributedSampler over every rank (the bug: peers get different batches);
- seeds: over the data dims, but each cp coordinate shuffles with its own seed (the bug);
- batch: over the data dims, but the rank at tp=1 takes batches of 2, not 4 (the bug);
- flat-batch: no mesh given to the watch, a sampler over every rank, rank 1 with batches of 2;
- prepared: accelerate's prepare_data_loader(DataLoader(shuffle=True), torch_device_mesh=mesh);
- save, load: a resume (see resume), on an Accelerator(cpu=True) over the same ranks;
  load-flat: the same checkpoint loaded with no mesh (a DistributedSampler over every rank);
- submesh, nodims: watch() given the mesh's first dim alone, or data_dims the mesh lacks: the
  ValueError each rank got is logged.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from sharddemo import watch

N, BATCH, EPOCHS = 24, 4, 2


class Ints(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


def data_coordinate(mesh, data_dims):
    """This rank's data-parallel index and the groups' count, from the mesh's coordinates."""
    coordinate = mesh.get_coordinate()
    index, size = 0, 1
    for d in data_dims:
        k = mesh.mesh_dim_names.index(d)
        index = index * mesh.mesh.shape[k] + coordinate[k]
        size *= mesh.mesh.shape[k]
    return index, size


def make_loader(mesh, kind, workers):
    names = mesh.mesh_dim_names
    data_dims = [d for d in names if d in ("dp", "dp_replicate", "dp_shard")]
    rank, size = data_coordinate(mesh, data_dims)
    coordinate = dict(zip(names, mesh.get_coordinate()))
    if kind == "prepared":
        from accelerate import PartialState
        from accelerate.data_loader import prepare_data_loader
        from accelerate.utils import set_seed

        # (accelerate's state must know the ranks: uninitialized, prepare_data_loader takes
        # every rank for process 0 of 1, and every data group gets the same shard)
        PartialState(cpu=True)
        set_seed(0)  # (called directly, prepare_data_loader does not synchronize the shuffle)
        return prepare_data_loader(DataLoader(Ints(), batch_size=BATCH, shuffle=True,
                                              num_workers=workers),
                                   torch_device_mesh=mesh, put_on_device=False), None
    seed = coordinate.get("cp", 0) if kind == "seeds" else 0
    if kind == "flat-batch":  # no mesh for the watch: a flat world where rank 1 takes 2 a batch
        sampler = DistributedSampler(Ints(), shuffle=True, seed=0)
        return DataLoader(Ints(), batch_size=2 if dist.get_rank() == 1 else BATCH,
                          sampler=sampler, num_workers=workers), sampler
    if kind == "world":
        sampler = DistributedSampler(Ints(), shuffle=True, seed=0)
    else:
        sampler = DistributedSampler(Ints(), num_replicas=size, rank=rank, shuffle=True,
                                     seed=seed)
    batch = 2 if kind == "batch" and coordinate.get("tp") == 1 else BATCH
    return DataLoader(Ints(), batch_size=batch, sampler=sampler, num_workers=workers), sampler


SAVED_AT = 2  # the resume cases: the first launch saves after this many steps of epoch 0


def resume(out, name, mesh, kind, log) -> None:
    """save: epoch 0's first SAVED_AT steps, accelerate's save_state (the watch's state goes
    with it), then the process ends; load: load_state, skip_first_batches(SAVED_AT), the rest
    of epoch 0, then epoch 1. A DistributedSampler over the data dims."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    flat = kind == "load-flat"
    loader, sampler = make_loader(mesh, "world" if flat else "sampler", 0)
    loader = watch(loader, accelerator, name=name, mesh=None if flat else mesh,
                   report=os.path.join(out, "report.jsonl"), check_every=2)
    where = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    checkpoint = os.path.join(out, f"checkpoint-{name}")
    if kind.startswith("load"):
        accelerator.load_state(checkpoint)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        first = SAVED_AT if kind.startswith("load") and epoch == 0 else 0
        batches = accelerator.skip_first_batches(loader, first) if first else loader
        for step, batch in enumerate(batches, start=first):
            log.append({"case": name, "epoch": epoch, "step": step,
                        "ids": torch.as_tensor(batch).tolist(), "coordinate": where})
            if kind == "save" and step + 1 == SAVED_AT:
                accelerator.save_state(checkpoint)
                return
    loader.close()


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = []
    for case in cases:
        name, dims, sizes, kind, *rest = case.split(":")
        workers = int(rest[0]) if rest else 0
        mesh = init_device_mesh("cpu", tuple(int(s) for s in sizes.split(",")),
                                mesh_dim_names=tuple(dims.split(",")))
        if kind in ("submesh", "nodims"):  # refused at watch(), on every rank
            try:
                watch(DataLoader(Ints(), batch_size=BATCH), name=name,
                      mesh=mesh[mesh.mesh_dim_names[0]] if kind == "submesh" else mesh,
                      data_dims=["dp", "ep"] if kind == "nodims" else None, report=None)
            except ValueError as error:
                log.append({"case": name, "error": str(error)})
            continue
        if kind in ("save", "load", "load-flat"):
            resume(out, name, mesh, kind, log)
            continue
        loader, sampler = make_loader(mesh, kind, workers)
        loader = watch(loader, name=name, mesh=None if kind == "flat-batch" else mesh,
                       report=os.path.join(out, "report.jsonl"),
                       check_every=2, lineage=os.path.join(out, f"lineage-{name}"))
        for epoch in range(EPOCHS):
            if sampler is not None:
                sampler.set_epoch(epoch)
            elif hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            for step, batch in enumerate(loader):
                log.append({"case": name, "epoch": epoch, "step": step,
                            "ids": torch.as_tensor(batch).tolist(),
                            "coordinate": dict(zip(mesh.mesh_dim_names,
                                                   mesh.get_coordinate()))})
        loader.close()
    with open(os.path.join(out, f"ids{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "log": log}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
