"""`audit --trainer` and `audit --lightning` on 2 real gloo ranks.

Every expected value comes from the frameworks' own objects built in this process for each rank:
the Trainer's own get_train_dataloader()/get_eval_dataloader() dealt by accelerate's own
prepare_data_loader for that rank, and torch's DistributedSampler with the arguments Lightning
gives it (Lightning's docs: shuffle for train, not for val, seed PL_GLOBAL_SEED or 0). The audit
records ids by the dataset indices it traces; the expected values read the `idx` field of the
batches, a second, independent way."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from support.launch import ROOT, launch_env, sharddemo
from support.frameworks import W, example, trainer_for_rank

EXAMPLES = ROOT / "examples"
TRAINER = f"{EXAMPLES / 'trainer_example.py'}"
LIGHTNING = f"{EXAMPLES / 'lightning_example.py'}"
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


def audit_json(*args):
    import jsonschema

    proc = sharddemo(["audit", *args, "--num-processes", str(W), "--format", "json"],
                     check=False)
    assert proc.returncode in (0, 1) and proc.stdout.strip(), proc.stderr
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    return proc, report


def trainer_batches_for_rank(make_trainer, rank, epochs, monkeypatch):
    """What rank `rank` of W receives from the Trainer's own loaders (trainer_for_rank), each
    train epoch started as Trainer._run_epoch starts it (transformers 5: set_epoch on the
    loader and on the batch sampler it wraps)."""
    trainer = trainer_for_rank(make_trainer, rank, monkeypatch)
    train = trainer.get_train_dataloader()
    out = []
    for epoch in range(epochs):
        train.set_epoch(epoch)
        train.batch_sampler.batch_sampler.sampler.set_epoch(epoch) \
            if hasattr(train.batch_sampler.batch_sampler.sampler, "set_epoch") else None
        out.append([b["idx"].tolist() for b in train])
    evaluation = [b["idx"].tolist() for b in trainer.get_eval_dataloader()]
    return out, evaluation, trainer.args.gradient_accumulation_steps


def test_trainer_loaders_are_what_the_trainer_gives_each_rank(monkeypatch, fresh_accelerate_state):
    proc, report = audit_json("--trainer", f"{TRAINER}:make_trainer")
    assert proc.returncode == 0, report["broken_promises"]
    train, evaluation = report["modes"]["trainer:train"], report["modes"]["trainer:eval"]
    te = example("trainer_example")
    expected = [trainer_batches_for_rank(te.make_trainer, r, 2, monkeypatch) for r in range(W)]
    for epoch in range(2):
        got = [r["batches"] for r in train["epochs"][epoch]["ranks"]]
        assert got == [expected[r][0][epoch] for r in range(W)]
    assert [r["batches"] for r in evaluation["epochs"][0]["ranks"]] == [e[1] for e in expected]
    assert train["dataset_size"] == te.N_TRAIN and evaluation["dataset_size"] == te.N_EVAL
    assert train["settings"]["per_device_train_batch_size"] == 2
    # eval: N_EVAL = 7 on 2 ranks of batch 2 is 2 rounds of 4 = 8 ids: one is accelerate's fill,
    # and gather_for_metrics gives back exactly the 7 (worked out by hand)
    e0 = evaluation["epochs"][0]
    assert e0["gathered_count"] == 8 and e0["gathered_for_metrics_count"] == te.N_EVAL
    assert e0["gather_for_metrics_exact"] and list(e0["reasons"]) == ["even-batches-fill"]
    ok = {v["verdict"]: v["ok"] for v in evaluation["verdicts"]}
    assert ok["eval-counts-each-sample-once"]
    # gradient accumulation, the Trainer's own gradient_accumulation_steps (2): N=10, B=2, W=2
    # gives ceil(10/4) = 3 batches per rank, so optimizer steps of 2 batches and then 1
    k = expected[0][2]
    for epoch in range(2):
        windows = train["epochs"][epoch]["grad_accum"]
        assert windows["k"] == k == 2 and windows["optimizer_steps"] == 2
        assert windows["uneven_last"] and windows["last_batches"] == [1, 1]
        for j, w in enumerate(windows["windows"]):
            for r in range(W):
                mine = expected[r][0][epoch][j * k:(j + 1) * k]
                assert w["ranks"][r] == [i for b in mine for i in b]
        # the windows partition the epoch: together they are every id each rank received
        assert sorted(i for w in windows["windows"] for ids in w["ranks"] for i in ids) == \
            sorted(i for r in range(W) for b in expected[r][0][epoch] for i in b)


def test_trainer_drop_last_hides_eval_samples(monkeypatch, fresh_accelerate_state):
    # Through the testing API this time (sharddemo.testing.audit, framework="trainer").
    import jsonschema

    from sharddemo.testing import audit

    report = audit(f"{TRAINER}:make_trainer_drop_last", framework="trainer", epochs=1)
    jsonschema.validate(report, SCHEMA)
    te = example("trainer_example")
    expected = [trainer_batches_for_rank(te.make_trainer_drop_last, r, 1, monkeypatch)
                for r in range(W)]
    evaluation = report["modes"]["trainer:eval"]
    got = [r["batches"] for r in evaluation["epochs"][0]["ranks"]]
    assert got == [e[1] for e in expected]
    seen = {i for e in expected for b in e[1] for i in b}
    never = sorted(set(range(te.N_EVAL)) - seen)
    assert never  # 7 on 2 ranks of batch 2 with drop_last: one round of 4, 3 never evaluated
    failed = [v for v in evaluation["verdicts"] if not v["ok"]]
    assert [v["verdict"] for v in failed] == ["eval-counts-each-sample-once"]
    assert f"{len(never)} of {te.N_EVAL} eval samples are never evaluated (drop_last)" in \
        failed[0]["detail"]


def test_trainer_dict_eval_sets_each_get_a_mode(monkeypatch, fresh_accelerate_state):
    """eval_dataset={"short": 4 samples, "long": 7, "held_out": a random_split part}: one mode
    per entry, each what the Trainer's own get_eval_dataloader(name) gives each rank (dealt by
    accelerate's own prepare_data_loader for that rank)."""
    from torch.utils.data import random_split

    proc, report = audit_json("--trainer", f"{TRAINER}:make_trainer_two_evals", "--epochs", "1")
    assert proc.returncode == 0, report["broken_promises"]
    assert set(report["modes"]) == {"trainer:train", "trainer:eval:short", "trainer:eval:long",
                                    "trainer:eval:held_out"}
    te = example("trainer_example")
    # the part: torch's random_split, seeded as the factory seeds it; the ids are the 12's
    _, part = random_split(range(12), [8, 4], generator=torch.Generator().manual_seed(0))
    mode = report["modes"]["trainer:eval:held_out"]
    expected = []
    for rank in range(W):
        trainer = trainer_for_rank(te.make_trainer_two_evals, rank, monkeypatch)
        expected.append([b["idx"].tolist() for b in trainer.get_eval_dataloader("held_out")])
    assert [r["batches"] for r in mode["epochs"][0]["ranks"]] == expected
    assert sorted(i for r in expected for b in r for i in b) == sorted(part.indices)
    e0 = mode["epochs"][0]
    assert mode["dataset_size"] == 12 and e0["missing_reason"] == "subset"
    assert e0["missing"] == sorted(set(range(12)) - set(part.indices))
    assert e0["gathered_for_metrics_count"] == 4 and e0["gather_for_metrics_exact"]
    assert all(v["ok"] for v in mode["verdicts"]), mode["verdicts"]
    for name, size in (("short", 4), ("long", te.N_EVAL)):
        expected = []
        for rank in range(W):
            trainer = trainer_for_rank(te.make_trainer_two_evals, rank, monkeypatch)
            expected.append([b["idx"].tolist() for b in trainer.get_eval_dataloader(name)])
        mode = report["modes"][f"trainer:eval:{name}"]
        assert [r["batches"] for r in mode["epochs"][0]["ranks"]] == expected
        assert mode["dataset_size"] == size
        # 4 on 2 ranks of batch 2: one round, nothing filled; 7: two rounds of 4, one id is
        # accelerate's even-batches fill, which gather_for_metrics drops (worked by hand)
        e0 = mode["epochs"][0]
        assert e0["gathered_count"] == (4 if size == 4 else 8)
        assert e0["gathered_for_metrics_count"] == size and e0["gather_for_metrics_exact"]
        assert {v["verdict"]: v["ok"] for v in mode["verdicts"]}["eval-counts-each-sample-once"]


