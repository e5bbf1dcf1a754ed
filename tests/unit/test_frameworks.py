"""`audit --trainer` and `audit --lightning`, the parts that need no rank: a factory that
returns something else is a usage error, and Lightning's own functions build the loaders (its
DistributedSampler injection, shuffle for a train loader). On 2 real ranks:
tests/ranks/test_frameworks.py."""

from __future__ import annotations


import pytest
import torch


def test_a_factory_that_returns_something_else_is_a_usage_error():
    from sharddemo.rank.frameworks.lightning import lightning_loaders
    from sharddemo.rank.frameworks.trainer import trainer_loaders
    from sharddemo.options import AuditOptions
    from sharddemo.errors import UsageError

    opts = AuditOptions(target="f.py:make", framework="trainer")
    with pytest.raises(UsageError, match="returned a DataLoader, not a transformers.Trainer"):
        trainer_loaders(None, lambda: torch.utils.data.DataLoader(range(3)), opts)
    with pytest.raises(UsageError, match="returned a int, not a LightningDataModule"):
        lightning_loaders(None, lambda: 3, opts)


def test_a_pytorch_lightning_datamodule_gets_pytorch_lightnings_own_functions():
    """Lightning ships twice (lightning.pytorch and pytorch_lightning); a Trainer accepts only
    its own package's datamodules, so the adapter takes the functions of the package the
    datamodule's class comes from."""
    import lightning.pytorch
    import pytorch_lightning

    from sharddemo.rank.frameworks.lightning import _modules, _package

    class Old(pytorch_lightning.LightningDataModule):
        pass

    class New(lightning.pytorch.LightningDataModule):
        pass

    assert _package(Old()) == "pytorch_lightning" and _package(New()) == "lightning.pytorch"
    m = _modules("pytorch_lightning")
    assert m["pl"] is pytorch_lightning
    assert m["data"]._process_dataloader.__module__.startswith("pytorch_lightning.")
    assert m["fabric_data"].__name__ == "lightning_fabric.utilities.data"


def test_lightning_shuffles_a_train_loader_written_with_shuffle_false():
    """Lightning's own _get_distributed_sampler and _update_dataloader, called as its
    _process_dataloader calls them (shuffle=True for every train loader, whatever the loader
    says; shuffle as written for val): a train loader written with shuffle=False comes out
    shuffled, and the note says so; one written with shuffle=True, or the val loader, gets
    none. In process: no launch."""
    from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import DataLoader

    from sharddemo.rank.frameworks.lightning import shuffle_note

    def processed(written, shuffle, stage):
        sampler = _get_distributed_sampler(written, shuffle=shuffle, overfit_batches=0,
                                           mode=stage, num_replicas=2, rank=0)
        return _update_dataloader(written, sampler, mode=stage)

    plain = DataLoader(range(11), batch_size=2)
    made = processed(plain, True, RunningStage.TRAINING)
    assert made.sampler.shuffle is True  # Lightning's own sampler shuffles
    note = shuffle_note(plain, made)
    assert note.startswith("your train_dataloader() has shuffle=False, but Lightning gives "
                           "every train loader a shuffling DistributedSampler")
    shuffled = DataLoader(range(11), batch_size=2, shuffle=True)
    assert shuffle_note(shuffled, processed(shuffled, True, RunningStage.TRAINING)) is None
    assert shuffle_note(plain, processed(plain, False, RunningStage.VALIDATING)) is None
