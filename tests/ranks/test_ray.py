"""sharddemo.watch inside Ray Train's workers: a 2-worker CPU TorchTrainer on a local Ray
cluster (`ray.init(num_cpus=2)`, one Ray session for this module), a loop that watches the
loader ray.train.torch.prepare_data_loader made. Skipped where ray is not installed (the `ray`
extra; CI does not install it). Expected values: what torch's DistributedSampler(ds, 2, r,
shuffle=True, seed=0) deals after set_epoch(e) (what prepare_data_loader builds), and the ids
each worker's loop received, logged by the loop itself."""

from __future__ import annotations

import json
import warnings

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")

from support import ray_loop  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

WORKERS = 2
N, BATCH, EPOCHS = 10, 4, 2


def run(tmp_path, loop, **config) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(loop, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
                           run_config=RunConfig(storage_path=str(tmp_path / "ray"),
                                                name="watch"))
    trainer.fit()


def test_prepare_data_loader_on_two_workers_is_watched_as_it_trains(ray_cluster, tmp_path):
    """10 samples, batches of 4, 2 workers: 5 samples a worker, steps of 4 and 1, no padding
    (10 is a multiple of 2), every sample once each epoch (by hand)."""
    report = tmp_path / "w.jsonl"
    run(tmp_path, ray_loop.watched_loop, n=N, batch=BATCH, epochs=EPOCHS, report=str(report),
        log=str(tmp_path), set_epoch=True)
    data = TensorDataset(torch.arange(N))
    for rank in range(WORKERS):
        logged = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert logged["type"] == "_WrappedDataLoader", logged["type"]
        sampler = DistributedSampler(data, WORKERS, rank, shuffle=True, seed=0)
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            order = list(sampler)
            expected = [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
            assert logged["batches"][epoch] == expected, (
                f"rank {rank} epoch {epoch}: the loop got {logged['batches'][epoch]}, "
                f"DistributedSampler deals {expected}")
    # one entry per epoch, written once (by the rank-0 worker)
    entries = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(e["epoch"], e["seen"], e["unique"], e["steps"], e["ok"]) for e in entries] == [
        (0, 10, 10, [2, 2], True), (1, 10, 10, [2, 2], True)]


def test_padding_and_a_forgotten_set_epoch_are_named(ray_cluster, tmp_path):
    """11 samples on 2 workers, no set_epoch: DistributedSampler pads to 12 by repeating the
    first id of its order, and every epoch deals epoch 0's order."""
    report = tmp_path / "w.jsonl"
    run(tmp_path, ray_loop.watched_loop, n=11, batch=BATCH, epochs=EPOCHS, report=str(report),
        log=str(tmp_path), set_epoch=False)
    data = TensorDataset(torch.arange(11))
    dealt = []
    for rank in range(WORKERS):
        logged = json.loads((tmp_path / f"rank{rank}.json").read_text())
        order = list(DistributedSampler(data, WORKERS, rank, shuffle=True, seed=0))
        expected = [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
        assert logged["batches"] == [expected] * EPOCHS, f"rank {rank}: {logged['batches']}"
        dealt += order
    repeated = sorted({i for i in dealt if dealt.count(i) > 1})
    entries = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(e["seen"], e["unique"], e["duplicated"]["ids"], e["duplicated"]["reasons"])
            for e in entries] == [(12, 11, repeated, ["sampler-padding"])] * EPOCHS
    assert [e["ok"] for e in entries] == [True, False]
    failed = [v for v in entries[1]["verdicts"] if not v["ok"]]
    assert [v["verdict"] for v in failed] == ["order-changes-each-epoch"]
    assert "set_epoch is never called" in failed[0]["detail"]
    # a worker runs in Ray's session folder, not where the test (or the user) started: the
    # report is given as an absolute path
    assert not logged["cwd"].startswith(str(tmp_path)), logged["cwd"]


def test_raise_stops_every_worker(ray_cluster, tmp_path):
    """on_violation="raise", no set_epoch: epoch 1 repeats epoch 0's order, and every worker
    raises ShardingViolation at the end of epoch 1, before its loop logs anything."""
    from ray.train import TrainingFailedError

    with pytest.raises(TrainingFailedError) as failed:
        run(tmp_path, ray_loop.watched_loop, n=11, batch=BATCH, epochs=EPOCHS,
            report=str(tmp_path / "w.jsonl"), log=str(tmp_path), set_epoch=False,
            on_violation="raise")
    from sharddemo import ShardingViolation

    raised = failed.value.worker_failures  # Ray's own record: each worker's exception
    assert sorted(raised) == list(range(WORKERS)), raised
    for rank, error in raised.items():
        assert isinstance(error, ShardingViolation), f"rank {rank}: {error!r}"
        assert error.entry["epoch"] == 1 and not error.entry["ok"], error.entry
    # no worker got past epoch 1 to log its batches
    assert not list(tmp_path.glob("rank*.json"))


