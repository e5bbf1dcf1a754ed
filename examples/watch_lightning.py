"""Lightning's fit() checked as it trains: one callback, sharddemo's LightningWatch.

    python examples/watch_lightning.py        # Lightning starts 2 CPU processes (DDP, gloo)

A tiny model on 40 samples, 2 epochs, validation on 7 samples after each. Lightning gives the
val loader a DistributedSampler that pads 7 samples to 8 on 2 ranks (as its own warning says):
the val lines FAIL eval-counts-each-sample-once, the train lines pass. Works with
`pytorch_lightning` and with `lightning.pytorch`, whichever is installed.
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=".")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                         default_root_dir=args.root, callbacks=[LightningWatch()],
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(Tiny(), DataLoader(Numbers(40), batch_size=4, shuffle=True),
                DataLoader(Numbers(7), batch_size=2))


if __name__ == "__main__":
    main()
