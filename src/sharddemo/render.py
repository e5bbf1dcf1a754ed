"""Report -> text: a terminal table, JSON, or markdown. Nothing here computes a figure."""

from __future__ import annotations

import json

from sharddemo.analysis.idtext import ids_text
from sharddemo.plot import grid_lines
from sharddemo.sizes import SIZES, batch_ways, own_sizes_line


def _batch(ids, limit: int = 0) -> str:
    """Return one batch's ids in brackets, cut to `limit` (0: all of them)."""
    return ids_text(ids, limit or len(ids), sep=" ", more=" ...", brackets=True)


# Up to this many samples per rank and epoch every batch is printed in full.
FULL_LIMIT = 64


def batches_text(batches: list) -> str:
    """A rank's batches, whole when small, else the first two and a count."""
    if not batches:
        return "(nothing)"
    if sum(len(b) for b in batches) <= FULL_LIMIT:
        return " ".join(_batch(b) for b in batches)
    head = " ".join(_batch(b, 8) for b in batches[:2])
    return f"{head} ... ({len(batches)} batches, {sum(len(b) for b in batches)} samples)"


def rank_text(rank: dict) -> str:
    """Return a rank's batches in an epoch as text.

    All of them where the report lists them, else (a counted epoch keeps only its first and last
    batches) the first two and the counts."""
    if "batches" in rank:
        return batches_text(rank["batches"])
    first = rank["first_batches"]
    if rank["steps"] <= len(first) + len(rank["last_batches"]):  # it kept every batch
        return batches_text(first + rank["last_batches"])
    head = " ".join(_batch(b, 8) for b in first[:2])
    return f"{head} ... ({rank['steps']} batches, {rank['samples']} samples)"


def _listed(ids) -> str:
    """Return up to 16 ids, with how many there are where there are more ("-" for none)."""
    return ids_text(ids, 16, sep=" ", more=" ... ({total})", empty="-")


def _command(report: dict) -> str:
    """`audit` for a report with verdicts (an audit of any kind), else `compare`."""
    return "audit" if any("verdicts" in m for m in report["modes"].values()) else "compare"


def header(report: dict) -> list[str]:
    # batch_size is the batch as given, which with split_batches accelerate slices over the ranks
    per_rank = report["global_batch"] // batch_ways(report)
    up_to = "up to " if report.get("batch_size_seen") else ""  # the largest batch seen
    if _command(report) == "audit":
        # an audit takes no seed: the loader's own, where its sampler has one to read
        seed = (report.get("fingerprint") or {}).get("seed")
        seeded = f"sampler seed {'unknown' if seed is None else seed}"
    else:
        seeded = f"seed {report['seed']}"
    return [
        f"world size {report['world_size']} ({report.get('distributed_type')}, backend "
        f"{report['backend']}) | dataset {report['dataset_size']} | per-rank batch "
        f"{up_to}{per_rank} | global batch {report['global_batch']} | {report['epochs']} "
        f"epoch(s) | {seeded}" + (f" | {mesh_words(report['mesh'])}" if report.get("mesh")
                                  else ""),
    ]


def mesh_words(mesh: dict) -> str:
    """'mesh dp=2 x tp=2: data dims dp, 2 data-parallel groups [0 1] [2 3] (counted once
    each; replica peers tp must receive the same batches)'."""
    shape = " x ".join(f"{d}={s}" for d, s in mesh["dims"].items())
    replica = [d for d in mesh["dims"] if d not in mesh["data_dims"]]
    groups = " ".join("[" + " ".join(map(str, g)) + "]" for g in mesh["groups"])
    peers = (f"; replica peers {'/'.join(replica)} must receive the same batches" if replica
             else "")
    return (f"mesh {shape}: data dims {', '.join(mesh['data_dims']) or 'none'}, "
            f"{mesh['data_groups']} data-parallel group(s) {groups} (counted once each{peers})")


def rank_name(rank: dict) -> str:
    """'rank 1', or on a mesh 'rank 1 (dp=0, tp=1)'."""
    return f"rank {rank['rank']}" + (f" ({rank['mesh']})" if "mesh" in rank else "")


