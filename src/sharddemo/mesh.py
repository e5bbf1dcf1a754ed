"""A device mesh as the data sees it, pure (no torch): which ranks form one data-parallel group
(replica peers, which must receive the same batch at the same step) and which groups split
the epoch between them (docs/mesh.md).

A mesh of 4 ranks with dims (dp, tp) = (2, 2), laid out by torch as [[0, 1], [2, 3]]: rank 1
sits at (dp=0, tp=1), so ranks 0 and 1 are tp peers in data group 0, ranks 2 and 3 in data group
1. Each rank's place is read from the mesh's own layout (MeshLayout.coords), never from rank
arithmetic: a mesh may list tp first, or lay its ranks out in any order.

Shared by the watch (watching/mesh.py reads a torch DeviceMesh into a MeshLayout), the analysis
and `compare --mesh` (parse_mesh)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# the dims that split the data by default (torchtitan's and accelerate's names); every other
# dim of a mesh (tp, cp, pp, ep, ...) holds replica peers, which receive the same batches
DATA_DIM_NAMES = ("dp", "dp_replicate", "dp_shard", "fsdp")


@dataclass(frozen=True)
class MeshLayout:
    """A mesh's dims, their sizes, the data dims, and each rank's coordinates (by rank)."""

    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    data_dims: tuple[str, ...]
    coords: tuple[tuple[int, ...], ...]  # coords[r]: rank r's coordinate, one per dim

    @property
    def world(self) -> int:
        return len(self.coords)

    @property
    def replica_dims(self) -> tuple[str, ...]:
        return tuple(d for d in self.dims if d not in self.data_dims)

    def _flat(self, rank: int, dims: tuple[str, ...]) -> int:
        index = 0
        for d in dims:
            k = self.dims.index(d)
            index = index * self.sizes[k] + self.coords[rank][k]
        return index

    def data_index(self, rank: int) -> int:
        """Rank's data-parallel group: its data coordinates, flattened in the mesh's dim order."""
        return self._flat(rank, self.data_dims)

    def replica_index(self, rank: int) -> int:
        """Rank's place among its replica peers (0: the group's first, which speaks for it)."""
        return self._flat(rank, self.replica_dims)

    @property
    def data_size(self) -> int:
        size = 1
        for d in self.data_dims:
            size *= self.sizes[self.dims.index(d)]
        return size

    @property
    def replica_size(self) -> int:
        return self.world // self.data_size

    def representatives(self) -> list[int]:
        """The rank that speaks for each data group (replica index 0), by data index."""
        reps = {self.data_index(r): r for r in range(self.world) if self.replica_index(r) == 0}
        return [reps[g] for g in range(self.data_size)]

    def groups(self) -> list[list[int]]:
        """Each data group's ranks, by data index, each ordered by replica index."""
        groups: list[list[int]] = [[] for _ in range(self.data_size)]
        for r in sorted(range(self.world), key=self.replica_index):
            groups[self.data_index(r)].append(r)
        return groups

    def place(self, rank: int, dims: Optional[tuple[str, ...]] = None) -> str:
        """'dp=0, tp=1': rank's coordinates on `dims` (all of them by default)."""
        dims = self.dims if dims is None else dims
        return ", ".join(f"{d}={self.coords[rank][self.dims.index(d)]}" for d in dims)

    def shape(self) -> str:
        """'dp=2 x tp=2'."""
        return " x ".join(f"{d}={s}" for d, s in zip(self.dims, self.sizes))

    def describe(self) -> dict:
        """The mesh in the report: its dims and sizes, the data dims, the groups' count."""
        return {"dims": dict(zip(self.dims, self.sizes)), "data_dims": list(self.data_dims),
                "world": self.world, "data_groups": self.data_size,
                "replicas": self.replica_size}