def test_trainer_batch_rebalance_is_dealt_as_its_own_sampler_deals_it():
    """train_sampling_strategy="batch_rebalance" (transformers 5.17 and later): the Trainer's
    BatchRebalanceSampler is rank-aware and the Trainer turns accelerate's re-sharding off.
    Expected: transformers' own BatchRebalanceSampler for each rank, built as
    Trainer._get_train_sampler builds it, epoch by epoch as Trainer._run_epoch sets it."""
    # (added in transformers 5.17.0; .ci/lowest runs this file at 5.0.0, which has none)
    from transformers import trainer_pt_utils

    if not hasattr(trainer_pt_utils, "BatchRebalanceSampler"):
        pytest.skip("train_sampling_strategy='batch_rebalance' came with transformers 5.17.0")
    BatchRebalanceSampler = trainer_pt_utils.BatchRebalanceSampler

    proc, report = audit_json("--trainer", f"{TRAINER}:make_trainer_batch_rebalance",
                              "--epochs", "2")
    assert proc.returncode == 0, report["broken_promises"]
    te = example("trainer_example")
    train = report["modes"]["trainer:train"]
    dealt = []
    for epoch in range(2):
        expected = []
        for rank in range(W):
            # effective batch: per-device batch 2 x gradient_accumulation_steps 2 x 2 ranks
            sampler = BatchRebalanceSampler(lengths=te.LENGTHS, effective_batch_size=8,
                                            dp_size=W, grad_accum=2, rank=rank,
                                            drop_last=False)
            sampler.set_epoch(epoch)
            expected.append([[int(i) for i in b] for b in sampler])
        e = train["epochs"][epoch]
        assert [r["batches"] for r in e["ranks"]] == expected
        # every sample once over the ranks, in micro-batches whose sizes differ between ranks
        assert sorted(i for r in expected for b in r for i in b) == list(range(len(te.LENGTHS)))
        assert e["missing_count"] == 0 and e["duplicate_count"] == 0
        ragged = [k for k, (a, b) in enumerate(zip(*expected)) if len(a) != len(b)]
        assert ragged and e["ragged_steps"] == ragged
        dealt += [b for r in expected for b in r]
    # The loader has no batch size of its own: the header's is the largest micro-batch dealt.
    from sharddemo.render import render

    largest = max(len(b) for b in dealt)
    assert report["batch_size_seen"] is True and report["batch_size"] == largest
    assert f"| per-rank batch up to {largest} |" in render(report, "table").splitlines()[0]


