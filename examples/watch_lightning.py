"""Lightning's fit() checked as it trains: one callback, sharddemo's LightningWatch.

    python examples/watch_lightning.py        # Lightning starts 2 CPU processes (DDP, gloo)

A tiny model on 40 samples, 2 epochs, validation on 7 samples after each. Lightning gives the
val loader a DistributedSampler that pads 7 samples to 8 on 2 ranks (as its own warning says):
the val lines FAIL eval-counts-each-sample-once, the train lines pass. Works with
`pytorch_lightning` and with `lightning.pytorch`, whichever is installed.

    python examples/watch_lightning.py --root run --stop-at 3            # a checkpoint, stop
    python examples/watch_lightning.py --root run --resume run/checkpoints/epoch=0-step=3.ckpt
"""

import argparse

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
        return torch.tensor([float(i), float(i)]), torch.tensor(i % 2)


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.linear(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.linear(x), y),
                 sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StopAt(pl.Callback):
    """Stops fit() after `step` steps, as a job that runs out of time does."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=".")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--stop-at", type=int, help="checkpoint and stop after this many steps")
    parser.add_argument("--resume", help="fit(ckpt_path=...) from this checkpoint")
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--limit-train-batches", type=float, default=1.0)
    args = parser.parse_args()
    callbacks = [LightningWatch()]
    if args.stop_at:
        callbacks += [StopAt(args.stop_at),
                      pl.callbacks.ModelCheckpoint(dirpath=f"{args.root}/checkpoints",
                                                   every_n_train_steps=args.stop_at,
                                                   save_top_k=-1)]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                         default_root_dir=args.root, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=bool(args.stop_at), num_sanity_val_steps=0,
                         max_steps=args.max_steps, limit_train_batches=args.limit_train_batches)
    trainer.fit(Tiny(), DataLoader(Numbers(40), batch_size=4, shuffle=True),
                DataLoader(Numbers(7), batch_size=2), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