def side_by_side(e: dict) -> list[dict]:
    """An epoch's ranks, on a mesh each data group's peers together (by group, then replica
    index: the order of report["mesh"]["groups"], which the ranks' `group` gives)."""
    return sorted(e["ranks"], key=lambda r: (r.get("group", 0), not r.get("counted", True),
                                              r["rank"]))


def _counted(ids: list[int], total=None) -> str:
    """Return a short list, with how many there are when it was cut.

    The count path keeps lists short."""
    if not ids and total:
        return f"{total:,} (not named: the samples' keys are not known)"
    if total is None or total <= len(ids):
        return _listed(ids)
    return ids_text(ids, min(16, len(ids)), total=total, sep=" ", more=" ... ({total:,})")


def _epoch_summary(e: dict) -> list[str]:
    lines = [
        f"seen {e['seen']} = {e['times_dataset']:g}x the dataset | unique {e['unique']} | "
        f"missing {_counted(e['missing'], e.get('missing_count'))} | duplicated "
        + _counted([d['id'] for d in e['duplicates']], e.get('duplicate_count'))
    ]
    if e["missing_count"]:
        why = e["reasons"].get(e["missing_reason"]) if e["missing_reason"] else None
        lines.append(f"why missing: {why}" if why else
                     "why missing: NO reason: a sharded loader lost these samples")
    if e["duplicates"]:
        codes = list(dict.fromkeys(c for d in e["duplicates"]
                                   for c in d.get("causes") or [d["reason"]]))
        copies = set(codes) <= {"replication", "stream-replication", "worker-replication"}
        lines.append("why duplicated: " + "; ".join(e["reasons"][c] for c in codes)
                     + ("" if e["duplicates_explained"] else
                        " (a fault: the loader is meant to shard)" if copies else
                        " (does NOT account for all of them)"))
    if e["gather"] == "count":
        g = (f"counted on the ranks, one reduce of per-sample counts: {e['gathered_count']} "
             "received in all")
    else:
        how = "every batch" if e["gather"] == "batch" else "each rank's epoch at once"
        g = f"accelerator.gather ({how}) returned {e['gathered_count']}"
    if e.get("gathered_for_metrics_count") is not None:
        data = "the loader's data" if e["missing_reason"] == "subset" else "the dataset"
        exact = (f"exactly {data}" if e["gather_for_metrics_exact"] else
                 "the same as gather, NOT the dataset" if e["gather_for_metrics_equals_gather"]
                 else "NOT the dataset")
        g += f", gather_for_metrics {e['gathered_for_metrics_count']} ({exact})"
    elif "gathered_for_metrics_count" in e:
        g += ", gather_for_metrics never reached the last step (a rank ran out of batches first)"
    lines.append(g)
    if not e["steps_equal"]:
        steps = [r["steps"] for r in e["ranks"]]
        lines.append(f"UNEQUAL step counts across ranks {steps}: a training loop hangs at step "
                     f"{e['hang_at_step']} (sharddemo kept every rank answering)")
    elif e.get("ragged_steps"):
        lines.append(f"batch sizes differ between ranks at step(s) "
                     f"{_counted(e['ragged_steps'], e.get('ragged_step_count'))}: "
                     "a plain accelerator.gather of them fails on gloo")
    shown = [w for w in e.get("workers", []) if w["worker"] >= 0]
    if shown:
        by_rank: dict[int, list[str]] = {}
        for w in shown:
            by_rank.setdefault(w["rank"], []).append(
                f"worker {w['worker']} {w['samples']} ({w['share']:.0%})")
        lines.append("workers: " + "; ".join(f"rank {r}: " + ", ".join(v)
                                             for r, v in by_rank.items()))
    if e.get("idle_workers"):
        lines.append("IDLE workers (made nothing): " + ", ".join(
            f"rank {w['rank']} worker {w['worker']}" for w in e["idle_workers"]))
    if len(e.get("by_node", {})) > 1:
        lines.append("by node: " + ", ".join(f"node {k} saw {v}" for k, v in e["by_node"].items()))
    order = []
    if e["order_changed"] is not None:
        order.append("order changed from the previous epoch" if e["order_changed"]
                     else "SAME order as the previous epoch")
    if len(e["ranks"]) > 1 and e["ranks_same_order"]:
        order.append("all ranks walked the same order")
    if order:
        lines.append("; ".join(order))
    return lines


