"""The split at a glance: one PNG with a panel per mode, and the terminal grid.

In the PNG, sample id across, a row per epoch and rank, coloured by rank; duplicates and missing
samples marked.

matplotlib is optional: `pip install 'sharddemo[plot]'`.
"""

from __future__ import annotations

from typing import Any

from sharddemo.errors import UsageError
from sharddemo.options import COUNTED_NO_PLOT, NO_EPOCHS_TO_PLOT

# The PNG is WIDTH_PX wide and HEADER_PX + PANEL_PX per mode high (docs/pictures.md).
WIDTH_PX = 1200
PANEL_PX = 260
HEADER_PX = 100
DPI = 100
# Up to this many samples every sample gets its own marker; above, ids are binned.
MARKER_LIMIT = 256
BINS = 300
RANK_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                "#bcbd22"]
# Terminal grid: up to this many samples.
GRID_LIMIT = 64


# The picture places each sample at its position 0..N-1; samples named by keys have none.
KEYS_NO_PLOT = ("--plot draws each sample at its position 0..N-1, and this loader's --id-field "
                "names samples by key (the report is written; run again without --plot)")


def grid_lines(report: dict, epoch: dict) -> list[str]:
    """Return the terminal grid: one character per sample id.

    The rank that received it, `+` when several ranks (or one rank several times) did, `-` when
    nobody did. Empty above GRID_LIMIT samples."""
    n = report["dataset_size"]
    if n > GRID_LIMIT or epoch.get("gather") == "count" or report.get("keys"):
        return []  # (keys: samples named, not placed)
    # on a mesh each data group counts once, by its first rank: the digit is the group's
    mesh = any("group" in r for r in epoch["ranks"])
    owners: list[list[int]] = [[] for _ in range(n)]
    for r in epoch["ranks"]:
        if mesh and not r["counted"]:
            continue
        for batch in r["batches"]:
            for i in batch:
                if 0 <= i < n:
                    owners[i].append(r["group"] if mesh else r["rank"])
    marks = []
    for who in owners:
        if not who:
            marks.append("-")
        elif len(who) > 1:
            marks.append("+")
        else:
            marks.append(str(who[0]) if who[0] < 10 else "#")
    head = "".join(str(i % 10) for i in range(n))
    if mesh:
        return [f"ids    {head}", f"group  {''.join(marks)}   (digit: the data-parallel group "
                "that got it, +: several times, -: never)"]
    return [f"ids    {head}", f"rank   {''.join(marks)}   (digit: the rank that got it, "
            "+: several times, -: never)"]


