"""transformers.Trainer factories for `sharddemo audit --trainer` (needs `pip install -e '.[hf]'`).

A tiny model on a small in-memory dataset (nothing is downloaded). sharddemo calls the Trainer's
own get_train_dataloader() and get_eval_dataloader() on every rank; nothing is trained.

    sharddemo audit --trainer examples/trainer_example.py:make_trainer
    sharddemo audit --trainer examples/trainer_example.py:make_trainer_double_split   # the mistake
    sharddemo audit --trainer examples/trainer_example.py:make_trainer_drop_last      # eval loses samples
    sharddemo audit --trainer examples/trainer_example.py:make_trainer_two_evals      # a dict of eval sets
    sharddemo audit --trainer examples/trainer_example.py:make_trainer_batch_rebalance  # rank-aware sampler

make_trainer: correct; train is sharded and reshuffled each epoch, eval is padded by
accelerate and gather_for_metrics drops the padding (the eval metrics count each sample once).

make_trainer_double_split: a Trainer subclass returns a DistributedSampler from
_get_train_sampler, as older recipes did. accelerator.prepare shards it again: every rank
deals its half round-robin once more and some samples are never trained on
(transformers issue 34365).

make_trainer_drop_last: dataloader_drop_last=True applies to eval too: the last incomplete
round of the eval set is never evaluated.

make_trainer_two_evals: eval_dataset is a dict of eval sets (4 and 7 samples, and a random_split
part: 4 of 12); the Trainer evaluates each with its own loader, and the report has a mode for
each (the part is held to its own 4 samples: the other 8 are not its data).

make_trainer_batch_rebalance: train_sampling_strategy="batch_rebalance" (transformers 5): the
Trainer's BatchRebalanceSampler deals each rank its own micro-batches, of sizes that vary with
the samples' lengths (a `length` column), and the Trainer keeps accelerate from sharding them
again.
"""

import tempfile

import torch
from torch import nn
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

N_TRAIN = 10
N_EVAL = 7


class Numbers(Dataset):
    """Sample i is (x = [i, i], label i % 2); `idx` carries the id (the model accepts it)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i), float(i)]), "labels": torch.tensor(i % 2),
                "idx": torch.tensor(i)}


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x, labels=None, idx=None):
        logits = self.linear(x)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def _arguments(**overrides):
    from transformers import TrainingArguments

    settings = dict(output_dir=tempfile.mkdtemp(prefix="sharddemo-trainer-"),
                    per_device_train_batch_size=2, per_device_eval_batch_size=2,
                    gradient_accumulation_steps=2, seed=42, report_to=[], use_cpu=True)
    settings.update(overrides)
    return TrainingArguments(**settings)


def make_trainer(**overrides):
    from transformers import Trainer

    return Trainer(model=TinyModel(), args=_arguments(**overrides),
                   train_dataset=Numbers(N_TRAIN), eval_dataset=Numbers(N_EVAL))


def make_trainer_drop_last():
    return make_trainer(dataloader_drop_last=True)


# Token lengths for make_trainer_batch_rebalance: what its sampler balances across the ranks.
LENGTHS = [5, 40, 12, 33, 8, 21, 50, 3, 17, 26, 9, 44]


def make_trainer_batch_rebalance():
    from datasets import Dataset as HFDataset
    from transformers import Trainer

    n = len(LENGTHS)
    train = HFDataset.from_dict({"x": [[float(i), float(i)] for i in range(n)],
                                 "labels": [i % 2 for i in range(n)], "idx": list(range(n)),
                                 "length": LENGTHS}).with_format("torch")
    # remove_unused_columns=False keeps `length`, which the sampler reads (nothing is trained)
    return Trainer(model=TinyModel(), args=_arguments(train_sampling_strategy="batch_rebalance",
                                                       remove_unused_columns=False),
                   train_dataset=train)


def make_trainer_two_evals():
    from torch.utils.data import random_split
    from transformers import Trainer

    # "held_out": the 4 of 12 samples random_split keeps out of a training part
    _, held_out = random_split(Numbers(12), [8, 4], generator=torch.Generator().manual_seed(0))
    return Trainer(model=TinyModel(), args=_arguments(), train_dataset=Numbers(N_TRAIN),
                   eval_dataset={"short": Numbers(4), "long": Numbers(N_EVAL),
                                 "held_out": held_out})


def make_trainer_double_split():
    from transformers import Trainer

    class ShardingTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return DistributedSampler(self.train_dataset, num_replicas=self.args.world_size,
                                      rank=self.args.process_index, seed=self.args.seed)

    return ShardingTrainer(model=TinyModel(), args=_arguments(),
                           train_dataset=Numbers(N_TRAIN), eval_dataset=Numbers(N_EVAL))
