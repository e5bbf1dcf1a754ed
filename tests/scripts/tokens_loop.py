"""A user's loop counting tokens and sources, launched by torchrun (tests/ranks/test_watch_tokens.py):
each rank logs, step by step, what its loop received (the ids, each sample's tokens from the
mask, its supervised tokens from the labels, its source), so that the test checks the watch's
figures against them.

    torchrun --nproc-per-node 4 tests/scripts/tokens_loop.py OUT

Cases, one watch each:
- sft: padded SFT rows (input_ids, attention_mask, labels with -100 on the prompt and the
  padding), a DistributedSampler over dp on a (dp, tp) = (2, 2) mesh, watched with the mesh,
  tokens=("attention_mask", "labels"), max_token_skew=1.5 and lineage=OUT/lineage-sft;
- sftworld: the same rows, a DistributedSampler over every rank (its tp peers differ), windows
  of 2 steps: the failing window's entry carries each group's tokens so far;
- mix: datasets.interleave_datasets of two sources with probabilities (0.7, 0.3), a
  DistributedSampler over every rank, watched with sources="source", weights=[0.7, 0.3];
- mixwrong: the same loader, watched with the weights the other way round (0.3, 0.7);
- named: the same mixture with its sources named ("web", "code": strings in the batch),
  watched with weights {"web": 0.7, "code": 0.3};
- weighted: a WeightedRandomSampler drawing source 0 with weight 0.7 over the whole dataset,
  each rank with its own generator, watched with weights {"0": 0.7, "1": 0.3};
- sftresume: the sft rows in torchdata's StatefulDataLoader (a DistributedSampler over dp),
  watched with the mesh and tokens=("attention_mask", "labels"); every rank saves
  `loader.state_dict()` after 3 steps of epoch 0 and stops that loader, then a fresh watched
  loader loads it and takes the rest of the epoch (a resume, in one launch).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset, DistributedSampler, WeightedRandomSampler

from sharddemo import watch

N, T, BATCH = 48, 16, 4
SIZES = (140, 60)  # rows of the two sources
PROBABILITIES = (0.7, 0.3)


class Rows(Dataset):
    """Sample i: a length 1..T (seeded), its first half a prompt (labels -100)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(1, T + 1, (N,), generator=g).tolist()

    def __len__(self):
        return N

    def __getitem__(self, i):
        length = self.lengths[i]
        mask = torch.zeros(T, dtype=torch.int64)
        mask[:length] = 1
        labels = torch.full((T,), -100)
        labels[length // 2:length] = 7
        return {"id": i, "input_ids": mask * 5, "attention_mask": mask, "labels": labels}


def mixture(names=None):
    """datasets' interleave_datasets of two sources, each row with its id and source (its
    index, or its name from `names`)."""
    from datasets import Dataset as HFDataset
    from datasets import interleave_datasets

    parts = [HFDataset.from_dict({"row": list(range(size)),
                                  "source": [names[k] if names else k] * size})
             for k, size in enumerate(SIZES)]
    mixed = interleave_datasets(parts, probabilities=list(PROBABILITIES), seed=0)
    mixed = mixed.add_column("id", list(range(len(mixed))))
    return mixed.with_format("torch", columns=["id", "source"])


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    log = []
    report = os.path.join(out, "report.jsonl")

    def walk(name, loader, sampler, epochs=2):
        for epoch in range(epochs):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            for step, batch in enumerate(loader):
                row = {"case": name, "epoch": epoch, "step": step, "ids": batch["id"].tolist()}
                if "attention_mask" in batch:
                    row["tokens"] = batch["attention_mask"].sum(1).tolist()
                    row["supervised"] = (batch["labels"] != -100).sum(1).tolist()
                if "source" in batch:  # (indices: a tensor; names: a list)
                    row["sources"] = list(batch["source"])
                    row["sources"] = [s if isinstance(s, str) else int(s) for s in row["sources"]]
                log.append(row)
        loader.close()

    rows = Rows()
    sampler = DistributedSampler(rows, num_replicas=2, rank=mesh["dp"].get_local_rank(),
                                 shuffle=True, seed=0)
    walk("sft", watch(DataLoader(rows, batch_size=BATCH, sampler=sampler), name="sft",
                      mesh=mesh, report=report, tokens=("attention_mask", "labels"),
                      max_token_skew=1.5, lineage=os.path.join(out, "lineage-sft")), sampler)
    # the same rows split over every rank (its tp peers differ): a window fails, with tokens
    sampler = DistributedSampler(rows, shuffle=True, seed=0)
    walk("sftworld", watch(DataLoader(rows, batch_size=BATCH, sampler=sampler),
                           name="sftworld", mesh=mesh, report=report, check_every=2,
                           tokens="attention_mask"), sampler, epochs=1)
    mixed = mixture()
    for name, weights in (("mix", [0.7, 0.3]), ("mixwrong", [0.3, 0.7])):
        sampler = DistributedSampler(mixed, shuffle=True, seed=0)
        walk(name, watch(DataLoader(mixed, batch_size=BATCH, sampler=sampler), name=name,
                         report=report, id_field="id", sources="source", weights=weights),
             sampler)
    named = mixture(names=("web", "code"))
    sampler = DistributedSampler(named, shuffle=True, seed=0)
    walk("named", watch(DataLoader(named, batch_size=BATCH, sampler=sampler), name="named",
                        report=report, id_field="id", sources="source",
                        weights={"web": 0.7, "code": 0.3}), sampler)
    sources = [int(s) for s in mixed["source"]]
    share = {k: PROBABILITIES[k] / sources.count(k) for k in (0, 1)}
    sampler = WeightedRandomSampler([share[s] for s in sources], num_samples=len(sources) // 4,
                                    generator=torch.Generator().manual_seed(rank))
    walk("weighted", watch(DataLoader(mixed, batch_size=BATCH, sampler=sampler), name="weighted",
                           report=report, id_field="id", sources="source",
                           weights={"0": 0.7, "1": 0.3}), sampler, epochs=1)
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = DistributedSampler(rows, num_replicas=2, rank=mesh["dp"].get_local_rank(),
                                 shuffle=True, seed=0)
    kw = dict(name="sftresume", mesh=mesh, report=report, tokens=("attention_mask", "labels"))
    first = watch(StatefulDataLoader(rows, batch_size=BATCH, sampler=sampler), **kw)
    sampler.set_epoch(0)
    for step, batch in enumerate(first):
        log.append({"case": "sftresume", "epoch": 0, "step": step,
                    "ids": batch["id"].tolist(),
                    "tokens": batch["attention_mask"].sum(1).tolist(),
                    "supervised": (batch["labels"] != -100).sum(1).tolist()})
        if step == 2:
            state = first.state_dict()  # (every rank, at the same step)
            break
    first.close()
    second = watch(StatefulDataLoader(rows, batch_size=BATCH, sampler=sampler), **kw)
    second.load_state_dict(state)
    for step, batch in enumerate(second, start=3):
        log.append({"case": "sftresume", "epoch": 0, "step": step,
                    "ids": batch["id"].tolist(),
                    "tokens": batch["attention_mask"].sum(1).tolist(),
                    "supervised": (batch["labels"] != -100).sum(1).tolist()})
    second.close()
    with open(os.path.join(out, f"log{rank}.json"), "w") as f:
        json.dump({"rank": rank, "coordinate": mesh.get_coordinate(), "log": log}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
