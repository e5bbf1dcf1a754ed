"""sharddemo's benchmark suite: every figure of docs/benchmarks.md, measured here.

    python benchmarks/run.py                      # everything (about 10 minutes on 2 cores)
    python benchmarks/run.py --only startup,scale # some sections
    python benchmarks/run.py --repeats 3          # fewer repeats

Each section repeats its runs and keeps medians; ratios are measured within one run.
Results are merged into benchmarks/results.json (one entry per section, with the machine and
date it ran on) and docs/benchmarks.md is rewritten from that file. No test times anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"
DOC = ROOT / "docs" / "benchmarks.md"
CPU_CONFIG = str(ROOT / "accelerate_configs" / "cpu2.yaml")


def machine() -> str:
    import accelerate
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            names = [l.split(":", 1)[1].strip() for l in handle if l.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} cores ({cpu}), {gpu}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, accelerate {accelerate.__version__}")


def env() -> dict:
    out = dict(os.environ)
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def wall(cmd: list[str], ok: tuple[int, ...] = (0,)) -> float:
    """Wall seconds of `cmd`; exits where its exit code is not in `ok` (an audit whose verdict
    fails exits 1 and is still measured where asked)."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT)
    elapsed = time.perf_counter() - start
    if proc.returncode not in ok:
        raise SystemExit(f"benchmark command failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return elapsed


def launch(script_args: list[str], nproc: int = 2) -> list[str]:
    from sharddemo.launch import free_port

    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_CONFIG,
            "--num_processes", str(nproc), "--main_process_port", str(free_port()), *script_args]


def rank_bench(what: str, *args: int) -> dict:
    """benchmarks/rank_bench.py WHAT on 2 ranks: its figures, and `command_s`, the wall time of
    the whole launch (start-up, building the loader, the work, the exit)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        elapsed = wall(launch([str(ROOT / "benchmarks" / "rank_bench.py"), what, out,
                               *map(str, args)]))
        return {**json.loads(Path(out).read_text()), "command_s": elapsed}


def section_startup(repeats: int) -> dict:
    floor, prepared, compare = [], [], []
    for _ in range(repeats):  # alternate, so drift hits all alike
        floor.append(wall(launch([str(ROOT / "benchmarks" / "floor.py")])))
        prepared.append(wall(launch([str(ROOT / "benchmarks" / "floor_prepared.py")])))
        compare.append(wall([sys.executable, "-m", "sharddemo", "compare", "--format", "json"]))
    helps = [wall([sys.executable, "-m", "sharddemo", "--help"]) for _ in range(repeats)]
    f, p, c = (statistics.median(x) for x in (floor, prepared, compare))
    # The spread: each compare against the floor run just before it.
    pairs = sorted(b / a for a, b in zip(floor, compare))
    pairs_prepared = sorted(b / a for a, b in zip(prepared, compare))
    return {"floor_s": f, "compare_s": c, "ratio": c / f, "help_s": statistics.median(helps),
            "ratio_ci95": ratio_interval(compare, floor),
            "ratio_prepared_ci95": ratio_interval(compare, prepared),
            "floor_runs_s": floor, "compare_runs_s": compare,
            "pair_ratio_min": pairs[0], "pair_ratio_max": pairs[-1],
            "floor_prepared_s": p, "floor_prepared_runs_s": prepared,
            "ratio_prepared": c / p, "pair_ratio_prepared_min": pairs_prepared[0],
            "pair_ratio_prepared_max": pairs_prepared[-1],
            "target": "compare <= 1.15x floor (medians of alternated runs); --help well under 1 s",
            "met": c / f <= 1.15 and statistics.median(helps) < 0.5}


OVERHEAD_LAUNCHES = 6


def ratio_interval(traced: list, bare: list, rounds: int = 2000) -> list:
    """The 95% interval of median(traced) / median(bare), the pairs resampled whole (a
    percentile bootstrap, seeded): how far the figure itself can be trusted on this machine."""
    rng = random.Random(0)
    k = len(traced)
    ratios = []
    for _ in range(rounds):
        picked = [rng.randrange(k) for _ in range(k)]
        ratios.append(statistics.median(traced[i] for i in picked)
                      / statistics.median(bare[i] for i in picked))
    ratios.sort()
    return [ratios[int(0.025 * rounds)], ratios[int(0.975 * rounds) - 1]]


def section_overhead(repeats: int) -> dict:
    """The traced epoch against the bare loop (rank_bench.py overhead), in OVERHEAD_LAUNCHES
    separate launches: one launch's ratio moves by several percent with the hour and with
    where its memory landed, so the figure is the median over every pair of every launch,
    and each launch's own ratio is kept as the spread."""
    pairs = max(15, 3 * repeats)
    launches = [rank_bench("overhead", 1_000_000, 512, pairs) for _ in range(OVERHEAD_LAUNCHES)]
    out: dict = {}
    for mode in ("prepared", "sampler"):
        runs = [launch[mode] for launch in launches]
        pooled = {key: [x for run in runs for x in run[key]]
                  for key in ("bare_walls", "traced_walls", "bare_cpus", "traced_cpus")}
        bare, traced = (statistics.median(pooled[k]) for k in ("bare_walls", "traced_walls"))
        pair_ratios = sorted(t / b for t, b in zip(pooled["traced_walls"], pooled["bare_walls"]))
        out[mode] = {"bare_s": bare, "traced_s": traced, "ratio": traced / bare,
                     "ratio_ci95": ratio_interval(pooled["traced_walls"], pooled["bare_walls"]),
                     "pairs_iqr": [pair_ratios[len(pair_ratios) // 4],
                                   pair_ratios[(3 * len(pair_ratios)) // 4]],
                     "launch_ratios": [run["ratio"] for run in runs],
                     "cpu_ratio": statistics.median(pooled["traced_cpus"])
                     / statistics.median(pooled["bare_cpus"])}
    worst = max(out[m]["ratio"] for m in ("prepared", "sampler"))
    return {**out, "launches": OVERHEAD_LAUNCHES, "repeats": pairs, "gc_collect": True,
            "flush_ids": launches[0]["flush_ids"], "gather": launches[0]["gather"],
            "target": "traced epoch <= 1.05x the bare loop", "met": worst <= 1.05}


def _trace_cost(tmp: str, source: str, repeats: int, copies: int = 1) -> list[dict]:
    """benchmarks/trace_cost.py on SOURCE, `copies` processes started together."""
    procs, outs = [], []
    for k in range(copies):
        outs.append(os.path.join(tmp, f"{source}{k}.json"))
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "trace_cost.py"), outs[-1], source,
             "1000000", "512", str(repeats)], stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT))
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"benchmarks/trace_cost.py {source} failed:\n{err[-3000:]}")
    return [json.loads(Path(out).read_text()) for out in outs]


