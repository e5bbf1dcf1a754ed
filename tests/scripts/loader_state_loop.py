"""A torchtitan-style loop that checkpoints the loader itself, launched by torchrun
(tests/ranks/test_watch_loader_state.py): torchdata's StatefulDataLoader over a map-style dataset
with torch's DistributedSampler, watched with sharddemo.watch(loader) (no accelerate), its
`loader.state_dict()` saved with torch.save on every rank after STOP steps of epoch 0, and, in the
next launch, loaded into a fresh watched loader with `loader.load_state_dict()`. It logs every
batch each pass received, so that the test checks the watch against what the loop really got.

    torchrun --nproc-per-node 2 tests/scripts/loader_state_loop.py OUT TAG CASE [CASE ...]

A CASE is NAME:WORKERS:BATCH:LOAD:STOP, e.g. mid:2:4:1:- . LOAD 1: load OUT/NAME.RANK.pt first
(a rank the saving launch did not have loads rank 0's, as a loop resharded onto more ranks
does); STOP: save after that many steps of epoch 0 (counted over the restarts) and stop, or `-`:
run epochs 0 and 1 to the end. Each rank writes OUT/ids.TAG.RANK.json: per case, each pass's
epoch and batches, and the error a load raised (torchdata refuses another number of workers);
the watch appends to OUT/report.TAG.jsonl.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from loop_end import end_loader, write_logs_and_end
from sharddemo import watch

N, EPOCHS = 40, 2


class Ints(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


class Stop(Exception):
    """The loop stops after its save (a preemption)."""


def run_case(out: str, tag: str, case: str, rank: int) -> dict:
    name, workers, batch, load, stop = case.split(":")
    sampler = DistributedSampler(Ints(), shuffle=True, seed=0)
    loader = StatefulDataLoader(Ints(), batch_size=int(batch), sampler=sampler,
                                num_workers=int(workers))
    loader = watch(loader, None, name=name, report=os.path.join(out, f"report.{tag}.jsonl"))
    log: dict = {"passes": [], "error": None}
    epoch = step = 0
    if load == "1":
        path = os.path.join(out, f"{name}.{rank}.pt")
        if not os.path.exists(path):
            path = os.path.join(out, f"{name}.0.pt")
        saved = torch.load(path)
        loader.load_state_dict(saved["loader"])
        epoch, step = saved["epoch"], saved["step"]
    try:
        for epoch in range(epoch, EPOCHS):
            sampler.set_epoch(epoch)
            got: list = []
            log["passes"].append({"epoch": epoch, "batches": got})
            for batch in loader:
                got.append(batch.tolist())
                step += 1
                if stop != "-" and epoch == 0 and step == int(stop):
                    # every rank saves its loader's state at the same step (a collective for
                    # the watch), as torchtitan's checkpointer does
                    state = {"loader": loader.state_dict(), "epoch": epoch, "step": step}
                    torch.save(state, os.path.join(out, f"{name}.{rank}.pt"))
                    raise Stop
            step = 0
    except Stop:
        pass
    except AssertionError as error:  # (torchdata's refusal of another number of workers)
        log["error"] = f"AssertionError: {error}"
    end_loader(loader)
    return log


def main() -> None:
    out, tag, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    logs = {case.split(":")[0]: run_case(out, tag, case, rank) for case in cases}
    write_logs_and_end(out, tag, logs)


if __name__ == "__main__":
    main()
