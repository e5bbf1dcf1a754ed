"""docs/memory-n.png (the `counted` section of results.json) and docs/memory-huge.png (the
`huge` section): peak memory against N.

    python benchmarks/plot_memory.py     # needs matplotlib (the [plot] extra)

Per mode: the busiest rank with sharddemo's count path, the same loader walked with nothing
recorded (the loader's own memory), that plus one byte per sample (issue target 4), and the
`sharddemo compare` parent.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"
OUT = ROOT / "docs" / "memory-n.png"


def plot(results: dict, out: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["counted"]["rows"]
    sizes = sorted(rows, key=int)
    n = [int(s) for s in sizes]
    fig, (ax, extra) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
    for mode, colour in (("sampler", "tab:blue"), ("prepared", "tab:orange")):
        traced = [rows[s][mode]["peak_rank_mb"] for s in sizes]
        bare = [rows[s][mode]["bare_peak_rank_mb"] for s in sizes]
        ax.plot(n, traced, "o-", color=colour, label=f"{mode}: busiest rank, traced")
        ax.plot(n, bare, "s--", color=colour, alpha=0.6, label=f"{mode}: the loader alone")
        extra.plot(n, [max(t - b, 0.01) for t, b in zip(traced, bare)], "o-", color=colour,
                   label=f"{mode}: traced minus the loader alone")
    parent = [max(rows[s][m]["parent_peak_mb"] for m in ("sampler", "prepared")) for s in sizes]
    ax.plot(n, parent, "^-", color="tab:green", label="sharddemo compare (parent)")
    extra.plot(n, [k / 2**20 for k in n], ":", color="black", label="1 byte per sample")
    for a in (ax, extra):
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("N (samples in one epoch)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7, loc="upper left")
    ax.set_ylabel("peak resident memory (MB)")
    extra.set_ylabel("MB above the loader's own peak")
    machine = results["counted"].get("machine", "")
    fig.suptitle(f"Memory against N, count path, 2 ranks, B = 4096 ({machine})", fontsize=9)
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out


if __name__ == "__main__":
    print(plot(json.loads(RESULTS.read_text())))


HUGE_OUT = ROOT / "docs" / "memory-huge.png"


def plot_huge(results: dict, out: Path = HUGE_OUT) -> Path:
    """docs/memory-huge.png from the `huge` section: the audit of a stream from 10^6 to 10^9
    samples against the same stream alone, per rank, and the difference per sample."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["huge"]["rows"].values() if r["workers"] == 2]
    rows.sort(key=lambda r: r["n"])
    n = [r["n"] for r in rows]
    fig, (ax, per) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
    ax.plot(n, [r["peak_rank_mb"] for r in rows], "o-", label="busiest rank, audited")
    ax.plot(n, [r["bare_peak_rank_mb"] for r in rows], "s--", alpha=0.7,
            label="the stream alone (nothing recorded)")
    ax.plot(n, [r["bare_peak_rank_mb"] + 0.3 * k / 2**20 for r, k in zip(rows, n)], ":",
            color="black", label="the stream alone + 0.3 bytes a sample (target)")
    per.plot(n, [max(r["extra_bytes_per_sample"], 1e-4) for r in rows], "o-",
             label="audited minus the stream alone, per sample")
    per.axhline(0.3, color="black", linestyle=":", label="0.3 bytes a sample (target)")
    per.axhline(0.25, color="grey", linestyle="--", label="2 bits a sample (the two bitmaps)")
    for a in (ax, per):
        a.set_xscale("log")
        a.set_xlabel("N (samples)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    ax.set_ylabel("peak resident memory per rank (MB)")
    per.set_yscale("log")
    per.set_ylabel("bytes per sample per rank")
    ax.set_title("audit of a stream of N ids, 2 ranks, 2 workers each")
    per.set_title("what the audit adds, per sample (2 bits from 2^26)")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
