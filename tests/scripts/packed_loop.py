"""A rank script for tests/ranks/test_watch_packed.py: watched loops over packed rows (several samples
a row, as SFT packing and torchtitan's packed datasets deal them), torch.distributed alone
(torchrun, gloo).

Each rank's samples are torch's own DistributedSampler's (N = 24 over the ranks, shuffled,
seed 7, set_epoch each epoch); a packer (an IterableDataset, torchtitan-style) packs them in
that order into rows of ROW tokens: the k-th sample a rank packs has LENGTHS[k % 8] tokens, so
every rank packs as many tokens (57) into as many rows (8), and a sample that does not fit the
rest of a row goes on in the next row (its id ends one row and starts the next; the 12-token
one runs over three rows). Batches of 2 rows.

Cases, each a loader watched under its own name in one launch (report `DIR/report.jsonl`):
- `lists`: the rows as lists of ids (a collate_fn), 2 epochs, windows every 2 steps, lineage
  in `DIR/lineage`;
- `padded`: the rows as one 2-D tensor per batch, ROW_WIDTH wide, padded with -1, 2 epochs,
  windows off;
- `drop`: a packer that loses rank 1's fifth sample (lists, 1 epoch);
- `repeat`: a packer that packs rank 0's second sample again after its seventh (padded, 1
  epoch): a sample in two rows that are not consecutive.

Each rank writes the rows its loop received, per case and epoch, to `DIR/rank<r>.json`.
`make_loader(accelerator)`: the `lists` loader for `sharddemo audit --id-field ids`.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from sharddemo import watch

N, SEED, ROW, BATCH = 24, 7, 8, 2
ROW_WIDTH = ROW  # (a row holds at most ROW samples: one token each)
LENGTHS = [3, 5, 2, 7, 4, 12, 1, 6]


class Packer(IterableDataset):
    """This rank's samples (torch's DistributedSampler), packed in order into rows of ROW
    tokens; `fault`: "drop" loses rank 1's fifth sample, "repeat" packs rank 0's second sample
    again after its seventh."""

    def __init__(self, rank: int, world: int, fault: str = "") -> None:
        self.sampler = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=True,
                                          seed=SEED)
        self.rank, self.fault = rank, fault

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        order = list(self.sampler)
        if self.fault == "drop" and self.rank == 1:
            del order[4]
        if self.fault == "repeat" and self.rank == 0:
            order.insert(7, order[1])
        row: list[int] = []
        room = ROW
        for k, sample in enumerate(order):
            left = LENGTHS[k % len(LENGTHS)]
            while left:
                take = min(left, room)
                row.append(sample)
                left, room = left - take, room - take
                if not room:
                    yield row
                    row, room = [], ROW
        if row:
            yield row


def as_lists(rows):
    return {"ids": [list(r) for r in rows], "tokens": torch.zeros(len(rows), ROW)}


def as_padded(rows):
    ids = torch.full((len(rows), ROW_WIDTH), -1, dtype=torch.int64)
    for k, r in enumerate(rows):
        ids[k, :len(r)] = torch.tensor(r)
    return {"ids": ids, "tokens": torch.zeros(len(rows), ROW)}


def make_loader(accelerator):
    return DataLoader(Packer(accelerator.process_index, accelerator.num_processes),
                      batch_size=BATCH, collate_fn=as_lists)


CASES = {"lists": (as_lists, "", 2, 2), "padded": (as_padded, "", 2, 0),
         "drop": (as_lists, "drop", 1, 2), "repeat": (as_padded, "repeat", 1, 2)}


def rows_of(batch) -> list[list[int]]:
    ids = batch["ids"]
    return ids.tolist() if torch.is_tensor(ids) else [list(r) for r in ids]


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log: dict = {}
    for case, (collate, fault, epochs, check_every) in CASES.items():
        packer = Packer(rank, world, fault)
        loader = watch(DataLoader(packer, batch_size=BATCH, collate_fn=collate), name=case,
                       id_field="ids", dataset_size=N, report=f"{out}/report.jsonl",
                       check_every=check_every, on_violation="warn",
                       lineage=f"{out}/lineage" if case == "lists" else None)
        for epoch in range(epochs):
            packer.set_epoch(epoch)
            log.setdefault(case, []).append([rows_of(b) for b in loader])
        loader.close()
    with open(f"{out}/rank{rank}.json", "w") as handle:
        json.dump(log, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
