"""LightningDataModule factories for `sharddemo audit --lightning` (needs `pip install -e '.[lightning]'`).

Small in-memory datasets, nothing downloaded. sharddemo runs train_dataloader() and
val_dataloader() through Lightning's own distributed-sampler injection (what Trainer.fit does
with strategy="ddp"), then walks what each rank receives; nothing is trained.

    sharddemo audit --lightning examples/lightning_example.py:make_datamodule
    sharddemo audit --lightning examples/lightning_example.py:make_stream_datamodule --id-field idx
    sharddemo audit --lightning examples/lightning_example.py:make_weighted_datamodule

make_datamodule: correct. Lightning swaps in a DistributedSampler and sets its epoch each
epoch, so train is sharded and reshuffled; val (8 samples on 2 or 4 ranks) splits evenly.

make_weighted_datamodule: correct. A WeightedRandomSampler (imbalanced classes) in train:
Lightning wraps it in its DistributedSamplerWrapper, which shards each epoch's draw over the
ranks; the draw repeats some samples and skips others, by design (`sampler-draws`).

make_stream_datamodule, two classic mistakes: the train set is an IterableDataset, on which
Lightning cannot put a sampler, so unless the dataset splits itself by rank every rank trains on
every sample; and the val set (7 samples on 2 ranks) is padded by Lightning's DistributedSampler:
one sample is validated twice and the logged val metrics count it twice (Lightning warns, and
advises validating on one device). A stream has no indices to record: --id-field idx reads the
ids from the batches.
"""

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

N_TRAIN = 10
N_VAL = 8
N_VAL_UNEVEN = 7


def _lightning():
    """Lightning as you have it: `pytorch_lightning` (package pytorch-lightning, the one most
    users install) or `lightning.pytorch` (package lightning); sharddemo audits either."""
    try:
        import pytorch_lightning as pl
    except ImportError:
        import lightning.pytorch as pl

    return pl


class Numbers(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i)]), "idx": torch.tensor(i)}


class NumberStream(IterableDataset):
    """Yields every sample, whichever rank reads it (the mistake)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"x": torch.tensor([float(i)]), "idx": torch.tensor(i)}


def make_datamodule(batch_size: int = 2):
    pl = _lightning()

    class Numbers_DataModule(pl.LightningDataModule):
        def setup(self, stage=None):
            self.train, self.val = Numbers(N_TRAIN), Numbers(N_VAL)

        def train_dataloader(self):
            return DataLoader(self.train, batch_size=batch_size, shuffle=True)

        def val_dataloader(self):
            return DataLoader(self.val, batch_size=batch_size)

    return Numbers_DataModule()


def make_stream_datamodule(batch_size: int = 2):
    pl = _lightning()

    class Stream_DataModule(pl.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(NumberStream(N_TRAIN), batch_size=batch_size)

        def val_dataloader(self):
            return DataLoader(Numbers(N_VAL_UNEVEN), batch_size=batch_size)

    return Stream_DataModule()


# make_weighted_datamodule's class weights: odd ids drawn three times as often as even ones
WEIGHTS = [3.0 if i % 2 else 1.0 for i in range(N_TRAIN)]


def make_weighted_datamodule(batch_size: int = 2):
    pl = _lightning()

    class Weighted_DataModule(pl.LightningDataModule):
        def train_dataloader(self):
            sampler = torch.utils.data.WeightedRandomSampler(
                WEIGHTS, N_TRAIN, generator=torch.Generator().manual_seed(1))
            return DataLoader(Numbers(N_TRAIN), batch_size=batch_size, sampler=sampler)

        def val_dataloader(self):
            return DataLoader(Numbers(N_VAL), batch_size=batch_size)

    return Weighted_DataModule()
