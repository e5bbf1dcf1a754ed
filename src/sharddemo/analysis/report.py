"""Turn a trace (what the ranks did) into a report (what it means).

Every mode's epochs analysed (analysis.epoch), its verdicts and conclusion (analysis.verdicts), the
ranks' placement. Plain data in, plain data out, no torch: tested without processes."""

from __future__ import annotations

from typing import Any, Optional, cast

from sharddemo.analysis.keys import keys_section, name_epoch, name_windows
from sharddemo.analysis.epoch import analyse_epoch
from sharddemo.analysis.modes import global_batch, is_audit_mode, mode_kind
from sharddemo.analysis.verdicts import (audit_verdicts, broken_promises, conclude,
                                         raised_promise, raised_sentence, raised_verdict)
from sharddemo.analysis.types import Trace, TraceMode
from sharddemo.analysis.views import IdsEpoch, epoch_view
from sharddemo.analysis.accumulation import accumulation_windows, window_counts
from sharddemo.analysis.mesh import (groups_trace, mesh_epochs, mesh_layout, mesh_note, peer_problems,
                                     report_mesh)
from sharddemo.mesh import explain_on_mesh

REPORT_SCHEMA = "sharddemo.report/1"


def build_report(trace: Trace, *, launch_command: Optional[str] = None,
                 config_file: Optional[str] = None, keys: Optional[dict] = None,
                 key_field: Optional[str] = None) -> dict:
    """Trace (what the ranks did) -> report (what it means). Deterministic for a given trace.

    Args:
        trace: what the ranks wrote (docs/trace.schema.json).
        launch_command: the line to rerun the launch by hand, shown in the report.
        config_file: the accelerate config the launch used.
        keys: where the samples are named by key, analysis.keys.number_keys's names (the
            trace numbered by it): every epoch names its samples by key before its verdicts.
        key_field: the id field that held the keys.

    Returns the report of docs/report.md (docs/report.schema.json).

    Example::

        import json
        from sharddemo.analysis import build_report
        report = build_report(json.load(open("trace.json")))  # `sharddemo run --trace-out`
        print(report["modes"]["prepared"]["conclusion"])
    """
    modes: dict[str, Any] = {}
    problems: list[str] = []
    layout = mesh_layout(trace["mesh"]) if trace.get("mesh") else None
    mesh = layout.describe() if layout is not None else {}
    for mode, data in trace["modes"].items():
        # A framework's loaders differ in N and batch (train vs eval): each mode's own sizes.
        sized = cast(Trace, {**trace, **data.get("sizes", {})})
        if data.get("raised") and not data["epochs"]:
            modes[mode] = raised_mode(mode, data, sized)
            problems += modes[mode]["broken_promises"]
            continue
        n = sized["dataset_size"]
        peers = None
        if layout is not None:  # counted over the data-parallel groups, peers compared
            sized, views, epochs, peers = mesh_epochs(mode, sized, data, layout)
        else:
            views = [epoch_view(record, n) for record in data["epochs"]]
            epochs = [analyse_epoch(mode, sized, v, views[k - 1] if k else None,
                                    loader=data.get("loader"), hint=data.get("hint"))
                      for k, v in enumerate(views)]
        if keys is not None:
            for e in epochs:
                name_epoch(e, keys["names"], keys.get("outside"))
        if is_audit_mode(mode):
            verdicts = audit_verdicts(sized, epochs, role=data.get("role", "train"),
                                      prepared=data.get("prepared", False),
                                      loader=data.get("loader"),
                                      set_epoch_called=data.get("set_epoch_called", False))
            where = "" if mode == "audit" else f"{mode} "
            broken = [f"{where}{v['verdict']} (epoch {v['epoch']}): {v['detail']}"
                      for v in verdicts if not v["ok"]]
        else:
            verdicts = None
            broken = broken_promises(mode, sized, epochs)
        if peers is not None:
            if verdicts is not None:  # (an audit: a verdict like the others, as the watch's)
                verdicts += peers
                explain_on_mesh(verdicts, mesh, cast(Optional[dict], data.get("loader")))
            broken += peer_problems(mode, peers)
        conclusion = conclude(mode, sized, epochs, data.get("loader"))
        if data.get("raised"):  # after the epochs above, on every rank
            conclusion = (raised_sentence(data["raised"], sized["world_size"]) + " Before it: "
                          + conclusion[0].lower() + conclusion[1:])
            broken.append(raised_promise(mode, data["raised"]))
            if verdicts is not None:
                verdicts.append(raised_verdict(data["raised"]))
        problems += broken
        modes[mode] = {
            "description": data.get("description", ""),
            "kind": mode_kind(mode, sized),
            "prepared": data.get("prepared", False),
            "loader": data.get("loader"),
            "epochs": epochs,
            "streams": data.get("streams"),
            "fingerprint": data.get("fingerprint"),
            "broken_promises": broken,
            "conclusion": conclusion,
        }
        if data.get("raised"):
            modes[mode]["raised"] = data["raised"]
        if "sizes" in data:
            modes[mode].update(data["sizes"])
        for key in ("role", "settings", "note"):
            if key in data:
                modes[mode][key] = data[key]
        if data.get("grad_accum"):
            k = data["grad_accum"]
            for e, v in zip(epochs, views):
                # (a view not counted is the ids view)
                e["grad_accum"] = (accumulation_windows(cast(IdsEpoch, v).ranks, k)
                                   if v.gather != "count" else
                                   {**window_counts(v.steps, k), "counted": True})
                if keys is not None and v.gather != "count":
                    name_windows(e["grad_accum"], keys["names"])
        if verdicts is not None:
            modes[mode]["verdicts"] = verdicts
        elif peers is not None:
            modes[mode]["peers"] = peers
        if peers is not None:
            note = mesh_note(mesh, cast(Optional[dict], data.get("loader")), bool(broken))
            if note:
                modes[mode]["note"] = note
    placement = trace.get("placement") or [
        {"rank": r, "local_rank": r, "node": 0, "host": None} for r in range(trace["world_size"])]
    nodes: dict[str, list[int]] = {}
    for p in placement:
        nodes.setdefault(str(p["node"]), []).append(p["rank"])
    for data in modes.values():
        for e in data["epochs"]:
            e["by_node"] = {node: sum(e["ranks"][r]["samples"] for r in ranks)
                            for node, ranks in nodes.items()}
    report = {
        "schema": REPORT_SCHEMA,
        "world_size": trace["world_size"],
        "backend": trace["backend"],
        "distributed_type": trace.get("distributed_type"),
        "device": trace.get("device"),
        "dataset_size": trace["dataset_size"],
        "batch_size": trace["batch_size"],
        "batch_size_seen": bool(trace.get("batch_size_seen", False)),
        "global_batch": global_batch(trace),
        "epochs": trace["epochs"],
        "seed": trace["seed"],
        "source": trace.get("source", "toy"),
        "options": trace.get("options", {}),
        "config_file": config_file,
        "launch_command": launch_command,
        "placement": placement,
        "nodes": nodes,
        "modes": modes,
        "broken_promises": problems,
    }
    if trace.get("mesh"):
        report["mesh"] = report_mesh(trace["mesh"])
        # a step's samples are one rank's batch per data-parallel group: peers share theirs
        report["global_batch"] = groups_trace(trace, mesh_layout(trace["mesh"]))["global_batch"]
    if keys is not None:
        if keys["seen"] is None:  # counted: the most distinct keys an epoch delivered
            keys = dict(keys, seen=max((e["unique"] for m in modes.values()
                                        for e in m["epochs"]), default=0))
        report["keys"] = keys_section(keys, key_field)
    if trace.get("fingerprint") is not None:
        report["fingerprint"] = trace["fingerprint"]
    if "timings" in trace:
        report["timings"] = trace["timings"]
    return report


