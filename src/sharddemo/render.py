"""Report -> text: a terminal table, JSON, or markdown. Nothing here computes a figure."""

from __future__ import annotations

import json


def _ids(ids) -> str:
    return "[" + " ".join(str(i) for i in ids) + "]"


def _short(ids, limit: int = 16) -> str:
    if not ids:
        return "-"
    shown = " ".join(str(i) for i in ids[:limit])
    return shown + (f" ... ({len(ids)})" if len(ids) > limit else "")


def header(report: dict) -> list[str]:
    return [
        f"world size {report['world_size']} ({report.get('distributed_type')}, backend "
        f"{report['backend']}) | dataset {report['dataset_size']} | per-rank batch "
        f"{report['batch_size']} | global batch {report['global_batch']} | "
        f"{report['epochs']} epoch(s) | seed {report['seed']}",
    ]


def _epoch_summary(e: dict) -> list[str]:
    lines = [
        f"seen {e['seen']} = {e['times_dataset']:g}x the dataset | unique {e['unique']} | "
        f"missing {_short(e['missing'])} | duplicated "
        + _short([d['id'] for d in e['duplicates']])
    ]
    if e["duplicates"]:
        lines.append(f"why duplicated: {e['duplicates'][0]['reason']}"
                     + ("" if e["duplicates_explained"] else " (does NOT account for all of them)"))
    if e.get("gathered") is not None:
        g = f"accelerator.gather returned {len(e['gathered'])}"
        if "gathered_for_metrics" in e and e["gathered_for_metrics"] is not None:
            exact = "exactly the dataset" if e["gather_for_metrics_exact"] else "NOT the dataset"
            g += f", gather_for_metrics {len(e['gathered_for_metrics'])} ({exact})"
        lines.append(g)
    else:
        lines.append("not gathered per batch: the ranks had unequal step counts")
    if not e["steps_equal"]:
        lines.append("UNEQUAL step counts across ranks: DDP training would hang on this")
    order = []
    if e["order_changed"] is not None:
        order.append("order changed from the previous epoch" if e["order_changed"]
                     else "SAME order as the previous epoch")
    if len(e["ranks"]) > 1 and e["ranks_same_order"]:
        order.append("all ranks walked the same order")
    if order:
        lines.append("; ".join(order))
    return lines


def render_table(report: dict) -> str:
    out = ["sharddemo compare: " + header(report)[0]]
    if report.get("launch_command"):
        out.append(f"rerun by hand: {report['launch_command']}")
    for mode, data in report["modes"].items():
        out.append("")
        out.append(f"== {mode}: {data['description']}")
        for e in data["epochs"]:
            out.append(f"  epoch {e['epoch']}")
            for r in e["ranks"]:
                batches = " ".join(_ids(b) for b in r["batches"]) or "(nothing)"
                out.append(f"    rank {r['rank']}  {r['steps']} step(s): {batches}")
            out += ["    " + line for line in _epoch_summary(e)]
        out.append(f"  => {data['conclusion']}")
        for problem in data["broken_promises"]:
            out.append(f"  !! {problem}")
    return "\n".join(out) + "\n"


def render_markdown(report: dict) -> str:
    out = ["# sharddemo compare", "", header(report)[0], ""]
    if report.get("launch_command"):
        out += [f"Rerun by hand: `{report['launch_command']}`", ""]
    for mode, data in report["modes"].items():
        out += [f"## {mode}", "", data["description"], "",
                "| epoch | rank | steps | ids per batch |", "|---|---|---|---|"]
        for e in data["epochs"]:
            for r in e["ranks"]:
                batches = " ".join(_ids(b) for b in r["batches"]) or "(nothing)"
                out.append(f"| {e['epoch']} | {r['rank']} | {r['steps']} | {batches} |")
        out.append("")
        for e in data["epochs"]:
            out.append(f"- epoch {e['epoch']}: " + "; ".join(_epoch_summary(e)))
        out += ["", f"**{data['conclusion']}**", ""]
        for problem in data["broken_promises"]:
            out.append(f"- broken: {problem}")
    return "\n".join(out).rstrip() + "\n"


def render_json(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=False) + "\n"


RENDERERS = {"table": render_table, "json": render_json, "markdown": render_markdown}


def render(report: dict, fmt: str) -> str:
    return RENDERERS[fmt](report)