def layout_of(dims: tuple[str, ...], sizes: tuple[int, ...], ranks_in_order: list[int],
              data_dims: Optional[tuple[str, ...]] = None) -> MeshLayout:
    """A MeshLayout from a mesh's dims, sizes and its ranks listed in row-major order (torch's
    `mesh.mesh.flatten().tolist()`): the rank at flat position p has the coordinates of p.
    `data_dims`: None for those in DATA_DIM_NAMES. Raises ValueError in one line where the
    mesh cannot be read (a dim not named, data dims it lacks, a rank missing or twice)."""
    if any(not isinstance(d, str) or not d for d in dims) or len(set(dims)) != len(dims):
        raise ValueError("the mesh's dims must be named, each once (init_device_mesh(..., "
                         f"mesh_dim_names=(\"dp\", \"tp\"))), got {dims!r}")
    if data_dims is None:
        data_dims = tuple(d for d in dims if d in DATA_DIM_NAMES)
    else:
        data_dims = tuple(data_dims)
        lacking = [d for d in data_dims if d not in dims]
        if lacking:
            raise ValueError(f"data_dims {list(data_dims)} names {', '.join(lacking)}, which the "
                             f"mesh lacks (its dims: {', '.join(dims)})")
        if len(set(data_dims)) != len(data_dims):
            raise ValueError(f"data_dims {list(data_dims)} names a dim twice")
        data_dims = tuple(d for d in dims if d in data_dims)  # (the mesh's order)
    world = 1
    for s in sizes:
        world *= s
    if sorted(ranks_in_order) != list(range(world)):
        raise ValueError(f"the mesh must hold each of ranks 0..{world - 1} once, got "
                         f"{ranks_in_order!r:.80}")
    coords: list[tuple[int, ...]] = [()] * world
    for position, rank in enumerate(ranks_in_order):
        coordinate, rest = [], position
        for s in reversed(sizes):
            coordinate.append(rest % s)
            rest //= s
        coords[rank] = tuple(reversed(coordinate))
    return MeshLayout(tuple(dims), tuple(sizes), data_dims, tuple(coords))


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """'dp=2,tp=2' -> (("dp", "tp"), (2, 2)); ValueError in one line where it is not that."""
    dims, sizes = [], []
    for part in text.split(","):
        match = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([0-9]+)\s*", part)
        if not match or int(match.group(2)) < 1:
            raise ValueError(f"{text!r} is not a mesh: give dims as NAME=SIZE joined by commas, "
                             "e.g. dp=2,tp=2")
        dims.append(match.group(1))
        sizes.append(int(match.group(2)))
    if len(set(dims)) != len(dims):
        raise ValueError(f"{text!r} names a dim twice")
    return tuple(dims), tuple(sizes)


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    """The first step (0-based) where two ranks' per-step hashes differ, a step one has and the
    other lacks included; None where they are equal."""
    for step, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return step
    return None if len(a) == len(b) else min(len(a), len(b))


def first_peer_difference(layout: MeshLayout, hashes: list[list[int]]) -> Optional[dict]:
    """Replica peers against their group's first rank, from every rank's per-step hashes
    (`hashes[r]`: rank r's, one per step of the epoch or window): None where every peer
    received the same batches at every step, else the first difference found (the lowest
    step, then the lowest group and rank): {"step", "rank", "peer", "dims", "group", "groups",
    "said"}. `step` counts from 0 within the epoch; `said` counts from 1, as the watch's window
    lines do; `groups`: how many data-parallel groups hold peers that differ."""
    best: Optional[tuple[int, int, int, list[str]]] = None  # step, rank, peer, dims
    differing = 0
    for group in layout.groups():
        first = group[0]
        found_here = False
        for other in group[1:]:
            step = first_difference(hashes[first], hashes[other])
            if step is None:
                continue
            found_here = True
            if best is None or step < best[0]:
                differ = [d for d in layout.replica_dims
                          if layout.coords[first][layout.dims.index(d)]
                          != layout.coords[other][layout.dims.index(d)]]
                best = (step, first, other, differ)
        differing += found_here
    if best is None:
        return None
    step, rank, peer, dims = best
    where = layout.place(rank, layout.data_dims) or "one data group"
    more = (f" (and peers in {differing - 1} more data-parallel group"
            f"{'s' if differing > 2 else ''} differ too)" if differing > 1 else "")
    said = (f"{'/'.join(dims)} peers ({where}) differ from step {step + 1}: rank {rank} "
            f"({layout.place(rank)}) and rank {peer} ({layout.place(peer)}) received different "
            f"batches{more}")
    return {"step": step, "rank": rank, "peer": peer, "dims": dims,
            "group": layout.data_index(rank), "groups": differing, "said": said}


# the verdict on a mesh: within each data-parallel group, every rank received the same batches
PEER_VERDICT = "peers-receive-the-same-batches"


