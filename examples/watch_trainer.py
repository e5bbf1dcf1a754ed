"""Trainer.train() checked as it trains: one callback, sharddemo's TrainerWatch.

    accelerate launch --config_file accelerate_configs/cpu2.yaml examples/watch_trainer.py

A tiny model on 40 in-memory samples (nothing is downloaded), 2 epochs, an evaluation (7
samples) after each. The main process prints one line per loader and epoch and appends one JSON
object to <output_dir>/sharddemo-watch.jsonl (docs/watch.md). No id column is needed: the ids
are the indices the Trainer's own samplers hand out, and remove_unused_columns stays True.

    ... examples/watch_trainer.py --output-dir run --stop-at 3    # a checkpoint at step 3, stop
    ... examples/watch_trainer.py --output-dir run --resume       # resume: the epoch is checked
                                                                  # against what came before
"""

import argparse
import tempfile

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

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


class StopAt(TrainerCallback):
    """Stops training after `step` optimizer steps, as a job that runs out of time does."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def make_trainer(output_dir=None, epochs: int = 2, stop_at=None, lineage=None, model=None,
                 accumulation: int = 1, callbacks=(), max_steps: int = -1) -> Trainer:
    saving = dict(save_strategy="steps", save_steps=stop_at) if stop_at else dict(
        save_strategy="no")
    training = TrainingArguments(output_dir=output_dir or tempfile.mkdtemp(),
                                 num_train_epochs=epochs, per_device_train_batch_size=4,
                                 per_device_eval_batch_size=2, eval_strategy="epoch",
                                 report_to=[], use_cpu=True, seed=0,
                                 gradient_accumulation_steps=accumulation, max_steps=max_steps,
                                 **saving)
    callbacks = [TrainerWatch(lineage=lineage), *callbacks] + (
        [StopAt(stop_at)] if stop_at else [])
    return Trainer(model=model or TinyModel(), args=training, train_dataset=Numbers(40),
                   eval_dataset=Numbers(7), callbacks=callbacks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--stop-at", type=int, help="save a checkpoint and stop after this "
                        "many steps")
    parser.add_argument("--resume", action="store_true",
                        help="resume from the last checkpoint in --output-dir")
    parser.add_argument("--max-steps", type=int, default=-1,
                        help="stop after this many steps (the epoch stopped in is partial)")
    args = parser.parse_args()
    make_trainer(args.output_dir, args.epochs, args.stop_at, max_steps=args.max_steps).train(
        resume_from_checkpoint=True if args.resume else None)


if __name__ == "__main__":
    main()