def resume_lines(resume: dict) -> list[str]:
    """Return the resume audit in words: each restart, then each epoch over the whole chain.

    Each restart: where it stopped and went on, on how many ranks, what came again and what was
    lost there, why; then per epoch over the whole chain what came twice and what never came."""
    lines = [resume["explanation"]]
    for r in resume.get("restarts", []):
        skip = r["skipped"]
        lost = (f"skipped {skip['count']} {_listed(skip['ids'])}" if skip is not None
                else "skipped: not attributable (each launch drew its own order)")
        lines.append(f"restart {r['restart']}: {r['reason']} | received before per rank "
                     f"{r['received_before']}, after {r['received_after']} | repeated "
                     f"{r['repeated']['count']} {_listed(r['repeated']['ids'])}"
                     + (f" ({r['fill']} of them fill)" if r["fill"] else "") + f" | {lost}")
    for e in resume["epochs"]:
        rep, skip = e["repeated"], e["skipped"]
        order = {True: "same order", False: "ORDER DIFFERS", None: "order not compared"}
        fill = e.get("fill")
        lines.append(f"epoch {e['epoch']}: repeated {rep['count']} {_listed(rep['ids'])} | "
                     f"skipped {skip['count']} {_listed(skip['ids'])} | "
                     + (f"fill of {fill['world_size']} ranks: {fill['repeated']} repeated, "
                        f"{fill['skipped']} skipped | " if fill else "")
                     + (f"WHOLE EPOCH {e['whole'].upper()} | " if e.get("whole") else "")
                     + f"seen {e['seen']} of {e['reference_seen']} | "
                     f"{order[e['order_equal']]}")
    return lines


RESUME_TITLE = ("the prepared loader stopped, saved, restarted in fresh processes and resumed, "
                "against the uninterrupted run")


def resume_demo_lines(rows: list[dict]) -> list[str]:
    """Return the lines of `compare --modes resume`: one per scenario, then where to read more.

    One line per scenario: workers, stop, strategy, each epoch's repeats and skips; then where
    the rows are explained (docs/resume.md)."""
    out = []
    for r in rows:
        at = r["at"]
        cells = []
        for e in r["epochs"]:
            rep, skip = e["repeated"]["count"], e["skipped"]["count"]
            order = {True: "same order", False: "OTHER ORDER", None: "-"}[e["order_equal"]]
            cells.append(f"epoch {e['epoch']}: {'exact' if e['resume_exact'] else 'NOT exact'}"
                         f" ({rep} repeated, {skip} skipped, {order})")
        out.append(f"workers {r['workers']} | stop {at['epoch']}:{at['step']} | "
                   f"{r['strategy']:<8} | " + " | ".join(cells)
                   + f" | resume-exact {'yes' if r['resume_exact'] else 'NO'}")
    out.append("(docs/resume.md explains each row; audit --resume-at runs it on your loader)")
    return out


def stream_line(streams: dict) -> str:
    """The shard arithmetic of an HF stream, as datasets computes it."""
    text = (f"stream of {streams['files']} file(s): {streams['how']}; files per rank "
            f"{streams['files_per_rank']}")
    if streams["num_workers"]:
        text += f", per worker {streams['files_per_worker']}"
    if streams["idle_workers"]:
        text += "; IDLE workers (no file): " + ", ".join(
            f"rank {w['rank']} worker {w['worker']}" for w in streams["idle_workers"])
    return text


def placement_line(report: dict) -> str:
    """`node 0 (host): rank 0 (local 0), rank 1 (local 1) | node 1 ...`, for several nodes."""
    parts = []
    for node, ranks in report.get("nodes", {}).items():
        where = {p["rank"]: p for p in report["placement"]}
        host = where[ranks[0]].get("host")
        parts.append(f"node {node}" + (f" ({host})" if host else "") + ": " + ", ".join(
            f"rank {r} (local {where[r]['local_rank']})" for r in ranks))
    return " | ".join(parts)


