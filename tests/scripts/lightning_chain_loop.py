"""A Lightning fit for tests/ranks/test_watch_resume_lightning.py: LightningWatch on a fit that stops and
resumes as preempted runs do (a checkpoint every `--stop-at` steps, fit(ckpt_path=...)), on
`--devices` CPU processes (DDP, gloo), and keeps its own account of what it received, to check
the watch against.

    python tests/scripts/lightning_chain_loop.py --root DIR --ids IDS --launch K --devices 2 \\
        [--stop-at STEP] [--resume CKPT]

N = `--n` samples (40), batches of 4, `--epochs` epochs (2); Lightning injects its shuffling
DistributedSampler (seed 0, set_epoch each epoch). `--stop-at S` writes a checkpoint at global
step S (ModelCheckpoint, every S steps, into DIR/checkpoints) and stops fit() there, as a job
that runs out of time does. Each rank's training_step writes the ids of every batch it received,
with the epoch, to IDS/launch<K>_rank<r>.json: a list of [epoch, ids]."""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import DataLoader, Dataset

try:
    import pytorch_lightning as pl
except ImportError:
    import lightning.pytorch as pl

from sharddemo.integrations import LightningWatch


class Numbers(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i), torch.tensor([float(i)]), torch.tensor(i % 2)


class Logged(pl.LightningModule):
    """A tiny model whose training_step keeps the ids of every batch it is given."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 2)
        self.got: list = []

    def training_step(self, batch, _):
        ids, x, y = batch
        self.got.append([self.current_epoch, ids.tolist()])
        return torch.nn.functional.cross_entropy(self.linear(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StopAt(pl.Callback):
    """Stops fit() after `step` global steps."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--launch", type=int, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--workers", type=int, default=0, help="the DataLoader's num_workers")
    args = parser.parse_args()
    callbacks = [LightningWatch()]
    if args.stop_at:
        callbacks += [StopAt(args.stop_at),
                      pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.root, "checkpoints"),
                                                   every_n_train_steps=args.stop_at,
                                                   save_top_k=-1)]
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp",
                         max_epochs=args.epochs, default_root_dir=args.root, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=bool(args.stop_at), num_sanity_val_steps=0)
    model = Logged()
    trainer.fit(model, DataLoader(Numbers(args.n), batch_size=4, shuffle=True,
                                  num_workers=args.workers),
                ckpt_path=args.resume)
    path = os.path.join(args.ids, f"launch{args.launch}_rank{trainer.global_rank}.json")
    with open(path, "w") as handle:
        json.dump(model.got, handle)


if __name__ == "__main__":
    main()
