"""sharddemo.watch where the ids live on the GPU: no host sync per step, and what a step costs.

    python benchmarks/watch_gpu.py [--steps 1000] [--out results-gpu.json]

One process on one GPU (a machine with one GPU cannot run two NCCL ranks: NCCL refuses two
ranks on one device). A DataLoader over a TensorDataset held on the GPU yields batches that
are already there (indexing and collating GPU tensors queue work, they do not wait for it), so
whatever waits for the GPU during a step is the training step's or the watch's:

1. sync: the loop runs under torch.cuda.set_sync_debug_mode("warn"), which warns at every
   call that makes the host wait for the GPU. Counted per step, for the watched loop with
   `id_field` (the ids are GPU tensors), and, as a control that the check sees a sync, for the
   same loop that reads each batch's ids to the host itself (`ids.cpu()`).
2. time: the same MLP step (batch 64) unwatched and watched, alternating, `--rounds` times
   each; the step time and the watch's share.
3. NCCL: the watch's epoch-end collective and the small exchanges on a process group of
   one rank with the NCCL backend (an all-reduce of uint8 and an all-gather; one rank moves
   no data, but the calls go through NCCL as they would on more).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from sharddemo import watch  # noqa: E402

BATCH = 64


def make(device: torch.device, n: int):
    ids = torch.arange(n, device=device)
    x = torch.randn(n, 32, device=device)
    y = torch.randn(n, 1, device=device)
    return TensorDataset(ids, x, y)


def model_and_optimizer(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1)).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def epoch(loader, model, optimizer, host_ids: bool = False) -> list[int]:
    """One epoch; the sync warnings raised at each step (the epoch's end is the last)."""
    per_step = []
    batches = iter(loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while True:
            before = len(caught)
            try:
                ids, x, y = next(batches)
            except StopIteration:
                per_step.append(len(caught) - before)  # the epoch's end: the watch's exchange
                break
            if host_ids:
                ids.cpu()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            per_step.append(len(caught) - before)
    return per_step


def syncs(device, n: int, report: str) -> dict:
    model, optimizer = model_and_optimizer(device)
    data = make(device, n)
    out = {}
    for label, watched, host_ids in (("watched", True, False), ("control_ids_cpu", False, True),
                                     ("plain", False, False)):
        loader = DataLoader(data, batch_size=BATCH, shuffle=False)
        if watched:
            loader = watch(loader, report=report, id_field=0)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            counts = epoch(loader, model, optimizer, host_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out[label] = {"steps": len(counts) - 1, "steps_with_a_sync": sum(1 for c in counts[:-1]
                                                                          if c),
                      "syncs_in_steps": sum(counts[:-1]), "syncs_at_epoch_end": counts[-1]}
    return out


def timing(device, n: int, rounds: int) -> dict:
    data = make(device, n)
    model, optimizer = model_and_optimizer(device)
    times = {"plain": [], "watched": []}
    for _ in range(rounds):
        for label in ("plain", "watched"):
            loader = DataLoader(data, batch_size=BATCH, shuffle=True)
            if label == "watched":
                loader = watch(loader, report=None, id_field=0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            steps = 0
            for ids, x, y in loader:
                loss = (model(x) - y).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps += 1
            torch.cuda.synchronize()
            times[label].append((time.perf_counter() - start) / steps)
    plain, watched = statistics.median(times["plain"]), statistics.median(times["watched"])
    return {"steps_per_epoch": n // BATCH, "rounds": rounds,
            "step_ms_plain": round(plain * 1e3, 4), "step_ms_watched": round(watched * 1e3, 4),
            "overhead_us_per_step": round((watched - plain) * 1e6, 2),
            "overhead_pct": round(100 * (watched - plain) / plain, 2),
            "runs_ms": {k: [round(t * 1e3, 4) for t in v] for k, v in times.items()}}


def nccl(device) -> dict:
    import numpy as np
    import torch.distributed as dist

    from sharddemo.rank.collect import gather_ragged
    from sharddemo.rank.collect import TorchRanks, all_reduce_bytes

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        ranks = TorchRanks()
        buffer = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
        expect = buffer.copy()
        all_reduce_bytes(ranks, buffer)
        parts = gather_ragged(ranks, torch.arange(7), [7])
        return {"backend": dist.get_backend(), "device": str(ranks.device),
                "all_reduce_uint8_exact": bool((buffer == expect).all()),
                "gather": parts[0].tolist()}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="results-gpu.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("Error: no CUDA device here; this benchmark measures the watch on a GPU")
    device = torch.device("cuda", 0)
    n = args.steps * BATCH
    report = os.path.join(os.path.dirname(os.path.abspath(args.out)), "watch-gpu.jsonl")
    results = {"machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "python": platform.python_version()},
               "syncs": syncs(device, n, report)}
    with open(report) as handle:
        results["report"] = [json.loads(line) for line in handle]
    results["timing"] = timing(device, n, args.rounds)
    results["nccl"] = nccl(device)
    text = json.dumps(results, indent=1)
    print(text)
    with open(args.out, "w") as handle:
        handle.write(text)


if __name__ == "__main__":
    main()