def render_table(report: dict) -> str:
    out = [f"sharddemo {_command(report)}: " + header(report)[0]]
    if len(report.get("nodes", {})) > 1:
        out.append("ranks by node: " + placement_line(report))
    if report.get("launch_command"):
        out.append(f"rerun by hand: {report['launch_command']}")
    if report.get("resume"):
        out += ["", "== resume: " + RESUME_TITLE]
        out += ["  " + line for line in resume_demo_lines(report["resume"])]
        if report.get("resume_left_out"):
            out.append(f"  left out: {report['resume_left_out']}")
    for mode, data in report["modes"].items():
        out.append("")
        out.append(f"== {mode}: {data['description']}")
        if data.get("streams"):
            out.append("  " + stream_line(data["streams"]))
        if (data.get("fingerprint") or {}).get("disagreement"):
            out.append(f"  fingerprint: {data['fingerprint']['disagreement']} (an audit would "
                       "stop here)")
        out += [f"  note: {note}" for note in _notes(data)]
        own = own_sizes_line(report, data)
        if data.get("settings"):
            out.append("  " + settings_line(data))
        elif own:
            out.append("  " + own)
        view = {**report, **{k: data[k] for k in SIZES if k in data}}
        for e in data["epochs"]:
            out.append(f"  epoch {e['epoch']}")
            for r in side_by_side(e):
                out.append(f"    {rank_name(r)}  {r['steps']} step(s): {rank_text(r)}")
            out += ["    " + line for line in grid_lines(view, e)]
            out += ["    " + line for line in _epoch_summary(e)]
            out += ["    " + line for line in window_lines(e.get("grad_accum"))]
        out.append(f"  => {data['conclusion']}")
        if data.get("peers"):
            out += ["  " + line for line in verdict_lines(data["peers"])]
        if data.get("resume"):
            out += ["", "  resume:"] + ["    " + line for line in resume_lines(data["resume"])]
        if "verdicts" in data:
            out += ["", "  verdicts:"] + ["    " + line for line in verdict_lines(data["verdicts"])]
        for problem in data["broken_promises"]:
            out.append(f"  !! {problem}")
    return "\n".join(out) + "\n"


def settings_line(data: dict) -> str:
    """The arguments that decide the split, as the framework holds them, and N and B."""
    sizes = ", ".join(f"{k} {data[k]}" for k in SIZES if k in data)
    shown = ", ".join(f"{k}={v}" for k, v in data["settings"].items())
    return f"{sizes} | {shown}" if sizes else shown


def window_lines(windows: dict | None, show: int = 4) -> list[str]:
    """Gradient accumulation: the ids of the first optimizer steps and of the last."""
    if not windows:
        return []
    k = windows["k"]
    lines = [f"grad accumulation {k} batches per optimizer step: {windows['optimizer_steps']} "
             f"optimizer step(s) per epoch, steps per rank {windows['steps_per_rank']}"
             + ("" if windows.get("partition", True) else
                " (the windows do NOT cover each rank's epoch)")]
    if windows.get("counted"):
        lines.append("  (this epoch was counted: which ids each optimizer step took is not "
                     "kept; --gather epoch or batch lists them)")
    listed = windows.get("windows", [])
    picked = listed if len(listed) <= show else listed[:show - 1] + listed[-1:]
    for w in picked:
        if w is listed[-1] and len(listed) > show:
            lines.append("  ...")
        ranks = " | ".join(f"rank {r}: {_listed(ids)}" for r, ids in enumerate(w["ranks"]))
        lines.append(f"  optimizer step {w['window']}: {ranks} ({w['samples']} samples)")
    if windows["uneven_last"]:
        lines.append(f"  the last optimizer step is UNEVEN: {windows['last_batches']} batch(es) "
                     f"per rank instead of {k}")
    if windows.get("in_several_windows"):
        lines.append(f"  ids in more than one optimizer step: {_listed(windows['in_several_windows'])}")
    return lines


