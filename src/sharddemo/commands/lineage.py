"""`sharddemo lineage DIR`: which samples each rank received at a step, or where a sample was
received, read from the lineage a watched run wrote (sharddemo.lineage reads it)."""

from __future__ import annotations

import json
from typing import Any, Optional

import click

from sharddemo.errors import UsageError
from sharddemo.lineage import Lineage


def lineage_command(folder: str, step: Optional[int], rank: Optional[int], epoch: Optional[int],
                    sample: Optional[int], fmt: str) -> None:
    """`sharddemo lineage` from the command line: --step K's batches (or --id ID's places) on
    every rank, a rank whose written lineage ends before them named, in `fmt`."""
    if (step is None) == (sample is None):
        raise UsageError("give one of --step K or --id ID")
    if sample is not None and (rank is not None or epoch is not None):
        raise UsageError("--rank and --epoch go with --step, not --id")
    found = Lineage(folder)
    if step is not None:
        batches, missing = found.lookup(step, rank, epoch)
        result: dict[str, Any] = {"step": step, "epoch": epoch, "batches": batches,
                                  "not_written": missing}
        mesh = found.mesh_at(batches[0]["step"]) if batches else None

        def place(r: int) -> str:
            return f" ({mesh.place(r)})" if mesh is not None and r < mesh.world else ""

        lines = [f"rank {b['rank']}{place(b['rank'])} epoch {b['epoch']} step {b['step']}: "
                 + ("ids not known (the watch could not attribute this batch)"
                    if b["ids"] is None else
                    f"{len(b['ids'])} samples"
                    + (f", {b['tokens']:,} tokens" if "tokens" in b else "")
                    + f": {' '.join(map(str, b['ids']))}")
                 for b in batches]
        lines = [line for _, line in sorted(
            [(b["rank"], line) for b, line in zip(batches, lines)]
            + [(m["rank"], m["note"]) for m in missing], key=lambda pair: pair[0])]
        if mesh is not None:
            result["mesh"] = mesh_words(mesh, batches)
            for b in batches:
                if b["rank"] < mesh.world:
                    b["coordinate"] = dict(zip(mesh.dims, mesh.coords[b["rank"]]))
            lines += [g["said"] for g in result["mesh"]["peers"]]
    else:
        assert sample is not None  # (one of --step and --id: refused above otherwise)
        hits = found.where(sample)
        outside = found.outside(sample)
        if outside and not hits:
            raise UsageError(outside)
        written = [{"rank": r, "last_step": ends[1] if ends else None}
                   for r in found.ranks() for ends in [found.written(r)]]
        result = {"id": sample, "received": hits, "written": written}
        ends = ", ".join(f"rank {w['rank']} up to step {w['last_step']}"
                         if w["last_step"] is not None else f"rank {w['rank']} nothing"
                         for w in written)
        lines = ([f"epoch {h['epoch']} step {h['step']} rank {h['rank']}" for h in hits]
                 or [f"id {sample}: not in the written lineage (written: {ends})"])
        if hits and len({w["last_step"] for w in written}) > 1:
            # the ranks' lineages end at different steps (unequal step counts, or a crash):
            # what is listed is what is written, and where each rank's written part ends
            lines.append(f"(written: {ends})")
        if outside:  # held all the same: ids the watch found outside the dataset
            click.echo(f"Warning: id {outside[len('--id '):]}, yet the lineage holds it (an "
                       "id_field that gave ids outside the dataset)", err=True)
    for r, size in found.torn().items():
        click.echo(f"Warning: rank{r}.lineage ends in a chunk cut short ({size} bytes, a "
                   "crash while it was written): skipped", err=True)
    click.echo(json.dumps(result) if fmt == "json" else "\n".join(lines))


def mesh_words(mesh, batches: list[dict]) -> dict:
    """The step on a device mesh: its dims, and each data-parallel group's ranks (its replica
    peers, which must have received the same batch), whether those shown did, and which of
    them received alike (`alike`: the shown ranks by equal batch), in a sentence."""
    ids = {b["rank"]: b["ids"] for b in batches}
    peers = []
    for group in mesh.groups():
        shown = [r for r in group if r in ids]
        alike: dict[str, list[int]] = {}
        for r in shown:
            alike.setdefault(json.dumps(ids[r]), []).append(r)
        same = len(alike) <= 1 if shown else None
        where = mesh.place(group[0], mesh.data_dims) or "one data group"
        verdict = ("not shown" if same is None else "the same batch" if same
                   else "DIFFERENT batches: " + "; ".join(
                       f"ranks {', '.join(map(str, rs))} alike" if len(rs) > 1 else
                       f"rank {rs[0]} its own" for rs in alike.values()))
        peers.append({"ranks": group, "group": dict(
            (d, mesh.coords[group[0]][mesh.dims.index(d)]) for d in mesh.data_dims),
            "same": same, "alike": list(alike.values()),
            "said": f"peers ({where}): ranks {', '.join(map(str, group))}: {verdict}"})
    return {"dims": dict(zip(mesh.dims, mesh.sizes)), "data_dims": list(mesh.data_dims),
            "peers": peers}
