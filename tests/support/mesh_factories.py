"""Loader factories for `sharddemo audit --mesh` (tests/ranks/test_compare_mesh.py): each writes the
mesh it was given and the ids it deals, so the test can check them against torch's own
DistributedSampler."""

import json
import os

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

N = 12


def world_sampler(accelerator, mesh):
    """The mesh bug: a DistributedSampler over every rank of the world, so tp peers receive
    different batches. Writes what it was given (the mesh's dims and this rank's coordinate,
    as torch's DeviceMesh says) beside the report."""
    assert mesh is accelerator.torch_device_mesh, "the factory's mesh is the accelerator's"
    out = os.environ["MESH_FACTORY_OUT"]
    with open(os.path.join(out, f"given{accelerator.process_index}.json"), "w") as handle:
        json.dump({"dims": list(mesh.mesh_dim_names), "coordinate": mesh.get_coordinate()},
                  handle)
    dataset = TensorDataset(torch.arange(N))
    sampler = DistributedSampler(dataset, num_replicas=accelerator.num_processes,
                                 rank=accelerator.process_index, shuffle=False)
    return DataLoader(dataset, batch_size=2, sampler=sampler)