def verdict_lines(verdicts: list) -> list[str]:
    """One line per verdict: PASS, or FAIL with the epochs and what went wrong."""
    order: list[str] = []
    for v in verdicts:
        if v["verdict"] not in order:
            order.append(v["verdict"])
    lines = []
    for name in order:
        mine = [v for v in verdicts if v["verdict"] == name]
        failed = [v for v in mine if not v["ok"]]
        if not failed:
            lines.append(f"PASS {name}")
        else:
            epochs = ", ".join(str(v["epoch"]) for v in failed)
            lines.append(f"FAIL {name} (epoch {epochs}): {failed[0]['detail']}")
    return lines


def _notes(data: dict) -> list[str]:
    """A mode's notes: the fingerprint's (ids that are positions) and a framework's."""
    return [note for note in ((data.get("fingerprint") or {}).get("rows_note"), data.get("note"))
            if note]


def render_markdown(report: dict) -> str:
    out = [f"# sharddemo {_command(report)}", "", header(report)[0], ""]
    if report.get("launch_command"):
        out += [f"Rerun by hand: `{report['launch_command']}`", ""]
    if report.get("resume"):
        out += ["## resume", "", RESUME_TITLE[0].upper() + RESUME_TITLE[1:] + ".", ""]
        out += [f"- {line}" for line in resume_demo_lines(report["resume"])] + [""]
        if report.get("resume_left_out"):
            out += [f"Left out: {report['resume_left_out']}", ""]
    for mode, data in report["modes"].items():
        out += [f"## {mode}", "", data["description"], "",
                *[line for note in _notes(data) for line in (f"Note: {note}", "")],
                *([stream_line(data["streams"]), ""] if data.get("streams") else []),
                "| epoch | rank | steps | ids per batch |", "|---|---|---|---|"]
        for e in data["epochs"]:
            for r in side_by_side(e):
                out.append(f"| {e['epoch']} | {rank_name(r)[5:]} | {r['steps']} | "
                           f"{rank_text(r)} |")
        out.append("")
        own = own_sizes_line(report, data)
        if data.get("settings"):
            out += [settings_line(data), ""]
        elif own:
            out += [own, ""]
        for e in data["epochs"]:
            out.append(f"- epoch {e['epoch']}: " + "; ".join(_epoch_summary(e)))
            out += [f"  - {line.strip()}" for line in window_lines(e.get("grad_accum"))]
        out += ["", f"**{data['conclusion']}**", ""]
        if data.get("peers"):
            out += [f"- {line}" for line in verdict_lines(data["peers"])] + [""]
        if data.get("resume"):
            out += [f"- resume: {line}" for line in resume_lines(data["resume"])] + [""]
        if "verdicts" in data:
            out += [f"- {line}" for line in verdict_lines(data["verdicts"])] + [""]
        for problem in data["broken_promises"]:
            out.append(f"- broken: {problem}")
    return "\n".join(out).rstrip() + "\n"


# Above this dataset size the JSON is written compact: indented, every id takes a line.
INDENT_LIMIT = 10_000


def render_json(report: dict) -> str:
    if report["dataset_size"] > INDENT_LIMIT:
        return json.dumps(report, separators=(",", ":")) + "\n"
    return json.dumps(report, indent=2) + "\n"


RENDERERS = {"table": render_table, "json": render_json, "markdown": render_markdown}


def render(report: dict, fmt: str) -> str:
    return RENDERERS[fmt](report)


def write_report(report: dict, path: str) -> int:
    """The JSON report to `path`, whole or not at all; returns its size in bytes."""
    from sharddemo.fileio import write_atomic

    data = render_json(report).encode("utf-8")
    write_atomic(path, data)
    return len(data)


# -- the summary printed instead of the report where --output FILE holds it

SUMMARY_SCHEMA = "sharddemo.summary/1"


def file_size(size: int) -> str:
    """`25 KB`, `2.7 MB`, `1,024.0 MB` (of 2^10 and 2^20 bytes, as --max-memory counts)."""
    if size < 2**20:
        return f"{max(size, 1) / 2**10:,.0f} KB" if size >= 512 else f"{size} bytes"
    return f"{size / 2**20:,.1f} MB"


