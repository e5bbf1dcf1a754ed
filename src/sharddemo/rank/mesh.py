"""`--mesh` on a rank: the device mesh formed with torch's init_device_mesh over the launch's
ranks, read into sharddemo.mesh's layout (the mesh's own coordinates), and handed to accelerate
as its torch_device_mesh.

accelerate 1.16's ParallelismConfig is what gives an Accelerator its mesh, and it refuses
MULTI_CPU ("only compatible with FSDP2, Multi{Device} or DeepSpeed"). So on every device the
mesh is torch's, set as the accelerator's state's device_mesh: `accelerator.prepare(loader)`
then calls `prepare_data_loader(..., torch_device_mesh=mesh)`, as it does under
ParallelismConfig, with the Accelerator's own PartialState (an uninitialised PartialState would
read every rank as process 0 of 1)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from sharddemo.errors import UsageError
from sharddemo.mesh import MeshLayout, layout_of
from sharddemo.options import mesh_of


@dataclass
class RankMesh:
    """The run's mesh on this rank: torch's DeviceMesh, its layout, and this rank."""

    device_mesh: Any
    layout: MeshLayout
    rank: int

    @property
    def data_split(self) -> tuple[int, int]:
        """(num_replicas, rank) of a sampler over the data-parallel groups: the groups' count
        and this rank's data coordinate (its peers share it)."""
        return self.layout.data_size, self.layout.data_index(self.rank)

    def trace(self) -> dict:
        """The mesh in the trace: describe()'s fields, the sizes in the dims' order, and every
        rank's coordinate (by rank), as torch laid the mesh out."""
        return {**self.layout.describe(), "sizes": list(self.layout.sizes),
                "coords": [list(c) for c in self.layout.coords]}


def form_mesh(text: str, accelerator) -> RankMesh:
    """The mesh `text` (--mesh) over this launch's ranks, set as the accelerator's device mesh.
    One Error line, on every rank alike, where the launch's world is not the mesh's."""
    from torch.distributed.device_mesh import init_device_mesh

    dims, sizes = mesh_of(text)
    world = 1
    for size in sizes:
        world *= size
    if accelerator.num_processes != world:
        raise UsageError(f"--mesh {text} holds {world} ranks but this launch has "
                         f"{accelerator.num_processes}: launch {world} processes")
    mesh = init_device_mesh(accelerator.device.type, sizes, mesh_dim_names=dims)
    layout = layout_of(dims, sizes, [int(r) for r in mesh.mesh.flatten().tolist()])
    # what ParallelismConfig would set (Accelerator.torch_device_mesh reads it): prepare()
    # then deals over the mesh
    accelerator.state.device_mesh = mesh
    return RankMesh(mesh, layout, accelerator.process_index)


def call_with_mesh(factory: Callable, mesh: RankMesh, *args: Any) -> Any:
    """The user's make_loader(accelerator), given the mesh as `mesh=` where it takes one (a
    parameter named mesh, or **kwargs); else it reads accelerator.torch_device_mesh."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        params = []  # (a builtin or C callable: called as the protocol says)
    takes = any(p.name == "mesh" or p.kind is p.VAR_KEYWORD for p in params)
    return factory(*args, mesh=mesh.device_mesh) if takes else factory(*args)