def peer_verdict(mesh: dict, peers: Optional[dict], loader: Optional[dict], epoch: int) -> dict:
    """The peer verdict of an epoch or a window: `peers` None where every peer received the
    same batches (first_peer_difference's finding else), `mesh` the layout's describe(), `loader` the
    loader's description (a sampler split over the whole world is named as the cause)."""
    detail = ""
    if peers is not None:
        detail = peers["said"] + whole_world_words(mesh, loader)
    return {"verdict": PEER_VERDICT, "epoch": epoch, "ok": peers is None, "detail": detail}


def whole_world_words(mesh: dict, loader: Optional[dict]) -> str:
    """'' or why: the loader's sampler splits over every rank of the mesh, where it must split
    over the data-parallel groups (so that peers get the same batch)."""
    shards = (loader or {}).get("split_over")
    world, groups = mesh["world"], mesh["data_groups"]
    if shards != world or world == groups:
        return ""
    data = mesh["data_dims"]
    dim = (f"mesh[{data[0]!r}]" if len(data) == 1
           else f"mesh[{tuple(data)!r}]._flatten()")
    return (f" (the loader's sampler splits over all {world} ranks: on this mesh it must split "
            f"over the {groups} data-parallel groups, e.g. DistributedSampler(ds, "
            f"num_replicas={dim}.size(), rank={dim}.get_local_rank()))")


def project_record(record: dict, layout: MeshLayout) -> dict:
    """An epoch's record over every rank -> over the data-parallel groups: each group's first
    rank, numbered by group (its peers counted no ids: their parts are left out). The record
    is not changed in place."""
    reps = layout.representatives()
    by_rank = {part["rank"]: part for part in record["ranks"]}
    out = dict(record, ranks=[dict(by_rank[rep], rank=g) for g, rep in enumerate(reps)])
    if isinstance(record.get("remainder"), list):
        out["remainder"] = [record["remainder"][rep] for rep in reps]
    return out


# accelerate's prepare_data_loader(torch_device_mesh=) splits over the dims of these names only
ACCELERATE_DATA_DIMS = ("dp_replicate", "dp_shard")
ACCELERATE_REPLICA_DIMS = ("tp", "cp")


def accelerate_mesh_words(mesh: dict, loader: Optional[dict]) -> str:
    """'' or why a loader accelerate prepared with this mesh deals as it does: it splits over
    the dims named dp_replicate and dp_shard only (a data dim named otherwise is not split),
    and takes the data rank as rank // (tp x cp), which assumes tp and cp are the mesh's last
    dims (a mesh that lists them first gets peers in different groups)."""
    if not (loader or {}).get("prepared"):
        return ""
    dims = list(mesh["dims"])
    words = []
    unsplit = [d for d in mesh["data_dims"] if d not in ACCELERATE_DATA_DIMS]
    if unsplit:
        words.append(f"accelerate's prepare_data_loader(torch_device_mesh=) splits the data only "
                     f"over dims named {' and '.join(ACCELERATE_DATA_DIMS)}: this mesh's "
                     f"{', '.join(unsplit)} is not split (name it dp_replicate or dp_shard)")
    inner = [d for d in dims if d in ACCELERATE_REPLICA_DIMS]
    if inner and dims[len(dims) - len(inner):] != inner:
        words.append("accelerate's prepare_data_loader(torch_device_mesh=) takes the data rank "
                     f"as rank // ({' x '.join(inner)}), which holds only where "
                     f"{' and '.join(inner)} {'is' if len(inner) == 1 else 'are'} the mesh's "
                     f"last dim{'s' if len(inner) > 1 else ''}; this mesh is ordered "
                     f"({', '.join(dims)})")
    return "; ".join(words)


# the verdicts a mesh's misreading by the loader shows in: the first that fails carries the cause
MESH_CAUSE_VERDICTS = (PEER_VERDICT, "no-silent-replication", "no-missing-samples",
                       "no-unexplained-duplicates")


def explain_on_mesh(verdicts: list[dict], mesh: dict, loader: Optional[dict]) -> None:
    """The loader's misreading of the mesh (accelerate_mesh_words), added once, to the first
    failed verdict it explains."""
    cause = accelerate_mesh_words(mesh, loader)
    if not cause:
        return
    for name in MESH_CAUSE_VERDICTS:
        for v in verdicts:
            if v["verdict"] == name and not v["ok"]:
                v["detail"] += f" ({cause})"
                return