def lightning_batches(dataset_size, rank, shuffle, epoch, batch=2):
    """torch's DistributedSampler as Lightning builds it for DDP (num_replicas, rank, shuffle
    for train only, seed PL_GLOBAL_SEED = 0 here), batched as the user's DataLoader batches."""
    from torch.utils.data import BatchSampler, DistributedSampler

    sampler = DistributedSampler(range(dataset_size), num_replicas=W, rank=rank, shuffle=shuffle,
                                 seed=0)
    sampler.set_epoch(epoch)
    return [list(b) for b in BatchSampler(sampler, batch, drop_last=False)]


def test_lightning_loaders_are_lightnings_distributed_samplers():
    proc, report = audit_json("--lightning", f"{LIGHTNING}:make_datamodule", "--grad-accum", "2")
    assert proc.returncode == 0, report["broken_promises"]
    le = example("lightning_example")
    train, val = report["modes"]["lightning:train"], report["modes"]["lightning:val"]
    for epoch in range(2):
        assert [r["batches"] for r in train["epochs"][epoch]["ranks"]] == \
            [lightning_batches(le.N_TRAIN, r, True, epoch) for r in range(W)]
        windows = train["epochs"][epoch]["grad_accum"]
        # N=10 on 2 ranks: 5 each, batches of 2, 2, 1: optimizer steps of 2 batches, then 1
        assert windows["optimizer_steps"] == 2 and windows["last_batches"] == [1, 1]
    assert [r["batches"] for r in val["epochs"][0]["ranks"]] == \
        [lightning_batches(le.N_VAL, r, False, 0) for r in range(W)]
    assert train["settings"]["sampler"] == "DistributedSampler"
    assert all(v["ok"] for v in val["verdicts"])


def test_lightning_stream_and_padded_val_are_caught():
    le = example("lightning_example")
    # --dataset-size is the stream's N; the val set has a length of its own (7), which wins
    proc, report = audit_json("--lightning", f"{LIGHTNING}:make_stream_datamodule",
                              "--id-field", "idx", "--epochs", "1",
                              "--dataset-size", str(le.N_TRAIN))
    assert proc.returncode == 1
    train, val = report["modes"]["lightning:train"], report["modes"]["lightning:val"]
    assert train["dataset_size"] == le.N_TRAIN
    assert val["dataset_size"] == le.N_VAL_UNEVEN == 7
    assert val["epochs"][0]["missing"] == []
    # an IterableDataset gets no sampler: each rank reads the whole stream, in batches of 2
    whole = [[i, i + 1] for i in range(0, le.N_TRAIN, 2)]
    assert [r["batches"] for r in train["epochs"][0]["ranks"]] == [whole] * W
    assert not {v["verdict"]: v["ok"] for v in train["verdicts"]}["no-silent-replication"]
    expected = [lightning_batches(le.N_VAL_UNEVEN, r, False, 0) for r in range(W)]
    assert [r["batches"] for r in val["epochs"][0]["ranks"]] == expected
    # DistributedSampler pads 7 to 8: the copy is the first id of the order (torch's padding)
    padded = [i for b in expected[-1] for i in b][-1]
    e0 = val["epochs"][0]
    assert [d["id"] for d in e0["duplicates"]] == [padded]
    failed = {v["verdict"]: v for v in val["verdicts"] if not v["ok"]}
    assert "DistributedSampler padding" in failed["eval-counts-each-sample-once"]["detail"]


