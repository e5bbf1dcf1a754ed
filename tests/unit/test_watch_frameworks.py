"""TrainerWatch and LightningWatch in one process: a transformers without
get_resumed_dataloader, and the evaluations / validations of a resumed fit numbered on. The
watched fits on 2 real ranks: tests/ranks/test_watch_frameworks.py."""

from __future__ import annotations


import pytest
from support.frameworks import example
from support.reports import entries

pytest.importorskip("transformers")


def test_trainer_watch_on_a_transformers_without_get_resumed_dataloader(
        tmp_path, monkeypatch, fresh_accelerate_state):
    """transformers 5.17.0 (allowed by the extra's transformers>=5.0) has no
    Trainer.get_resumed_dataloader, and TrainerWatch made Trainer(...) raise AttributeError
    there. Shown here with the attribute removed from the class, in one process: the Trainer
    is built and trains an epoch, watched; and the skip_first_batches such a transformers
    calls for a resume (transformers.trainer's own name) returns a loader the same watch
    holds. Expected: the Trainer's own loader (its length) and the ids the loop received."""
    import transformers.trainer as module
    from transformers import Trainer

    from sharddemo.integrations import TrainerWatch

    # (raising=False: the lowest transformers the extra allows, 5.0.0, has none either;
    # .ci/lowest runs this test there)
    monkeypatch.delattr(Trainer, "get_resumed_dataloader", raising=False)
    monkeypatch.setattr(module, "skip_first_batches", module.skip_first_batches)  # restored
    trainer = example("watch_trainer").make_trainer(str(tmp_path / "run"), 1)
    assert not hasattr(trainer, "get_resumed_dataloader")
    trainer.train()
    steps = len(trainer.get_train_dataloader())  # 40 samples, batches of 4, one process
    got = entries(tmp_path / "run" / "sharddemo-watch.jsonl")
    train = [e for e in got if e["loader"] == "train"]
    assert [(e["epoch"], e["seen"], e["steps"], e["ok"]) for e in train] == [(0, 40, [steps],
                                                                              True)]
    assert [e["loader"] for e in got].count("eval") == 1
    watcher = next(c for c in trainer.callback_handler.callbacks if isinstance(c, TrainerWatch))
    loader = watcher.train_loader
    resumed = module.skip_first_batches(loader, 3)  # what a resumed epoch's loop receives
    assert resumed is not loader
    assert resumed.__dict__["_sharddemo_watch"] is loader.__dict__["_sharddemo_watch"]
    ids = [int(i) for batch in resumed for i in batch["x"][:, 0]]
    last = entries(tmp_path / "run" / "sharddemo-watch.jsonl")[-1]
    assert (last["loader"], last["seen"], last["steps"]) == ("train", len(ids), [steps - 3])


def test_a_resumed_trainer_numbers_its_evaluations_on(tmp_path, fresh_accelerate_state):
    """One process, 40 samples in batches of 4: 10 steps an epoch, an evaluation (7 samples)
    at each epoch's end. Stopped at step 13, with a checkpoint there (after epoch 0's
    evaluation), then resumed from it in a new Trainer: the resumed run numbers its
    evaluations on from the checkpoint's, as many as the Trainer's own log history in that
    checkpoint holds, instead of starting again at eval epoch 0. (The Trainer also evaluates
    as the stopped run ends, after the checkpoint: the resumed run does that part again, and
    its evaluation has that number again, as its steps do.)"""
    import json

    wt = example("watch_trainer")
    out = tmp_path / "run"
    report = out / "sharddemo-watch.jsonl"
    wt.make_trainer(str(out), 2, stop_at=13).train()
    stopped = [e["epoch"] for e in entries(report) if e["loader"] == "eval"]
    assert stopped == list(range(len(stopped)))
    history = json.loads((out / "checkpoint-13" / "trainer_state.json").read_text())
    before = sum("eval_loss" in h for h in history["log_history"])
    assert before >= 1  # epoch 0's evaluation
    wt.make_trainer(str(out), 2).train(resume_from_checkpoint=True)
    resumed = [e for e in entries(report) if e["loader"] == "eval"][len(stopped):]
    assert [(e["epoch"], e["seen"], e["ok"]) for e in resumed] == [(before, 7, True)]


def test_a_resumed_lightning_fit_numbers_its_validations_on(tmp_path):
    """One device, in this process: 40 samples in batches of 4 (10 steps an epoch), a
    validation pass at each epoch's end. A checkpoint at step 13 (after epoch 0's validation
    at step 10, by hand), the fit stopped there, then fit(ckpt_path=...) in a new Trainer: the
    resumed fit's validation is the run's second, val epoch 1, not a second val epoch 0.
    (Lightning also validates as the stopped fit ends, after the checkpoint: the resumed fit
    does that pass again, with that number again.)"""
    pytest.importorskip("pytorch_lightning")
    from torch.utils.data import DataLoader

    wl = example("watch_lightning")
    pl = wl.pl
    from sharddemo.integrations import LightningWatch

    def fit(*callbacks, ckpt_path=None):
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2,
                             default_root_dir=str(tmp_path), callbacks=[LightningWatch(),
                                                                        *callbacks],
                             enable_progress_bar=False, enable_model_summary=False,
                             logger=False, enable_checkpointing=bool(callbacks),
                             num_sanity_val_steps=0)
        trainer.fit(wl.Tiny(), DataLoader(wl.Numbers(40), batch_size=4, shuffle=True),
                    DataLoader(wl.Numbers(7), batch_size=2), ckpt_path=ckpt_path)

    fit(wl.StopAt(13), pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "checkpoints"),
                                                     every_n_train_steps=13, save_top_k=-1))
    report = tmp_path / "sharddemo-watch.jsonl"
    stopped = [e["epoch"] for e in entries(report) if e["loader"] == "val"]
    assert stopped == [0, 1]  # epoch 0's end, and the stop
    fit(ckpt_path=str(tmp_path / "checkpoints" / "epoch=1-step=13.ckpt"))
    resumed = [e for e in entries(report) if e["loader"] == "val"][len(stopped):]
    assert [(e["epoch"], e["seen"], e["ok"]) for e in resumed] == [(1, 7, True)]
