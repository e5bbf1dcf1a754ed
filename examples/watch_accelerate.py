"""A plain accelerate training loop, checked as it trains with one line: sharddemo.watch.

    accelerate launch --config_file accelerate_configs/cpu2.yaml examples/watch_accelerate.py
    accelerate launch --config_file accelerate_configs/cpu2.yaml examples/watch_accelerate.py --pitfall replicated

At the end of each epoch the main process prints one line per watched loader and appends one
JSON object to sharddemo-watch.jsonl (docs/watch.md). `--pitfall` builds the loader the way
users get it wrong: `replicated` (not prepared, no sampler: every rank walks all of it),
`no-set-epoch` (a DistributedSampler whose set_epoch is never called: the same order every
epoch), `skip` (epoch 0 resumes with accelerator.skip_first_batches(loader, 3): the skipped
batches never reach the loop). `--on-violation raise` stops every rank at the failing epoch's
end with ShardingViolation.

Stop and resume, as a run with checkpoints does (the watch is saved with accelerate's own
checkpoint, and the resumed epoch is checked against what came before the stop):

    accelerate launch ... examples/watch_accelerate.py --save-at 3 --checkpoint ckpt    # stops
    accelerate launch ... examples/watch_accelerate.py --resume-from ckpt               # resumes

`--unseeded` builds the loader without a seed, so the restarted run draws another order.
"""

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from sharddemo import watch

N, BATCH = 40, 4


def get_dataloader(accelerator, pitfall: str, workers: int):
    dataset = TensorDataset(torch.arange(N), torch.randn(N, 8))
    if pitfall == "replicated":
        return DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers), None
    if pitfall == "no-set-epoch":
        sampler = DistributedSampler(dataset, num_replicas=accelerator.num_processes,
                                     rank=accelerator.process_index, shuffle=True, seed=0)
        return DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers), None
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers)
    return loader, "prepare"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pitfall", choices=["none", "replicated", "no-set-epoch", "skip"],
                        default="none")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--report", default="sharddemo-watch.jsonl")
    parser.add_argument("--on-violation", choices=["warn", "raise", "ignore"], default="warn")
    parser.add_argument("--save-at", type=int, help="save_state after this many steps of "
                        "epoch 0 (in --checkpoint) and stop; 0: after the whole of epoch 0")
    parser.add_argument("--checkpoint", default="checkpoint")
    parser.add_argument("--resume-from", help="load_state from this folder, skip the steps "
                        "it had taken, and train on")
    parser.add_argument("--unseeded", action="store_true")
    parser.add_argument("--lineage", help="a folder: each rank keeps the ids of every batch "
                        "it receives (sharddemo lineage DIR --step K)")
    args = parser.parse_args()

    # On a machine without GPUs the ranks run on the CPU (gloo): cpu2.yaml starts 2 of them.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if not args.unseeded:
        torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader, how = get_dataloader(accelerator, args.pitfall, args.workers)
    # watch before prepare: given the accelerator, the loader prepare returns is watched too
    loader = watch(loader, accelerator, report=args.report, on_violation=args.on_violation,
                   lineage=args.lineage)
    if how == "prepare":
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)

    first, skip = 0, 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        with open(f"{args.resume_from}/step.txt") as handle:
            first, skip = map(int, handle.read().split())

    def save(epoch: int, step: int) -> None:
        accelerator.save_state(args.checkpoint)
        if accelerator.is_main_process:
            with open(f"{args.checkpoint}/step.txt", "w") as handle:
                handle.write(f"{epoch} {step}")
        loader.close()  # the epoch stopped in is reported as partial (every rank, here)
        accelerator.end_training()

    for epoch in range(first, args.epochs):
        batches = loader
        if args.pitfall == "skip" and epoch == 0:
            batches = accelerator.skip_first_batches(loader, 3)  # as a resumed run does
        if skip and epoch == first:
            batches = accelerator.skip_first_batches(loader, skip)
        for step, (ids, x) in enumerate(batches):
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if args.save_at and epoch == 0 and step + 1 == args.save_at:
                return save(0, args.save_at)  # mid-epoch: epoch 0 resumes at this step
        if args.save_at == 0 and epoch == 0:
            return save(1, 0)  # at the epoch's end: the run resumes with epoch 1
    loader.close()  # the watched run's end (every rank): an epoch left open is reported
    accelerator.end_training()  # a clean end of the process group (docs/watch.md)


if __name__ == "__main__":
    main()
