"""What sharddemo.watch costs a real training loop (docs/benchmarks.md, "watch").

    python benchmarks/watch_overhead.py --pairs 6          # step time, 2 CPU ranks
    python benchmarks/watch_overhead.py --per-batch        # recording cost per batch, 1 process
    python benchmarks/watch_overhead.py --pairs 4 --mesh dp=2,tp=2   # 4 CPU ranks on a mesh
    python benchmarks/watch_overhead.py --pairs 4 --tokens  # tokens= and sources= counted too

Step time: the same script (an MLP 32-256-256-1, batch 64, a prepared shuffled DataLoader,
1,000 steps per rank, 2 gloo ranks, one epoch after a warm-up epoch) launched with and without
`watch(loader, accelerator)`, the two alternating launch by launch so that the machine's drift
hits both alike. Each launch reports the main rank's mean step time over the timed epoch
(the watch's end-of-epoch exchange included), and the watched one the time spent inside the
watch's own code (its per-batch note and count, its end of epoch), timed where it runs: on 2
cores the launches' step times move by 10-15% pair to pair, far more than the watch costs.
Printed: every pair, the median ratio, the step time, and the watch's share of the epoch.

With --mesh (e.g. dp=2,tp=2): as many ranks as the mesh holds, the mesh built with torch's
init_device_mesh after the Accelerator, the loader a DistributedSampler over the data dims (the
data coordinate from the mesh), not prepared, and `watch(loader, accelerator, mesh=mesh)`: the
peer check's hashing and exchanges included.

With --tokens: each batch also carries a 0/1 mask of 128 slots a sample (int8) and a source
index (0..2), and the watch counts them (`tokens=3, sources=4, weights=[0.5, 0.3, 0.2]`).

Per batch: `watch` on a DataLoader over a map-style dataset of 10^6 samples, batches of 64, in
one process, against the same loader unwatched: the difference per batch in microseconds (the
note of the sampler's indices, the count, the flushes), median of several passes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "accelerate_configs", "cpu2.yaml")
STEPS, BATCH, WIDTH = 1000, 64, 256


def check_every():
    """watch(check_every=): WATCH_CHECK_EVERY in the environment, "auto" (watch's default)
    where it is not set, else a number of steps."""
    value = os.environ.get("WATCH_CHECK_EVERY", "auto")
    return value if value == "auto" else int(value)


def rank_main(watched: bool, out: str, lineage: bool = False, mesh_text: str = "",
              tokens: bool = False) -> None:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    world = accelerator.num_processes
    mesh, sampler = None, None
    if mesh_text:
        from torch.distributed.device_mesh import init_device_mesh

        from sharddemo.mesh import DATA_DIM_NAMES, parse_mesh

        dims, sizes = parse_mesh(mesh_text)
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=dims)
        coordinate, world, rank = mesh.get_coordinate(), 1, 0
        for d, size, c in zip(dims, sizes, coordinate):
            if d in DATA_DIM_NAMES:
                world, rank = world * size, rank * size + c
    n = STEPS * BATCH * world
    fields = [torch.arange(n), torch.randn(n, 32), torch.randn(n, 1)]
    if tokens:  # a mask of 128 slots (a random length each) and a source index a sample
        lengths = torch.randint(1, 129, (n, 1))
        fields += [(torch.arange(128) < lengths).to(torch.int8), torch.randint(0, 3, (n,))]
    data = TensorDataset(*fields)
    model = torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if mesh is not None:  # (a sampler over the data dims; the loader is not prepared)
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True)
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    else:
        loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    # seconds inside the watch's own code, this epoch: wall, CPU (thread), and the wall time of
    # its per-batch part (add) alone; the rest is the epoch's end
    spent = [0.0, 0.0, 0.0]
    if watched:
        from sharddemo import watch
        from sharddemo.watching.state import WatchState

        # time the watch's own work where it runs (the benchmark's wrapper, not a switch of
        # the shipped code): what it adds to each step, free of the launches' noise
        for name in ("add", "end_epoch"):
            original = getattr(WatchState, name)

            def timed(self, *a, _original=original, **kw):
                # (the thread's CPU clock is a system call, about 0.6 us: read outside the
                # wall clock's interval, which would otherwise count one of them a batch)
                cpu = time.thread_time()
                start = time.perf_counter()
                try:
                    return _original(self, *a, **kw)
                finally:
                    took = time.perf_counter() - start
                    spent[0] += took
                    spent[1] += time.thread_time() - cpu
                    if _original.__name__ == "add":
                        spent[2] += took

            setattr(WatchState, name, timed)
        # --lineage: the watched run also keeps every batch's ids (watch(..., lineage=DIR))
        folder = os.path.join(os.path.dirname(out), "lineage") if lineage else None
        measures = (dict(tokens=3, sources=4, weights=[0.5, 0.3, 0.2]) if tokens else {})
        loader = watch(loader, accelerator, report=None, lineage=folder,
                       check_every=check_every(), mesh=mesh, **measures)
    if mesh is None:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    times = []
    for epoch in range(2):  # epoch 0 warms up; epoch 1 is timed
        if sampler is not None:
            sampler.set_epoch(epoch)
        accelerator.wait_for_everyone()
        spent[0] = spent[1] = spent[2] = 0.0
        start, cpu = time.perf_counter(), time.process_time()
        steps = 0
        for _, x, y, *_ in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
        times.append((time.perf_counter() - start) / steps)
        epoch_cpu = time.process_time() - cpu  # (the rank's threads, gloo's included)
    if accelerator.is_main_process:
        with open(out, "w") as handle:
            json.dump({"step_s": times[1], "steps": steps, "watch_s": spent[0],
                       "watch_batches_s": spent[2],
                       "epoch_s": times[1] * steps, "watch_cpu_s": spent[1],
                       "epoch_cpu_s": epoch_cpu}, handle)
    accelerator.end_training()


def launch(watched: bool, lineage: bool = False, mesh: str = "", tokens: bool = False) -> dict:
    processes = 2
    if mesh:
        from sharddemo.mesh import parse_mesh

        processes = 1
        for size in parse_mesh(mesh)[1]:
            processes *= size
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG,
               "--num_processes", str(processes), __file__, "--rank", "1" if watched else "0",
               "--out", out, *(["--lineage"] if lineage else []),
               *(["--mesh", mesh] if mesh else []), *(["--tokens"] if tokens else [])]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if not os.path.exists(out):  # (a rank that aborts in its teardown has written it)
            raise RuntimeError(f"launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(out) as handle:
            return json.load(handle)


def per_batch(passes: int) -> dict:
    import torch
    from torch.utils.data import DataLoader, Dataset

    from sharddemo import watch

    class Ids(Dataset):  # batched fetch: the loader's own cost stays small and steady
        def __len__(self):
            return 1_000_000

        def __getitems__(self, indices):
            return torch.tensor(indices)

        def __getitem__(self, i):
            return i

    def loader():
        return DataLoader(Ids(), batch_size=BATCH, shuffle=True, collate_fn=lambda b: b)

    plain, watched = [], []
    for _ in range(passes):
        for kind, into in ((False, plain), (True, watched)):
            made = watch(loader(), report=None) if kind else loader()
            start = time.perf_counter()
            count = 0
            for _ in made:
                count += 1
            into.append((time.perf_counter() - start) / count)
    return {"batches": count, "plain_us": statistics.median(plain) * 1e6,
            "watched_us": statistics.median(watched) * 1e6,
            "per_batch_us": (statistics.median(watched) - statistics.median(plain)) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--per-batch", action="store_true")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--rank", choices=["0", "1"])
    parser.add_argument("--out")
    parser.add_argument("--lineage", action="store_true",
                        help="the watched launch writes a lineage too (watch(..., lineage=))")
    parser.add_argument("--mesh", default="",
                        help="a device mesh, e.g. dp=2,tp=2: as many ranks, watch(mesh=)")
    parser.add_argument("--tokens", action="store_true",
                        help="the batches carry a mask and a source: watch(tokens=, sources=)")
    parser.add_argument("--record", action="store_true",
                        help="write the figures into benchmarks/results.json and render "
                             "docs/benchmarks.md")
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank == "1", args.out, args.lineage, args.mesh, args.tokens)
        return
    if args.per_batch:
        print(json.dumps(per_batch(args.passes), indent=1))
        return
    ratios, plain_steps, shares, per_step, cpu_shares, batch_us = [], [], [], [], [], []
    for pair in range(args.pairs):
        # alternate which goes first, so neither always runs on a warmer machine
        order = (False, True) if pair % 2 == 0 else (True, False)
        got = {watched: launch(watched, args.lineage, args.mesh, args.tokens)
               for watched in order}
        ratio = got[True]["step_s"] / got[False]["step_s"]
        ratios.append(ratio)
        plain_steps.append(got[False]["step_s"])
        share = got[True]["watch_s"] / got[True]["epoch_s"]
        shares.append(share)
        per_step.append(got[True]["watch_s"] / got[True]["steps"])
        batch_us.append(got[True]["watch_batches_s"] / got[True]["steps"] * 1e6)
        # the main rank's CPU time inside the watch over the epoch's (its threads together):
        # steadier than wall time where other work shares the cores, but blind to the time a
        # rank waits in a collective without spinning
        cpu_shares.append(got[True]["watch_cpu_s"] / got[True]["epoch_cpu_s"])
        print(f"pair {pair}: plain {got[False]['step_s'] * 1e3:.3f} ms/step, watched "
              f"{got[True]['step_s'] * 1e3:.3f} ms/step, ratio {ratio:.4f}; inside the watch "
              f"{got[True]['watch_s'] * 1e3:.1f} ms of the epoch ({share:.3%}), CPU "
              f"{got[True]['watch_cpu_s'] * 1e3:.1f} ms of {got[True]['epoch_cpu_s']:.2f} s "
              f"({cpu_shares[-1]:.3%})", flush=True)
    figures = {"pairs": args.pairs, "steps_per_rank": STEPS, "batch": BATCH,
               "median_ratio": statistics.median(ratios),
               "ratios": [round(r, 4) for r in ratios],
               "median_step_ms": statistics.median(plain_steps) * 1e3,
               "median_watch_share": statistics.median(shares),
               "shares": [round(s, 5) for s in shares],
               "median_watch_us_per_step": statistics.median(per_step) * 1e6,
               # of which the batches' part (the rest: the windows' and the epoch's ends)
               "median_watch_batch_us_per_step": statistics.median(batch_us),
               "median_watch_cpu_share": statistics.median(cpu_shares),
               "cpu_shares": [round(s, 5) for s in cpu_shares],
               "check_every": check_every(), **({"mesh": args.mesh} if args.mesh else {})}
    print(json.dumps(figures, indent=1))
    if args.record:
        record(figures, "watch_mesh" if args.mesh else "watch_tokens" if args.tokens else
               "watch_lineage" if args.lineage else "watch")


def record(figures: dict, name: str = "watch") -> None:
    """Into benchmarks/results.json (key "watch", with the per-batch cost, the date and the
    machine), then docs/benchmarks.md rendered again from it."""
    import datetime
    import platform

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from render_doc import record_result

    figures.update(per_batch(5))
    figures.update(date=datetime.date.today().isoformat(),
                   machine=f"{os.cpu_count()} cores, {platform.machine()}",
                   target="<= 1% of the step", repeats=figures["pairs"])
    record_result(name, figures)


if __name__ == "__main__":
    main()
