"""A torchtitan-style loop over a `datasets` stream that checkpoints the loader itself, launched
by torchrun (tests/ranks/test_watch_stream_state.py): each rank builds
`Dataset.from_dict({"id": range(N)}).to_iterable_dataset(num_shards=S)` (optionally `.map`),
`split_dataset_by_node(ds, rank, world)`, optionally `.shuffle(seed=0, buffer_size=...)` with
`set_epoch` each epoch, read by torchdata's StatefulDataLoader and watched with
`sharddemo.watch(loader, None, id_field="id", dataset_size=N)`; its `loader.state_dict()` is saved
on every rank (torch.save, or torch.distributed.checkpoint) after some steps and the launch
stops; the next launch loads it into a fresh watched loader and goes on. It logs every batch's
ids each pass received, so that the test checks the watch (and the library) against what the
loop really got; a case that neither loads nor stops is the uninterrupted run to compare with.

    torchrun --nproc-per-node 2 tests/scripts/stream_state_loop.py OUT TAG CASE [CASE ...]

A CASE is NAME:SHARDS:MAP:BUFFER:WORKERS:LOAD:STOP, e.g. even:4:0:0:0:t:- . MAP 1: `.map` (before
the split, as datasets issue 7630 does); BUFFER: the shuffle buffer (0: no shuffle); LOAD: `-`
(a fresh loader), `t` (torch.load OUT/NAME.RANK.pt; a rank the saving launch did not have loads
rank 0's, as a loop resharded onto more ranks does), `d` (dcp.load of {"loader":
loader.state_dict(), ...} from OUT/NAME.dcp) or `T` (torchtitan's way: a loader that keeps each
data-parallel rank's state under its own key, pickled, loaded by DCP as a Stateful object);
STOP (a NAME beginning "noep": a loop that never calls the stream's set_epoch): `E.S`: save after step S of epoch E (steps counted over the restarts) with torch.save,
`E.Sd` with dcp.save, `E.ST` torchtitan's way, then stop; `-`: run to the end of epoch 1. Each rank writes OUT/ids.TAG.RANK.json
(per case, each pass's epoch and batches, and the error DCP raised); the watch appends to OUT/report.TAG.jsonl.
"""

from __future__ import annotations

import os
import pickle
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from datasets import Dataset
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader

from loop_end import end_loader, load_saved, write_logs_and_end
from sharddemo import watch

N, BATCH, EPOCHS = 40, 4, 2


class Stop(Exception):
    """The loop stops after its save (a preemption)."""


class TitanLoader(StatefulDataLoader):
    """torchtitan's ParallelAwareDataloader, as far as its state goes: each data-parallel
    rank's state under its own key, pickled (DCP keeps one copy of a key every rank saves)."""

    def __init__(self, dataset, rank: int, world: int, **kwargs):
        super().__init__(dataset, **kwargs)
        self.rank_id, self.world = f"dp_rank_{rank}", world

    def state_dict(self):
        return {self.rank_id: pickle.dumps(super().state_dict()), "world_size": self.world}

    def load_state_dict(self, state):
        if self.rank_id in state:
            super().load_state_dict(pickle.loads(state[self.rank_id]))


def tagged(example):
    return {"id": example["id"], "twice": 2 * example["id"]}


def make_stream(shards: int, mapped: bool, buffer: int, rank: int, world: int):
    ds = Dataset.from_dict({"id": list(range(N))}).to_iterable_dataset(num_shards=shards)
    if mapped:
        ds = ds.map(tagged)
    ds = split_dataset_by_node(ds, rank=rank, world_size=world)
    if buffer:
        ds = ds.shuffle(seed=0, buffer_size=buffer)
    return ds


def run_case(out: str, tag: str, case: str, rank: int, world: int) -> dict:
    name, shards, mapped, buffer, workers, load, stop = case.split(":")
    ds = make_stream(int(shards), mapped == "1", int(buffer), rank, world)
    titan = load == "T" or stop.endswith("T")
    loader = (TitanLoader(ds, rank, world, batch_size=BATCH, num_workers=int(workers)) if titan
              else StatefulDataLoader(ds, batch_size=BATCH, num_workers=int(workers)))
    loader = watch(loader, None, name=name, id_field="id", dataset_size=N,
                   report=os.path.join(out, f"report.{tag}.jsonl"))
    log: dict = {"passes": [], "error": None}
    epoch = step = 0
    if load == "t":
        saved = load_saved(out, name, rank)
        loader.load_state_dict(saved["loader"])
        epoch, step = saved["epoch"], saved["step"]
    elif load == "d":
        # dcp.load fills the state the fresh loader gives, then the loader loads it (a
        # stream's fresh state lacks keys the saved one has: DCP refuses it, watched or not)
        state = {"loader": loader.state_dict(), "epoch": 0, "step": 0}
        try:
            dcp.load(state, checkpoint_id=os.path.join(out, f"{name}.dcp"))
        except CheckpointException as error:  # (a BaseException: DCP's own refusal)
            log["error"] = f"load: {last_line(error)}"
            return finish(loader, log)
        loader.load_state_dict(state["loader"])
        epoch, step = state["epoch"], state["step"]
    elif load == "T":
        # (DCP asks the Stateful loader for its state, fills it, and gives it back to it)
        state = {"dataloader": loader, "place": {"epoch": 0, "step": 0}}
        try:
            dcp.load(state, checkpoint_id=os.path.join(out, f"{name}.dcp"))
        except CheckpointException as error:
            log["error"] = f"load: {last_line(error)}"
            return finish(loader, log)
        epoch, step = state["place"]["epoch"], state["place"]["step"]
    at = None if stop == "-" else (int(stop.split(".")[0]), int(stop.split(".")[1].rstrip("dT")))
    try:
        for epoch in range(epoch, EPOCHS):
            if not name.startswith("noep"):  # (noep: a loop that never calls set_epoch)
                ds.set_epoch(epoch)
            got: list = []
            log["passes"].append({"epoch": epoch, "batches": got})
            for batch in loader:
                got.append(batch["id"].tolist())
                step += 1
                if at == (epoch, step):
                    # every rank saves its loader's state at the same step (a collective for
                    # the watch), as torchtitan's checkpointer does
                    place = {"epoch": epoch, "step": step}
                    if stop.endswith("T"):  # (DCP asks the Stateful loader for its state)
                        try:
                            dcp.save({"dataloader": loader, "place": place},
                                     checkpoint_id=os.path.join(out, f"{name}.dcp"))
                        except CheckpointException as error:
                            log["error"] = f"save: {last_line(error)}"
                    elif stop.endswith("d"):
                        try:
                            dcp.save({"loader": loader.state_dict(), **place},
                                     checkpoint_id=os.path.join(out, f"{name}.dcp"))
                        except CheckpointException as error:
                            log["error"] = f"save: {last_line(error)}"
                    else:
                        torch.save({"loader": loader.state_dict(), **place},
                                   os.path.join(out, f"{name}.{rank}.pt"))
                    raise Stop
            step = 0
    except Stop:
        pass
    return finish(loader, log)


def last_line(error: BaseException) -> str:
    """What DCP's exception says last (the error each rank raised, after the tracebacks)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[-1]


def finish(loader, log: dict) -> dict:
    """The case's end: the epoch stopped in is reported (partial), the workers end here."""
    end_loader(loader)
    return log


def main() -> None:
    out, tag, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    logs = {case.split(":")[0]: run_case(out, tag, case, rank, world) for case in cases}
    write_logs_and_end(out, tag, logs)


if __name__ == "__main__":
    main()