def test_a_loader_watched_in_the_driver_says_once_where_the_watch_belongs(ray_cluster,
                                                                          tmp_path):
    """watch() in the driver on a loader shipped to the workers in train_loop_config, which
    prepare and iterate it: the watch does not travel (the workers get the plain loader), so
    the driver warns once, as Ray pickles the loader (three times here), naming where watch()
    goes. The workers train as unwatched: DistributedSampler(ds, 2, r, shuffle=True, seed=0)'s
    batches after set_epoch(e); no report is written."""
    from sharddemo import watch

    data = TensorDataset(torch.arange(N))
    report = tmp_path / "w.jsonl"
    loader = watch(DataLoader(data, batch_size=BATCH, shuffle=True), report=str(report))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(tmp_path, ray_loop.shipped_loop, loader=loader, epochs=EPOCHS, log=str(tmp_path))
    said = [str(w.message) for w in caught if "sharddemo.watch" in str(w.message)]
    assert len(said) == 1, said
    assert "inside train_loop_per_worker" in said[0] and "prepare_data_loader" in said[0]
    for rank in range(WORKERS):
        logged = json.loads((tmp_path / f"rank{rank}.json").read_text())
        sampler = DistributedSampler(data, WORKERS, rank, shuffle=True, seed=0)
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            order = list(sampler)
            assert logged["batches"][epoch] == [order[i:i + BATCH]
                                                for i in range(0, len(order), BATCH)]
    assert not report.exists()


def test_workers_that_each_read_everything_are_not_told_of_padding(ray_cluster, tmp_path):
    """A DistributedSampler of the user's for 1 replica, which prepare_data_loader keeps: both
    workers read all 10 samples in the order DistributedSampler(ds, 1, 0, shuffle=True,
    seed=0) deals, which pads nothing (its own order is 10 long): 20 seen, 10 distinct,
    replication, and neither the verdicts nor the printed line speak of padding."""
    report = tmp_path / "w.jsonl"
    run(tmp_path, ray_loop.watched_loop, n=N, batch=BATCH, epochs=1, report=str(report),
        log=str(tmp_path), set_epoch=True, replicas=1)
    sampler = DistributedSampler(TensorDataset(torch.arange(N)), 1, 0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    order = list(sampler)
    assert sorted(order) == list(range(N))  # no id added: no padding
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORKERS)]
    for log in logs:
        assert log["batches"] == [[order[i:i + BATCH] for i in range(0, N, BATCH)]]
    [entry] = [json.loads(line) for line in report.read_text().splitlines()]
    assert (entry["seen"], entry["unique"], entry["duplicated"]["reasons"]) == (
        WORKERS * N, N, ["replication"])
    failed = {v["verdict"]: v["detail"] for v in entry["verdicts"] if not v["ok"]}
    assert "no-silent-replication" in failed and "no-unexplained-duplicates" in failed, failed
    [line] = [text for log in logs for text in log["printed"] if text.startswith("sharddemo:")]
    assert "FAIL" in line and "padding" not in line + " ".join(failed.values()), line


def test_lineage_in_workers_holds_every_step_of_the_last_epoch(ray_cluster, tmp_path):
    """lineage= inside Ray Train's workers, 24 samples, batches of 4, 2 epochs (3 steps an
    epoch a worker, by hand): a worker ends without the interpreter's exit handlers, so each
    epoch is written at its end; the lineage holds every step each worker's loop logged, the
    last epoch's included."""
    from sharddemo.lineage import Lineage

    folder = tmp_path / "lineage"
    run(tmp_path, ray_loop.watched_loop, n=24, batch=BATCH, epochs=EPOCHS,
        report=str(tmp_path / "w.jsonl"), log=str(tmp_path), set_epoch=True,
        lineage=str(folder))
    lineage = Lineage(str(folder))
    assert lineage.ranks() == [0, 1]
    for rank in range(WORKERS):
        batches = json.loads((tmp_path / f"rank{rank}.json").read_text())["batches"]
        expected = [[epoch, ids] for epoch, got in enumerate(batches) for ids in got]
        assert len(expected) == 6
        written = [[b["epoch"], b["ids"]] for k in range(len(expected))
                   for b in lineage.at_step(k, rank)]
        assert written == expected, rank
