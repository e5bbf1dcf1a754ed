"""A rank script for tests/ranks/test_watch_resume_chain.py: a watched accelerate loop that stops and
resumes as preempted runs do (save_state / load_state / skip_first_batches), and keeps its own
account of what it received, to check the watch against.

    accelerate launch ... tests/scripts/resume_chain_loop.py --ids DIR --launch K --report W.jsonl \\
        [--resume-from CKPT] [--save-at E:S | --save-after-epoch E] --checkpoint CKPT

N = 80 samples (`--n`), batches of 4, a prepared shuffled loader, no seed (each launch draws
its own order, as an unseeded run does) unless `--seed` is given; `--sampler`: a DataLoader
with torch's DistributedSampler (seed 0, set_epoch each epoch), not prepared. `--save-at E:S` saves after step S of epoch E, inside the loop,
and stops (unless `--max-steps K` is given: then it goes on, and the launch stops after its
K-th step, mid-epoch, as a run ended by max_steps does); `--save-after-epoch E` saves after epoch E's loop, outside it, and stops. The
checkpoint holds the loop's place (`place.json`: the epoch and the steps taken in it, and the
loader's length then); a resumed launch goes on as accelerate's examples do: the steps taken
are skipped with skip_first_batches (counted at the new world size where it changed), and a
save after an epoch's last step resumes with the next epoch, skipping 0. `--unwatched` runs the
same loop without the watch (a checkpoint saved before the watch was added);
`--resume-in-place` resumes a save after an epoch's last step at that epoch and step, as a loop
that stores only (epoch, step) does: skip_first_batches skips the whole epoch, an empty pass.
`--no-skip` resumes without skip_first_batches (a loop that forgets it): the epoch starts over.

Each rank writes what it received, batch by batch, to `--ids`/launch<K>_rank<r>.json: a list of
[epoch, ids]."""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from sharddemo import watch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ids", required=True)
    parser.add_argument("--launch", type=int, required=True)
    parser.add_argument("--report")
    parser.add_argument("--n", type=int, default=80)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-at")
    parser.add_argument("--save-after-epoch", type=int)
    parser.add_argument("--checkpoint")
    parser.add_argument("--resume-from")
    parser.add_argument("--max-steps", type=int,
                        help="stop after this many steps of this launch (a break mid-epoch)")
    parser.add_argument("--unwatched", action="store_true")
    parser.add_argument("--seed", type=int, help="accelerate's set_seed before the loader")
    parser.add_argument("--resume-in-place", action="store_true",
                        help="a save after an epoch's last step resumes at that epoch, "
                             "skipping all of it (an empty pass), not with the next epoch")
    parser.add_argument("--no-skip", action="store_true",
                        help="resume without skip_first_batches: the epoch starts over")
    parser.add_argument("--sampler", action="store_true",
                        help="a DistributedSampler (seed 0, set_epoch each epoch), not prepared")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    if args.seed is not None:
        set_seed(args.seed)  # every launch draws the same order (FACTS: "Resuming")
    dataset = TensorDataset(torch.arange(args.n))
    sampler = None
    if args.sampler:
        sampler = DistributedSampler(dataset, num_replicas=accelerator.num_processes,
                                     rank=accelerator.process_index, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    else:
        loader = DataLoader(dataset, batch_size=4, shuffle=True)
    if not args.unwatched:
        loader = watch(loader, accelerator, report=args.report)
    if sampler is None:
        loader = accelerator.prepare(loader)
    first, skip = 0, 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        with open(os.path.join(args.resume_from, "place.json")) as handle:
            place = json.load(handle)
        first, skip = place["epoch"], place["step"]
        if skip == place["length"] and not args.resume_in_place:  # (the next epoch)
            first, skip = first + 1, 0
    save_epoch, save_step = map(int, args.save_at.split(":")) if args.save_at else (-1, -1)
    got: list = []
    steps = [0]  # this launch's steps (--max-steps)

    def save(epoch: int, step: int) -> None:
        accelerator.save_state(args.checkpoint)
        if accelerator.is_main_process:
            with open(os.path.join(args.checkpoint, "place.json"), "w") as handle:
                json.dump({"epoch": epoch, "step": step, "length": len(loader)}, handle)
        accelerator.wait_for_everyone()

    def train() -> None:
        for epoch in range(first, args.epochs):
            if sampler is not None:
                sampler.set_epoch(epoch)
            batches = loader
            if epoch == first and args.resume_from and not args.no_skip:
                batches = accelerator.skip_first_batches(loader, skip)
            taken = skip if epoch == first else 0
            for (ids,) in batches:
                got.append([epoch, ids.tolist()])
                taken += 1
                steps[0] += 1
                if (epoch, taken) == (save_epoch, save_step):
                    save(epoch, taken)
                    if not args.max_steps:
                        return
                if args.max_steps and steps[0] >= args.max_steps:
                    return  # (loader.close() below reports the epoch left open: partial)
            if epoch == args.save_after_epoch:
                save(epoch + 1, 0)
                return

    train()
    with open(os.path.join(args.ids, f"launch{args.launch}_rank{accelerator.process_index}.json"),
              "w") as handle:
        json.dump(got, handle)
    if not args.unwatched:
        loader.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