def section_trace_cost(repeats: int) -> dict:
    """The walk's own cost (benchmarks/trace_cost.py, one process): on batches made in
    advance, set against the loader's own time per batch from the overhead section (the
    sampler loop on 2 ranks, measured in the same run just before); and on rank 0's share of
    the sampler loader, walked by one process alone and by two such processes at once (what
    two ranks sharing two cores cost each other, with no collective in between)."""
    reps = max(31, 5 * repeats)
    with tempfile.TemporaryDirectory() as tmp:
        result = _trace_cost(tmp, "batches", reps)[0]
        alone = _trace_cost(tmp, "loader", reps)[0]
        together = _trace_cost(tmp, "loader", reps, copies=2)
    overhead = json.loads(RESULTS.read_text()).get("overhead") if RESULTS.exists() else None
    if overhead:
        per_rank_batches = -(-500_000 // 512)  # each of 2 ranks walks half of 10^6
        loader = overhead["sampler"]["bare_s"] / per_rank_batches * 1e6
        result["loader_per_batch_us"] = loader
        result["implied"] = (loader + result["per_batch_us"]) / loader
    result["loader_alone"] = alone
    result["loader_two_at_once"] = together
    return {**result, "target": "the trace's own cost <= 5% of the loader's time per batch",
            "met": result.get("implied", 9) <= 1.05}


def section_scale(repeats: int) -> dict:
    rows = {}
    for n in (100_000, 1_000_000, 10_000_000):
        times, peaks = [], []
        for _ in range(repeats if n < 10_000_000 else max(1, repeats // 2)):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "r.json")
                times.append(wall([sys.executable, "-m", "sharddemo", "compare", "--modes",
                                   "sampler", "--epochs", "1", "--batch-size", "512",
                                   "--dataset-size", str(n), "--output", out]))
                peaks.append(max(json.loads(Path(out).read_text())["timings"]["peak_rss_mb"]))
        rows[str(n)] = {"wall_s": statistics.median(times), "peak_rank_mb": max(peaks)}
    big = rows["10000000"]
    return {"rows": rows, "target": "N = 10^7: <= 30 s wall, <= 1.5 GB per rank",
            "met": big["wall_s"] <= 30 and big["peak_rank_mb"] <= 1536}


def _watch_peak(proc) -> int:
    """Poll a running process's own resident memory (not its children's) until it exits;
    the peak in bytes."""
    import psutil

    peak = 0
    try:
        me = psutil.Process(proc.pid)
        while proc.poll() is None:
            peak = max(peak, me.memory_info().rss)
            time.sleep(0.05)
    except psutil.NoSuchProcess:
        pass
    return peak


def library_counts(mode: str, n: int, b: int, world: int = 2) -> dict:
    """What torch and accelerate deal in one epoch of `compare --modes MODE` (shuffled, no
    drop_last), from their own objects' lengths: nothing is iterated, so it costs nothing at
    10^8. sampler: every rank's DistributedSampler.num_samples (padded up to a multiple of W).
    prepared: every rank's BatchSamplerShard batches x B (even_batches completes each batch
    from the start of the epoch; tests/ranks/test_counted.py sums the sizes at 1,000,003). The
    padding and the fill are under one round (W x B ids), far fewer than N here, so each of
    their ids arrives exactly twice."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

    if mode == "sampler":
        seen = sum(len(DistributedSampler(range(n), num_replicas=world, rank=r))
                   for r in range(world))
    else:
        batches = BatchSampler(SequentialSampler(range(n)), b, False)
        seen = b * sum(len(BatchSamplerShard(batches, num_processes=world, process_index=r,
                                             even_batches=True)) for r in range(world))
    return {"seen": seen, "unique": n, "missing": 0, "duplicated": seen - n}


def _counted_compare(mode: str, n: int) -> dict:
    """One `compare --gather count` of MODE at N, B = 4096, one epoch: its wall time, the
    parent's peak (polled), and what its report says."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "sharddemo", "compare", "--modes", mode, "--epochs", "1",
               "--batch-size", "4096", "--dataset-size", str(n), "--gather", "count",
               "--format", "json", "--output", out]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env=env(), cwd=ROOT)
        parent = _watch_peak(proc)
        _, err = proc.communicate()
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"benchmark command failed: {' '.join(cmd)}\n{err[-3000:]}")
        report = json.loads(Path(out).read_text())
        e = report["modes"][mode]["epochs"][0]
        counts = {"seen": e["seen"], "unique": e["unique"], "missing": e["missing_count"],
                  "duplicated": e["duplicate_count"]}
        return {"wall_s": elapsed, "walk_s": report["timings"]["mode_s"][mode],
                "peak_rank_mb": max(report["timings"]["peak_rss_mb"]),
                "parent_peak_mb": parent / 2**20, "report_bytes": os.path.getsize(out),
                "counts": counts, "broken_promises": report["modes"][mode]["broken_promises"]}