@pytest.mark.parametrize("args,message", [
    ([], "audit takes one of FACTORY (make_loader), --trainer or --lightning (got none)"),
    (["examples/good.py:make_loader", "--trainer", "x.py:f"], "got FACTORY and --trainer"),
    (["--trainer", f"{TRAINER}:make_trainer", "--set-epoch"], "the Trainer sets the epoch itself"),
    (["--lightning", f"{LIGHTNING}:make_datamodule", "--expect", "replicated"],
     "meant to be sharded"),
    (["--trainer", f"{TRAINER}:make_trainer", "--resume-at", "0:1"],
     "does not go with --trainer: to check how your Trainer resumes, train with "
     "callbacks=[TrainerWatch()]"),
    (["--lightning", f"{LIGHTNING}:make_datamodule", "--resume-at", "0:1"],
     "does not go with --lightning: to check how your Lightning fit resumes, train with "
     "callbacks=[LightningWatch()]"),
    (["examples/good.py:make_loader", "--grad-accum", "0"], "--grad-accum must be at least 1"),
    (["--trainer", "no/such/file.py:make_trainer"],
     "factory file no/such/file.py does not exist; pass path/to/file.py:make_trainer"),
    (["--lightning", "lightning_example"],
     "is not of the form package.module:make_datamodule or path/to/file.py:make_datamodule"),
])
def test_bad_framework_input_is_one_error_line(args, message):
    proc = sharddemo(["audit", *args], check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: ") and message in lines[0], lines


@pytest.mark.parametrize("flag,modules,extra", [
    ("--trainer", ["transformers"], "hf"),
    # either Lightning package will do: both absent
    ("--lightning", ["lightning", "pytorch_lightning"], "lightning")])
def test_a_missing_extra_is_named_before_any_rank_starts(flag, modules, extra):
    # The package hidden as if not installed (importlib finds no spec for a None module).
    hide = "; ".join(f"sys.modules[{m!r}] = None" for m in modules)
    code = (f"import sys; {hide}; from sharddemo.cli import main; "
            f"sys.argv = ['sharddemo', 'audit', {flag!r}, 'examples/trainer_example.py:f']; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=launch_env(), timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"pip install 'sharddemo[{extra}]'" in lines[0] and modules[0] in lines[0]


def test_lightning_wraps_a_weighted_sampler_and_shards_its_draw():
    """A WeightedRandomSampler under Lightning's DDP: its DistributedSamplerWrapper (shuffle,
    seed 0) shards each epoch's draw. Expected: Lightning's own wrapper over the same seeded
    sampler, one draw per epoch; the draw's repeats and gaps pass as `sampler-draws`."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import BatchSampler, WeightedRandomSampler

    le = example("lightning_example")
    proc, report = audit_json("--lightning", f"{LIGHTNING}:make_weighted_datamodule")
    assert proc.returncode == 0, report["broken_promises"]
    train = report["modes"]["lightning:train"]
    expected = []  # [rank][epoch] -> batches
    for rank in range(W):
        weighted = WeightedRandomSampler(le.WEIGHTS, le.N_TRAIN,
                                         generator=torch.Generator().manual_seed(1))
        wrapper = DistributedSamplerWrapper(weighted, num_replicas=W, rank=rank, shuffle=True,
                                            seed=0)
        epochs = []
        for epoch in range(2):
            wrapper.set_epoch(epoch)
            epochs.append([[int(i) for i in b] for b in BatchSampler(wrapper, 2, False)])
        expected.append(epochs)
    for epoch, e in enumerate(train["epochs"]):
        assert [r["batches"] for r in e["ranks"]] == [expected[r][epoch] for r in range(W)]
        assert e["duplicates"] and {d["reason"] for d in e["duplicates"]} == {"sampler-draws"}
    assert all(v["ok"] for v in train["verdicts"]), train["verdicts"]
