"""A rank script for tests/ranks/test_lineage.py: a watched accelerate loop with lineage=DIR that logs
the ids its loop received, step by step, to check the lineage against.

    accelerate launch ... tests/scripts/lineage_loop.py --lineage DIR --log LOG --launch K \\
        [--n 40] [--epochs 2] [--uneven] [--save-at S --checkpoint CKPT] [--crash-at S] \\
        [--resume-from CKPT --skip K] [--end close|os-exit] [--remove-lineage]

A prepared loader over ids 0..N-1 (`--n`, 40), shuffled, batches of 4; `--uneven`: accelerate's
even_batches=False (ranks take different numbers of steps, no fill). Each rank appends one line
per step to LOG/launch<K>_rank<r>.jsonl, [epoch, ids], written through at once (a process that
ends with os._exit keeps every line).

- `--save-at S`: accelerate's save_state in CKPT after this launch's S-th step (the watch's
  state with it), then the loop goes on.
- `--crash-at S`: the process ends at once right after this launch's S-th step is logged, as
  a crash does (os._exit: no close, no exit handler; with status 0, so that the launcher lets
  every rank get there rather than stop the others at the first).
- `--resume-from CKPT --skip K`: load_state, then the first epoch skips K batches per rank
  (skip_first_batches), as a resumed loop does.
- `--end os-exit`: os._exit(0) right after the last epoch, without close(), end_training() or
  the interpreter's exit handlers: how Ray Train's workers end.
- `--remove-lineage`: after watch() made the lineage folder, rank 0 removes it and puts a
  file in its place (a fault injected here: the folder cannot be written), before any batch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from sharddemo import watch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lineage", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--launch", type=int, default=0)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--checkpoint")
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--resume-from")
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--end", choices=["close", "os-exit"], default="close")
    parser.add_argument("--remove-lineage", action="store_true")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        even_batches=not args.uneven))
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.arange(args.n)), batch_size=4, shuffle=True)
    loader = watch(loader, accelerator, report=os.path.join(args.log, "watch.jsonl"),
                   on_violation="ignore", lineage=args.lineage)
    loader = accelerator.prepare(loader)
    if args.remove_lineage:
        accelerator.wait_for_everyone()  # (every rank's watch() has made the folder)
        if accelerator.is_main_process:
            shutil.rmtree(args.lineage)
            with open(args.lineage, "w") as handle:
                handle.write("not a folder")
        accelerator.wait_for_everyone()
    if args.resume_from:
        accelerator.load_state(args.resume_from)
    log = open(os.path.join(args.log, f"launch{args.launch}_rank{accelerator.process_index}"
                                      ".jsonl"), "w", buffering=1)
    steps = 0
    for epoch in range(args.epochs):
        batches = loader
        if epoch == 0 and args.skip:
            batches = accelerator.skip_first_batches(loader, args.skip)
        for (ids,) in batches:
            log.write(json.dumps([epoch, ids.tolist()]) + "\n")
            steps += 1
            if steps == args.save_at:
                accelerator.save_state(args.checkpoint)
            if steps == args.crash_at:
                os._exit(0)
    if args.end == "os-exit":
        os._exit(0)
    loader.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