def summary_json(report: dict, path: str, size: int) -> dict:
    """Return what `--format json --output FILE` prints (docs/summary.schema.json).

    Where the report is, each mode's conclusion, broken promises and verdicts, the resume demo's
    rows."""
    modes = {}
    for mode, data in report["modes"].items():
        entry = {"conclusion": data["conclusion"], "broken_promises": data["broken_promises"]}
        if "verdicts" in data or "peers" in data:
            entry["verdicts"] = verdict_summary(data.get("verdicts") or data["peers"])
        modes[mode] = entry
    out = {"schema": SUMMARY_SCHEMA, "report": path, "bytes": size,
           "command": _command(report), "world_size": report["world_size"],
           "dataset_size": report["dataset_size"], "epochs": report["epochs"],
           "modes": modes, "broken_promises": report["broken_promises"]}
    if report.get("mesh"):
        out["mesh"] = report["mesh"]
    if report.get("resume"):
        out["resume"] = [{"workers": r["workers"], "stop": f"{r['at']['epoch']}:{r['at']['step']}",
                          "strategy": r["strategy"], "resume_exact": r["resume_exact"]}
                         for r in report["resume"]]
    return out


def verdict_summary(verdicts: list) -> list[dict]:
    """Return one entry per verdict, as verdict_lines words it.

    Held or not, the epochs where it failed and the first failure's detail."""
    out: list[dict] = []
    for v in verdicts:
        if not out or all(o["verdict"] != v["verdict"] for o in out):
            out.append({"verdict": v["verdict"], "ok": True, "failed_epochs": [],
                        "detail": None})
        entry = next(o for o in out if o["verdict"] == v["verdict"])
        if not v["ok"]:
            entry["ok"] = False
            entry["failed_epochs"].append(v["epoch"])
            entry["detail"] = entry["detail"] or v["detail"]
    return out


def summary_lines(report: dict) -> list[str]:
    """Return the report in a few lines.

    The header, each mode's conclusion, its broken promises and verdicts, the resume demo's
    rows."""
    lines = [f"sharddemo {_command(report)}: " + header(report)[0]]
    if len(report.get("nodes", {})) > 1:
        lines.append("ranks by node: " + placement_line(report))
    if report.get("resume"):
        lines += ["resume: " + line for line in resume_demo_lines(report["resume"])[:-1]]
    for mode, data in report["modes"].items():
        lines.append(f"{mode}: {data['conclusion']}")
        lines += [f"  {line}" for line in verdict_lines(data.get("verdicts")
                                                         or data.get("peers") or [])]
        lines += [f"  !! {problem}" for problem in data["broken_promises"]]
    return lines


def render_summary(report: dict, fmt: str, path: str, size: int) -> str:
    """Return what `--output FILE` prints in place of the report, in `fmt`.

    A few lines and where the whole report is (the report itself can be hundreds of MB: every id
    of every batch)."""
    if fmt == "json":
        return json.dumps(summary_json(report, path, size), indent=2) + "\n"
    where = f"the whole report (JSON): {path}, {file_size(size)}"
    if fmt == "markdown":
        out = [f"# sharddemo {_command(report)}", "", header(report)[0], ""]
        if len(report.get("nodes", {})) > 1:
            out += [f"Ranks by node: {placement_line(report)}", ""]
        if report.get("resume"):
            out += [f"- resume: {line}" for line in resume_demo_lines(report["resume"])[:-1]]
        for mode, data in report["modes"].items():
            out.append(f"- **{mode}**: {data['conclusion']}")
            out += [f"  - {line}" for line in verdict_lines(data.get("verdicts")
                                                            or data.get("peers") or [])]
            out += [f"  - broken: {problem}" for problem in data["broken_promises"]]
        return "\n".join([*out, "", f"The whole report (JSON): `{path}`, {file_size(size)}."]) + "\n"
    return "\n".join([*summary_lines(report), where]) + "\n"
