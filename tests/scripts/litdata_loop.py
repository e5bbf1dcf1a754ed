"""A loop over litdata's StreamingDataset + StreamingDataLoader that checkpoints the loader
itself, launched by torchrun (tests/ranks/test_watch_litdata.py): each rank builds
`StreamingDataset(OUT/DATA, shuffle=...)` (a folder the test wrote with litdata's own writer, an
"id" per sample) once its process group is up, reads it with `StreamingDataLoader(batch_size=4)`
and watches it with `sharddemo.watch(loader, None, id_field="id")`. Its `loader.state_dict()` is
saved on every rank with torch.save after some steps and the launch stops; the next launch
loads it into a fresh watched loader and goes on (litdata restores its own position). It logs
every batch's ids each pass received, so that the test checks the watch (and the library)
against what the loop really got; a case that neither loads nor stops is the uninterrupted run
to compare with.

    torchrun --nproc-per-node 2 tests/scripts/litdata_loop.py OUT TAG CASE [CASE ...]

A CASE is NAME:DATA:SHUFFLE:DROP:WORKERS:KIND:LOAD:STOP:LIMIT, e.g. base:n40:1:-:0:s:-:-:- .
SHUFFLE 1: shuffled; DROP: `-` (litdata's default: drop_last on more than one rank) or `0`
(drop_last=False); KIND: `s` a StreamingDataset, `e` the same built before the process group
exists (litdata reads the ranks when the dataset is built), `p` litdata's
ParallelStreamingDataset(length=LENGTH, resume=True) over it (a cycling stream, each epoch
going on where the last one stopped: litData issue 760), whose samples are the dataset's own
(watched with dataset_size=N, N from DATA's name: n40, 40);
LOAD: `-` (a fresh loader) or `t` (torch.load OUT/NAME.RANK.pt; a rank the saving launch did
not have loads rank 0's, as litdata's README saves one state for every rank); STOP: `E.S`: save
after step S of epoch E (steps counted over the restarts), then stop; `-`: run to the end of the
last epoch; LIMIT: `-` or the steps each epoch is cut at (a `break`, as Lightning's
limit_train_batches). Each rank writes OUT/ids.TAG.RANK.json (per case, each pass's epoch and
batches, the error litdata raised); the watch appends to OUT/report.TAG.jsonl.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from litdata import ParallelStreamingDataset, StreamingDataLoader, StreamingDataset

from loop_end import end_loader, load_saved, write_logs_and_end
from sharddemo import watch

EPOCHS, BATCH, LENGTH = 3, 4, 12


class Stop(Exception):
    """The loop stops after its save (a preemption)."""


def first(samples):
    """ParallelStreamingDataset's transform: the one dataset's sample as it is."""
    return samples[0]


def make_dataset(out: str, data: str, shuffle: bool, drop: str, kind: str):
    drop_last = None if drop == "-" else drop == "1"
    ds = StreamingDataset(os.path.join(out, data), shuffle=shuffle, drop_last=drop_last)
    if kind == "p":
        return ParallelStreamingDataset([ds], length=LENGTH, resume=True, transform=first)
    return ds


def run_case(out: str, tag: str, case: str, rank: int, early: dict) -> dict:
    name, data, shuffle, drop, workers, kind, load, stop, limit = case.split(":")
    ds = early[name] if kind == "e" else make_dataset(out, data, shuffle == "1", drop, kind)
    loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=int(workers))
    # (a ParallelStreamingDataset's N is not its own: the data's, from DATA's name, n40: 40)
    loader = watch(loader, None, name=name, id_field="id",
                   report=os.path.join(out, f"report.{tag}.jsonl"),
                   dataset_size=int(data[1:]) if kind == "p" else None)
    log: dict = {"passes": [], "error": None, "length": len(loader)}
    epoch = step = 0
    if load == "t":
        saved = load_saved(out, name, rank)
        log["saved"] = {k: saved["loader"]["dataset"].get(k) for k in (
            "world_size", "sample_in_epoch", "num_samples_yielded", "current_epoch")
            } if kind != "p" else None
        loader.load_state_dict(saved["loader"])
        epoch, step = saved["epoch"], saved["step"]
        if step == log["length"]:  # saved after the epoch's last step: the next one follows
            epoch, step = epoch + 1, 0
    at = None if stop == "-" else tuple(int(x) for x in stop.split("."))
    cap = None if limit == "-" else int(limit)
    try:
        for epoch in range(epoch, EPOCHS):
            got: list = []
            log["passes"].append({"epoch": epoch, "batches": got})
            for batch in loader:
                got.append(batch["id"].tolist())
                step += 1
                if at == (epoch, step):
                    # every rank saves its loader's state at the same step (a collective for
                    # the watch)
                    torch.save({"loader": loader.state_dict(), "epoch": epoch, "step": step},
                               os.path.join(out, f"{name}.{rank}.pt"))
                    raise Stop
                if cap is not None and step == cap:
                    break
            step = 0
    except Stop:
        pass
    except Exception as error:  # (the library's refusal, logged for the test)
        log["error"] = f"{type(error).__name__}: {error}"
    end_loader(loader)
    return log


def main() -> None:
    out, tag, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
    logging.disable(logging.WARNING)  # (litdata's drop_last notice, once per dataset)
    # KIND e: built before the process group, as a script that makes its data first does
    early = {}
    for case in cases:
        name, data, shuffle, drop, _, kind = case.split(":")[:6]
        if kind == "e":
            early[name] = make_dataset(out, data, shuffle == "1", drop, kind)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    logs = {case.split(":")[0]: run_case(out, tag, case, rank, early) for case in cases}
    write_logs_and_end(out, tag, logs)


if __name__ == "__main__":
    main()
