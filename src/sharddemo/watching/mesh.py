"""The watch on a device mesh, this rank's side: the mesh read from torch's DeviceMesh
(read_mesh), each step's ids hashed for the peer check (PeerLog), and the check itself, one
small exchange (peer_exchange). The layout and the judgement are sharddemo.mesh's (pure).

On a mesh, only each data-parallel group's first rank (replica index 0) counts its batches in
the watch's recorder; its peers count steps with no ids, so that every count (coverage,
repeats, the windows' ids) is over groups, each once; and every rank hashes the ids of each
step it received, so that peers are compared step by step."""

from __future__ import annotations

import zlib
from array import array
from typing import Optional

import numpy as np
import torch

from sharddemo.mesh import MeshLayout, layout_of, first_peer_difference


def read_mesh(mesh, data_dims, world: int) -> MeshLayout:
    """The layout of torch's DeviceMesh `mesh` (its dim names, sizes and its ranks as laid
    out: the mesh's own coordinates). ValueError in one line where it is no mesh of this run's
    ranks, or lacks `data_dims`."""
    names = getattr(mesh, "mesh_dim_names", None)
    layout_tensor = getattr(mesh, "mesh", None)
    if not torch.is_tensor(layout_tensor):
        raise TypeError("sharddemo.watch: mesh must be a torch.distributed DeviceMesh "
                        "(init_device_mesh(...)), got "
                        f"{type(mesh).__name__}")
    if not names:
        raise ValueError("sharddemo.watch: the mesh's dims have no names: build it with "
                         "init_device_mesh(..., mesh_dim_names=(\"dp\", \"tp\")) so that the "
                         "watch can tell data dims from the others")
    sizes = tuple(int(s) for s in layout_tensor.shape)
    ranks = [int(r) for r in layout_tensor.flatten().tolist()]
    if len(ranks) != world or sorted(ranks) != list(range(world)):
        raise ValueError(f"sharddemo.watch: the mesh holds {len(ranks)} ranks "
                         f"({' x '.join(f'{d}={s}' for d, s in zip(names, sizes))}) but the run "
                         f"has {world}: give the mesh of every rank of the run (a submesh, such "
                         "as mesh['dp'], is not the run's mesh)")
    if isinstance(data_dims, str):
        data_dims = (data_dims,)
    try:
        return layout_of(tuple(names), sizes, ranks,
                         None if data_dims is None else tuple(data_dims))
    except ValueError as error:
        raise ValueError(f"sharddemo.watch: {error}") from None


def mesh_of(accelerator) -> Optional[object]:
    """The accelerator's own device mesh (accelerate's ParallelismConfig), or None."""
    try:
        return getattr(accelerator, "torch_device_mesh", None)
    except Exception:  # (a property that needs state the accelerator lacks)
        return None


class PeerLog:
    """The ids of each step this rank received, as one 32-bit hash a step (CRC-32 of the ids in
    order, with their count), and the chain of them so far. The ids are kept as they come and
    hashed in bulk (settle): at a window's exchange, the epoch's end, or every SETTLE_EVERY
    steps, with one copy to the host."""

    SETTLE_EVERY = 256

    def __init__(self) -> None:
        self.hashes = array("I")  # one a step of the open epoch
        self.pending: list = []  # ids tensors (1-D: a step; 2-D: a block of steps)
        self.pending_steps = 0

    def add(self, ids: torch.Tensor) -> None:
        self.pending.append(ids)
        self.pending_steps += 1 if ids.dim() == 1 else ids.shape[0]
        if self.pending_steps >= self.SETTLE_EVERY:
            self.settle()

    def settle(self) -> None:
        """Hash the steps kept so far (one copy to the host for all of them)."""
        if not self.pending:
            return
        pending, self.pending, self.pending_steps = self.pending, [], 0
        for ids in pending:
            block = ids.detach().to("cpu", torch.int64).numpy()
            rows = block.reshape(1, -1) if block.ndim == 1 else block.reshape(block.shape[0], -1)
            for row in rows:
                row = np.ascontiguousarray(row)
                self.hashes.append(zlib.crc32(row.tobytes(), row.size & 0xFFFFFFFF))

    @property
    def steps(self) -> int:
        return len(self.hashes) + self.pending_steps

    def chain(self) -> int:
        """One int for every step so far: peers with the same batches have the same."""
        self.settle()
        return zlib.crc32(self.hashes.tobytes(), len(self.hashes) & 0xFFFFFFFF)

    def reset(self) -> None:
        self.hashes = array("I")
        self.pending, self.pending_steps = [], 0


def peer_exchange(ranks, layout: MeshLayout, log: PeerLog,
                  chains: Optional[list[int]] = None) -> Optional[dict]:
    """Peers compared, on every rank alike: where every rank's chain (exchanged here, or given
    in `chains`, by rank) equals its group's first rank's, None with no more exchange; else
    every rank's hashes are exchanged once and the first difference returned
    (sharddemo.mesh.first_peer_difference)."""
    from sharddemo.rank.collect import collective, exchange_ints, exchange_objects

    if chains is None:
        chains = [row[0] for row in exchange_ints(ranks, [log.chain()])]
    if all(chains[g[0]] == chains[r] for g in layout.groups() for r in g):
        return None
    log.settle()
    mine = log.hashes.tolist()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        hashes: list = [None] * dist.get_world_size()
        collective(dist.all_gather_object, hashes, mine)
    else:
        hashes = exchange_objects(ranks, mine)
    return first_peer_difference(layout, hashes)