def _pyplot():
    from sharddemo.extras import require

    require("matplotlib", "--plot")
    try:
        import matplotlib
    except ImportError as exc:  # present but broken at import
        raise UsageError(f"--plot needs matplotlib, which fails to import ({exc}); reinstall "
                         "it: pip install 'sharddemo[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_report(report: dict, path: str) -> dict:
    """Draw the report to `path` (PNG), and return what was drawn.

    Per mode and epoch: for each rank the number of ids placed, and the missing and duplicated
    ids marked, so a test can check the picture against the report."""
    import numpy as np

    if any(e.get("gather") == "count" for m in report["modes"].values() for e in m["epochs"]):
        raise UsageError(COUNTED_NO_PLOT)
    if not report["modes"]:
        raise UsageError(NO_EPOCHS_TO_PLOT)
    if report.get("keys"):
        raise UsageError(KEYS_NO_PLOT)
    plt = _pyplot()
    modes = list(report["modes"])
    n, w, b = report["dataset_size"], report["world_size"], report["batch_size"]
    height = (HEADER_PX + PANEL_PX * len(modes)) / DPI
    fig, axes = plt.subplots(len(modes), 1, figsize=(WIDTH_PX / DPI, height), dpi=DPI,
                             squeeze=False)
    drawn: dict[str, Any] = {}
    small = n <= MARKER_LIMIT
    for ax, mode in zip(axes[:, 0], modes):
        data = report["modes"][mode]
        epochs = data["epochs"]
        rows_per_epoch = w + 1  # one row per rank, one for the marks
        labels, ticks, mine = [], [], []
        for e in epochs:
            base = e["epoch"] * rows_per_epoch
            placed = {}
            dup_ids = [d["id"] for d in e["duplicates"]]
            # on a mesh a data group's peers in adjacent rows (render.side_by_side's order)
            ordered = sorted(e["ranks"], key=lambda r: (r.get("group", 0),
                                                        not r.get("counted", True), r["rank"]))
            for row, r in enumerate(ordered):
                y = base + row
                ids = np.fromiter((i for batch in r["batches"] for i in batch), dtype=np.int64)
                placed[r["rank"]] = int(len(ids))
                colour = RANK_COLOURS[r["rank"] % len(RANK_COLOURS)]
                if small:
                    ax.scatter(ids, np.full(len(ids), y), s=60 if n <= 16 else 12, c=colour,
                               marker="s", label=f"rank {r['rank']}" if e["epoch"] == 0 else None)
                else:
                    counts, edges = np.histogram(ids, bins=BINS, range=(0, n))
                    width = edges[1] - edges[0]
                    ax.bar(edges[:-1], np.minimum(counts / width, 1.0) * 0.8, width=width,
                           bottom=y - 0.4, color=colour, align="edge", linewidth=0,
                           label=f"rank {r['rank']}" if e["epoch"] == 0 else None)
                labels.append(f"e{e['epoch']} r{r['rank']}"
                              + (f" ({r['mesh'].replace(' ', '')})" if "mesh" in r else ""))
                ticks.append(y)
            y = base + w
            if small:
                ax.scatter(e["missing"], np.full(len(e["missing"]), y), s=70, c="red", marker="x",
                           label="missing" if e["epoch"] == 0 else None)
                ax.scatter(dup_ids, np.full(len(dup_ids), y), s=70, facecolors="none",
                           edgecolors="black", marker="o",
                           label="duplicated" if e["epoch"] == 0 else None)
            else:
                for marked, colour, name in ((e["missing"], "red", "missing"),
                                             (dup_ids, "black", "duplicated")):
                    counts, edges = np.histogram(marked, bins=BINS, range=(0, n))
                    width = edges[1] - edges[0]
                    ax.bar(edges[:-1], np.minimum(counts / width, 1.0) * 0.8, width=width,
                           bottom=y - 0.4, color=colour, align="edge", linewidth=0,
                           label=name if e["epoch"] == 0 else None)
            labels.append(f"e{e['epoch']} marks")
            ticks.append(y)
            mine.append({"epoch": e["epoch"], "placed": placed, "missing": len(e["missing"]),
                         "duplicated": len(dup_ids)})
        drawn[mode] = mine
        raised = data.get("raised") or []
        if not epochs:  # the loader raised before an epoch completed (analysis.report)
            ax.set_title(f"{mode}: {_raised_title(raised)}, no epoch ran", fontsize=10,
                         loc="left")
            ax.text(0.01, 0.5, _wrap(data["conclusion"]), transform=ax.transAxes,
                    fontsize=7, va="center")
            ax.set_yticks([])
            ax.set_xticks([])
            continue
        ax.set_yticks(ticks, labels, fontsize=7)
        ax.set_ylim(-0.7, len(epochs) * rows_per_epoch - 0.3)
        ax.invert_yaxis()
        ax.set_xlim(-0.5 if small else 0, n - 0.5 if small else n)
        first = epochs[0]
        ax.set_title(f"{mode}: {first['seen']} samples per epoch = {first['times_dataset']:g}x "
                     "the dataset" + (f"; then {_raised_title(raised)}" if raised else ""),
                     fontsize=10, loc="left")
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
        if small and n <= 32:
            ax.set_xticks(range(n))
    axes[-1, 0].set_xlabel("sample id" + ("" if small else f" (binned, {BINS} bins)"))
    config = report.get("config_file") or ""
    mesh = report.get("mesh")
    shape = (", mesh " + " x ".join(f"{d}={s}" for d, s in mesh["dims"].items())
             + f" (data dims {', '.join(mesh['data_dims']) or 'none'})" if mesh else "")
    fig.suptitle(f"sharddemo: W = {w} ranks ({report['backend']}){shape}, N = {n} samples, "
                 f"per-rank batch B = {b}" + (f", {config}" if config else ""), fontsize=11)
    fig.tight_layout()
    import io

    from sharddemo.fileio import write_atomic

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
    return drawn


def _raised_title(raised: list[dict]) -> str:
    """Return the title of a mode whose loader raised.

    `raised before its first batch` (a mode that raises by design), else where a library raised
    on every rank: `raised at epoch 1, step 3 on every rank`."""
    first = raised[0] if raised else {}
    if "epoch" not in first:
        return "raised before its first batch"
    return f"raised at epoch {first['epoch']}, step {first['step']} on every rank"


def _wrap(text: str, width: int = 150) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def validate_plot_available() -> None:
    """Fail before any rank starts when --plot cannot be honoured."""
    _pyplot()