def section_counted(repeats: int) -> dict:
    """Issue 17: the count path from 10^5 to 10^8 samples, sampler and prepared, B = 4096, one
    epoch, beside the loader alone (`rank_bench.py bare`, launched the same way) at the same N.
    Each pair (bare launch, compare) runs PAIRS times, alternated; times are medians, memory
    the largest peak seen. At 10^8 one slow spell of this machine doubled a single run."""
    pairs = max(1, min(3, repeats))
    rows = {}
    for n in (100_000, 1_000_000, 10_000_000, 100_000_000):
        row = {}
        for mode in ("sampler", "prepared"):
            bare, runs = [], []
            for i in range(pairs):
                steps = ("bare", "compare") if i % 2 == 0 else ("compare", "bare")
                for step in steps:
                    if step == "bare":
                        bare.append(rank_bench("bare" if mode == "sampler" else "bare-prepared",
                                               n, 4096))
                    else:
                        runs.append(_counted_compare(mode, n))
            med = statistics.median
            expected = library_counts(mode, n, 4096)
            row[mode] = {
                "bare_epoch_s": med(b["epoch_s"] for b in bare),
                "bare_command_s": med(b["command_s"] for b in bare),
                "bare_command_runs_s": [b["command_s"] for b in bare],
                "bare_peak_rank_mb": max(max(b["peak_rss_mb"]) for b in bare),
                "wall_s": med(r["wall_s"] for r in runs),
                "wall_runs_s": [r["wall_s"] for r in runs],
                "walk_s": med(r["walk_s"] for r in runs),
                "peak_rank_mb": max(r["peak_rank_mb"] for r in runs),
                "parent_peak_mb": max(r["parent_peak_mb"] for r in runs),
                "report_bytes": max(r["report_bytes"] for r in runs),
                **runs[-1]["counts"],
                "counts_as_the_libraries_deal": all(r["counts"] == expected for r in runs),
                # the verdicts: as at N = 8, where both modes keep every promise
                "broken_promises": sorted({p for r in runs for p in r["broken_promises"]}),
            }
            row[mode]["extra_bytes_per_sample"] = (
                (row[mode]["peak_rank_mb"] - row[mode]["bare_peak_rank_mb"]) * 2**20 / n)
        rows[str(n)] = row
        print(f"[bench] counted {n}: {json.dumps(row)}", file=sys.stderr, flush=True)
    big = rows["100000000"]
    worst_wall = max(big[m]["wall_s"] for m in ("sampler", "prepared"))
    worst_rank = max(big[m]["peak_rank_mb"] for m in ("sampler", "prepared"))
    worst_parent = max(big[m]["parent_peak_mb"] for m in ("sampler", "prepared"))
    return {"rows": rows, "repeats": pairs,
            "target": "N = 10^8: <= 60 s wall, <= 1 GB peak per rank and in the parent",
            "met": (worst_wall <= 60 and worst_rank <= 1024 and worst_parent <= 1024
                    and all(r[m]["counts_as_the_libraries_deal"] and not r[m]["broken_promises"]
                            for r in rows.values() for m in ("sampler", "prepared")))}