def raised_mode(mode: str, data: TraceMode, sized: Trace) -> dict:
    """Return the report of a mode whose loader raised before any epoch completed.

    It has no epochs; the conclusion quotes the error. Where the mode raises by design
    (trace.probe_loader: WebDataset's default nodesplitter refuses more than one rank, the refusal
    that mode exists to show) it breaks no promise; a loader that raised inside a library where it
    should have walked (walk.settle, on every rank) breaks its mode's promise (--check fails, naming
    it) and, audited, fails the verdict loader-runs-every-epoch."""
    raised = data["raised"]
    # (a trace written before the walk could raise: its entries have no epoch, all by design)
    by_design = bool(data.get("raises_by_design")) or "epoch" not in raised[0]
    if by_design:
        world = sized["world_size"]
        ranks = ("every rank" if len(raised) == world else
                 "rank " + ", ".join(str(r["rank"]) for r in raised))
        conclusion = (f"The loader raised on {ranks} before its first batch, so no epoch "
                      f"runs: {raised[0]['error']}.")
    else:
        conclusion = raised_sentence(raised, sized["world_size"])
    out = {
        "description": data.get("description", ""),
        "kind": mode_kind(mode, sized),
        "prepared": data.get("prepared", False),
        "loader": data.get("loader"),
        "epochs": [],
        "streams": data.get("streams"),
        "fingerprint": data.get("fingerprint") if not by_design else None,
        "raised": raised,
        "broken_promises": [] if by_design else [raised_promise(mode, raised)],
        "conclusion": conclusion,
    }
    if "sizes" in data:
        out.update(data["sizes"])
    for key in ("role", "settings", "note"):
        if key in data:
            out[key] = data[key]
    if is_audit_mode(mode):
        out["verdicts"] = [raised_verdict(raised)]
    return out
