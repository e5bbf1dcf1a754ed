"""Trainer.train() checked as it trains: one callback, sharddemo's TrainerWatch.

    accelerate launch --config_file accelerate_configs/cpu2.yaml examples/watch_trainer.py

A tiny model on 40 in-memory samples (nothing is downloaded), 2 epochs, an evaluation (7
samples) after each. The main process prints one line per loader and epoch and appends one JSON
object to <output_dir>/sharddemo-watch.jsonl (docs/watch.md). No id column is needed: the ids
are the indices the Trainer's own samplers hand out, and remove_unused_columns stays True.
"""

import argparse
import tempfile

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from sharddemo.integrations import TrainerWatch


class Numbers(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i), float(i)]), "labels": torch.tensor(i % 2)}


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def make_trainer(output_dir=None, epochs: int = 2) -> Trainer:
    training = TrainingArguments(output_dir=output_dir or tempfile.mkdtemp(),
                                 num_train_epochs=epochs, per_device_train_batch_size=4,
                                 per_device_eval_batch_size=2, eval_strategy="epoch",
                                 save_strategy="no", report_to=[], use_cpu=True, seed=0)
    return Trainer(model=TinyModel(), args=training, train_dataset=Numbers(40),
                   eval_dataset=Numbers(7), callbacks=[TrainerWatch()])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    make_trainer(args.output_dir, args.epochs).train()


if __name__ == "__main__":
    main()