def section_sharding(repeats: int) -> dict:
    result = rank_bench("sharding", 20_000, 64, repeats)
    worst = min(result[m]["speedup_vs_replicated"] for m in ("sampler", "prepared"))
    return {**result, "target": ">= 0.9 x W = 1.8x faster epochs than replicated at W = 2",
            "met": worst >= 1.8}


def section_gather(repeats: int) -> dict:
    result = rank_bench("gather", repeats)
    sizes = [k for k in result if k.isdigit()]
    worst = max(result[k]["ratio"] for k in sizes)
    return {**result, "target": "accelerator.gather within 10% of torch.distributed.all_gather",
            "met": worst <= 1.10}


def section_audit(repeats: int) -> dict:
    times, peaks = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            times.append(wall([sys.executable, "-m", "sharddemo", "audit",
                               "benchmarks/audit_1m.py:make_loader", "--epochs", "1",
                               "--format", "json", "--output", out]))
            peaks.append(max(json.loads(Path(out).read_text())["timings"]["peak_rss_mb"]))
    wall_s = statistics.median(times)
    return {"wall_s": wall_s, "peak_rank_mb": max(peaks),
            "target": "a factory over 1,000,000 samples audited well under a minute",
            "met": wall_s < 30}


def section_gpu(repeats: int) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no GPU on this machine", "met": None,
                "target": "NCCL path exercised and timed on a GPU"}
    times = [wall([sys.executable, "-m", "sharddemo", "run", "--device", "cuda", "--quiet"])
             for _ in range(repeats)]
    return {"card": torch.cuda.get_device_name(0), "run_s": statistics.median(times),
            "target": "NCCL path exercised and timed on a GPU", "met": True}


HUGE = {10**6: "million", 10**7: "ten_million", 10**8: "hundred_million", 10**9: "billion"}


