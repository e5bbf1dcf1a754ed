"""A report's modes on a device mesh (`compare --mesh`, `audit --mesh`): each epoch read twice.

Over the data-parallel groups, each counted once by its first rank (sharddemo.mesh's
project_record, as the watch counts them): coverage, duplicates and their reasons, order, the
verdicts and the conclusion. Over every rank: what each rank received (shown side by side with
its peers, labelled with its mesh coordinate), the step counts (a rank with fewer steps hangs
its whole mesh), ragged batches, workers and what accelerator.gather returned. And the peer
check: within each group every rank received the same batches at every step, compared id by
id (sharddemo.mesh.first_peer_difference)."""

from __future__ import annotations

from typing import Any, Optional, cast

from sharddemo.analysis.epoch import analyse_epoch, worker_shares
from sharddemo.analysis.types import EpochRecord, LoaderDescription, Trace, TraceMode
from sharddemo.analysis.views import EpochView, IdsEpoch, epoch_view, interleave_steps
from sharddemo.mesh import (MeshLayout, PEER_VERDICT, accelerate_mesh_words, first_peer_difference,
                            peer_verdict, project_record)

# what the ranks' own view of an epoch decides on a mesh (every rank, not one per group)
EVERY_RANK_KEYS = ("steps_equal", "hang_at_step", "ragged_steps", "ragged_step_count",
                   "gathered", "gathered_count", "workers", "idle_workers")
# gather_for_metrics drops what one world's padding added; on a mesh it gathers every peer's
# copy too, so the report states no figure for it
FOR_METRICS_KEYS = ("gathered_for_metrics", "gathered_for_metrics_count",
                    "gather_for_metrics_exact", "gather_for_metrics_equals_gather")


def mesh_layout(mesh: dict) -> MeshLayout:
    """The trace's mesh (rank.mesh.RankMesh.trace) as sharddemo.mesh's layout."""
    return MeshLayout(tuple(mesh["dims"]), tuple(mesh["sizes"]), tuple(mesh["data_dims"]),
                      tuple(tuple(c) for c in mesh["coords"]))


def report_mesh(mesh: dict) -> dict:
    """The report's `mesh`: the layout's description, the groups (their ranks by replica
    index) and every rank's place ('dp=0, tp=1')."""
    layout = mesh_layout(mesh)
    return {**layout.describe(), "groups": layout.groups(),
            "places": [layout.place(r) for r in range(layout.world)]}


def groups_trace(sized: Trace, layout: MeshLayout) -> Trace:
    """The trace's sizes over the data-parallel groups: the groups' count for the world, and
    the global batch of one rank per group (peers' batches are the same batch, not more)."""
    per_rank = sized["global_batch"] // max(sized["world_size"], 1)
    return cast(Trace, {**sized, "world_size": layout.data_size,
                        "global_batch": per_rank * layout.data_size, "mesh": None,
                        "groups": True})


def step_numbers(view: IdsEpoch) -> list[list[int]]:
    """Each rank's batches as numbers, one a step: equal batches (the same ids in the same
    order) get the same number, so peers compare exactly (no hash to collide)."""
    seen: dict[tuple, int] = {}
    return [[seen.setdefault(tuple(batch), len(seen)) for batch in batches]
            for batches in view.ranks]


def mesh_epochs(mode: str, sized: Trace, data: TraceMode,
                layout: MeshLayout) -> tuple[Trace, list[EpochView], list[dict], list[dict]]:
    """A mode's epochs on the mesh: (the trace over the groups, the groups' views, the report's
    epochs, the peer verdict of each epoch)."""
    n = sized["dataset_size"]
    loader = cast(Optional[LoaderDescription], data.get("loader"))
    groups = groups_trace(sized, layout)
    whole = [cast(IdsEpoch, epoch_view(record, n)) for record in data["epochs"]]
    views = [epoch_view(cast(EpochRecord, project_record(cast(dict, record), layout)), n)
             for record in data["epochs"]]
    epochs = [analyse_epoch(mode, groups, v, views[k - 1] if k else None, loader=loader,
                            hint=data.get("hint")) for k, v in enumerate(views)]
    mesh = layout.describe()
    verdicts = []
    for e, view in zip(epochs, whole):
        every_rank(e, view, layout, loader)
        finding = first_peer_difference(layout, step_numbers(view))
        e["peers_differ"] = finding
        verdicts.append(peer_verdict(mesh, finding, cast(Optional[dict], loader), e["epoch"]))
    return groups, views, epochs, verdicts


def every_rank(e: dict, view: IdsEpoch, layout: MeshLayout,
               loader: Optional[LoaderDescription]) -> None:
    """The epoch's per-rank parts from every rank's view (EVERY_RANK_KEYS), its ranks labelled
    with their mesh coordinates and groups, in place."""
    steps = view.steps
    ragged, ragged_total = view.ragged()
    own: dict[str, Any] = {"steps_equal": len(set(steps)) <= 1,
                           "hang_at_step": min(steps) if len(set(steps)) > 1 else None,
                           "ragged_steps": ragged, "ragged_step_count": ragged_total,
                           "gathered": interleave_steps(view.ranks) if view.gather == "batch"
                           else None,
                           "gathered_count": sum(view.samples)}
    if view.workers_known():
        own["workers"], own["idle_workers"] = worker_shares(
            view, int((loader or {}).get("num_workers") or 0),
            dispatched=bool((loader or {}).get("dispatcher")))
    for key in EVERY_RANK_KEYS:
        e.pop(key, None)
    for key in FOR_METRICS_KEYS:
        e.pop(key, None)
    e.update({k: v for k, v in own.items() if k in EVERY_RANK_KEYS})
    e["ranks"] = [{**entry, "mesh": layout.place(entry["rank"]),
                   "group": layout.data_index(entry["rank"]),
                   "counted": layout.replica_index(entry["rank"]) == 0}
                  for entry in view.rank_entries()]


def peer_problems(mode: str, verdicts: list[dict]) -> list[str]:
    """What `--check` fails on: each epoch whose peers received different batches."""
    return [f"{mode} epoch {v['epoch']}: {PEER_VERDICT}: {v['detail']}"
            for v in verdicts if not v["ok"]]


def mesh_note(mesh: dict, loader: Optional[dict], failed: bool) -> Optional[str]:
    """Why accelerate deals this mesh as it does, where a prepared loader failed on it
    (sharddemo.mesh.accelerate_mesh_words); None otherwise."""
    words = accelerate_mesh_words(mesh, loader)
    return words if words and failed else None