def section_huge(repeats: int) -> dict:
    """`sharddemo audit examples/huge_stream.py:FACTORY --id-field . --dataset-size N` on 2
    ranks, N = 10^6 .. 10^9 (the stream split by rank and worker at the source, tensor
    batches of 4096, 2 DataLoader workers a rank), beside the same stream walked with nothing
    recorded (benchmarks/walk_bare.py), in the same run, alternated. From 2^26 samples the
    count path keeps 2 bits a sample (counting.BitCounts), below it one byte. Also, at 10^8
    and 10^9, the same stream made in each rank's own process (no workers): what the audit
    costs without the loader's worker traffic."""
    import shutil

    rows: dict = {}
    for n, factory in HUGE.items():
        for workers in ((2, 0) if n >= 10**8 else (2,)):
            runs = 1 if n >= 10**9 or workers == 0 else repeats
            target = (f"examples/huge_stream.py:{factory}" if workers else
                      f"benchmarks/huge_no_workers.py:{factory}")
            times, walks, peaks, bare_peaks, bare_walks = [], [], [], [], []
            for _ in range(runs):
                tmp = tempfile.mkdtemp()
                try:
                    out = os.path.join(tmp, "r.json")
                    times.append(wall([sys.executable, "-m", "sharddemo", "audit", target,
                                       "--id-field", ".", "--dataset-size", str(n), "--epochs",
                                       "1", "--format", "json", "--output", out],
                                      ok=(0, 1)))  # (unequal steps: the last block's rank)
                    report = json.loads(Path(out).read_text())
                    walks.append(report["timings"]["mode_s"]["audit"])
                    peaks.append(max(report["timings"]["peak_rss_mb"]))
                    e = report["modes"]["audit"]["epochs"][0]
                    counts = [e["seen"], e["unique"], e["missing_count"], e["duplicate_count"]]
                    subprocess.run(launch(["benchmarks/walk_bare.py", target,
                                           os.path.join(tmp, "bare")]), check=True,
                                   capture_output=True, cwd=ROOT)
                    bare = [json.loads(Path(tmp, f"bare.rank{r}.json").read_text())
                            for r in range(2)]
                    bare_peaks.append(max(b["peak_mb"] for b in bare))
                    bare_walks.append(max(b["walk_s"] for b in bare))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            peak, bare_peak = max(peaks), max(bare_peaks)
            rows[f"{n}:{workers}"] = {
                "n": n, "workers": workers, "runs": runs,
                "wall_s": statistics.median(times), "walk_s": statistics.median(walks),
                "bare_walk_s": statistics.median(bare_walks),
                "peak_rank_mb": peak, "bare_peak_rank_mb": bare_peak,
                "extra_bytes_per_sample": round((peak - bare_peak) * 2**20 / n, 4),
                "seen_unique_missing_duplicated": counts,
                "counter": "2 bits" if n >= 1 << 26 else "1 byte"}
    top = rows[f"{10**9}:2"]
    return {"rows": rows,
            "target": "N = 10^9 on 2 ranks: <= 120 s, <= 0.3 bytes a sample a rank over the "
                      "loader alone",
            "met": top["wall_s"] <= 120 and top["extra_bytes_per_sample"] <= 0.3}


SECTIONS = {"startup": section_startup, "overhead": section_overhead,
            "trace_cost": section_trace_cost, "scale": section_scale,
            "counted": section_counted,
            "sharding": section_sharding, "gather": section_gather, "audit": section_audit,
            "gpu": section_gpu, "huge": section_huge}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help="comma list of: " + ", ".join(SECTIONS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    where = machine()
    for name in [s.strip() for s in args.only.split(",") if s.strip()]:
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        data = SECTIONS[name](args.repeats)
        data.update(machine=where, date=datetime.date.today().isoformat())
        data.setdefault("repeats", args.repeats)  # a section that ran a fixed count says so
        results[name] = data
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
        if name in ("counted", "huge"):
            from plot_memory import plot, plot_huge

            try:
                (plot if name == "counted" else plot_huge)(results)
            except ImportError:  # matplotlib (the [plot] extra) absent: the table still stands
                print("[bench] no matplotlib: docs/memory-n.png not redrawn", file=sys.stderr)
        print(f"[bench] {name}: {json.dumps(data)}", file=sys.stderr, flush=True)
    from render_doc import render_doc

    DOC.write_text(render_doc(results))
    print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
