"""sharddemo.watch over Ray Data inside Ray Train's workers: a 2-worker CPU TorchTrainer on a
local Ray cluster (`ray.init(num_cpus=2)`, one Ray session for this module), a loop that
watches `ray.train.get_dataset_shard("train").iter_torch_batches()` with its "id" column.
Skipped where ray is not installed (the `ray` extra; CI does not install it). Expected values:
the rows each worker's iter_torch_batches yielded, logged by the loop itself, and literals
worked out by hand."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")

from support import ray_loop  # noqa: E402

WORKERS = 2
N, BATCH, EPOCHS = 11, 4, 2


def run(tmp_path, *, split: bool, **config) -> None:
    from ray.train import DataConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(ray_loop.watched_rows,
                           train_loop_config={"n": N, "batch": BATCH, "epochs": EPOCHS,
                                              "log": str(tmp_path), **config},
                           datasets={"train": ray.data.range(N)},
                           dataset_config=DataConfig(datasets_to_split="all" if split else []),
                           # half a CPU a worker: Ray Data's read tasks need the CPU left over
                           # (with a whole CPU each, the 2 workers hold both and the read
                           # waits for ever)
                           scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False,
                                                        resources_per_worker={"CPU": 0.5}),
                           run_config=RunConfig(storage_path=str(tmp_path / "ray"),
                                                name="watch"))
    trainer.fit()


def logged(tmp_path) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORKERS)]


def test_the_rows_an_equal_split_drops_are_missing_with_ray_as_the_reason(ray_cluster,
                                                                          tmp_path):
    """11 rows on 2 workers: DataConfig splits "train" with streaming_split(2, equal=True),
    5 rows a worker, 1 row reaching neither (by hand: 11 = 2 x 5 + 1). One iterable,
    iterated once an epoch."""
    report = tmp_path / "w.jsonl"
    run(tmp_path, split=True, report=str(report), per_epoch=False)
    logs = logged(tmp_path)
    assert [log["iterator"] for log in logs] == ["StreamSplitDataIterator"] * WORKERS
    entries = [json.loads(line) for line in report.read_text().splitlines()]
    assert [e["epoch"] for e in entries] == list(range(EPOCHS))
    for epoch, entry in enumerate(entries):
        rows = [i for log in logs for batch in log["batches"][epoch] for i in batch]
        missing = sorted(set(range(N)) - set(rows))
        assert len(rows) == len(set(rows)) == 10 and len(missing) == 1, (epoch, rows)
        steps = [len(log["batches"][epoch]) for log in logs]
        assert (entry["seen"], entry["unique"], entry["steps"]) == (10, 10, steps), entry
        assert entry["missing"] == {"count": 1, "ids": missing, "reason": "ray-equal-split"}
        assert entry["ok"], entry["verdicts"]
        assert "streaming_split(equal=True)" in entry["reasons"]["ray-equal-split"], entry
    assert entries[0]["world_size"] == WORKERS


def test_a_dataset_left_out_of_datasets_to_split_is_replication(ray_cluster, tmp_path):
    """DataConfig(datasets_to_split=[]): Ray hands "train" whole to each worker (ds.iterator()),
    so both workers read all 11 rows: 22 seen, 11 distinct, every row on both. The loop calls
    iter_torch_batches() (and watch) each epoch: one watch, epochs 0 and 1."""
    report = tmp_path / "w.jsonl"
    run(tmp_path, split=False, report=str(report), per_epoch=True)
    logs = logged(tmp_path)
    assert [log["iterator"] for log in logs] == ["DataIteratorImpl"] * WORKERS
    for epoch in range(EPOCHS):
        for log in logs:
            assert sorted(i for batch in log["batches"][epoch] for i in batch) == list(range(N))
    entries = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(e["epoch"], e["seen"], e["unique"], e["ok"]) for e in entries] == [
        (0, 22, 11, False), (1, 22, 11, False)]
    for entry in entries:
        failed = [v["verdict"] for v in entry["verdicts"] if not v["ok"]]
        assert "no-silent-replication" in failed, entry["verdicts"]
        assert entry["duplicated"]["reasons"] == ["replication"], entry["duplicated"]
        assert "datasets_to_split" in entry["reasons"]["replication"], entry["reasons"]
    # Ray Data pads nothing: no line, verdict or reason speaks of padding
    lines = [text for log in logs for text in log["printed"] if text.startswith("sharddemo:")]
    assert len(lines) == EPOCHS and all("FAIL" in text for text in lines), lines
    said = lines + [v["detail"] for e in entries for v in e["verdicts"]] + [
        r for e in entries for r in e["reasons"].values()]
    assert not [text for text in said if "padding" in text], said


def test_the_short_last_batches_drop_last_drops_are_in_the_line(ray_cluster, tmp_path):
    """11 rows on 2 workers, iter_torch_batches(batch_size=4, drop_last=True), one epoch: the
    equal split gives each worker 5 rows and drops 1, and drop_last drops each worker's short
    last batch of 1 (by hand: 11 = 2 x (4 + 1) + 1): 8 rows seen, 3 missing, more than the
    split's 1; explained (up to 1 + 2 x 3), and the printed line names drop_last too."""
    report = tmp_path / "w.jsonl"
    run(tmp_path, split=True, report=str(report), per_epoch=False, drop_last=True, epochs=1)
    logs = logged(tmp_path)
    rows = [i for log in logs for batch in log["batches"][0] for i in batch]
    assert [len(b) for log in logs for b in log["batches"][0]] == [BATCH] * WORKERS
    missing = sorted(set(range(N)) - set(rows))
    assert len(rows) == len(set(rows)) == 8 and len(missing) == 3, rows
    [entry] = [json.loads(line) for line in report.read_text().splitlines()]
    assert entry["missing"] == {"count": 3, "ids": missing, "reason": "ray-equal-split"}
    assert entry["ok"], entry["verdicts"]
    [line] = [text for log in logs for text in log["printed"] if text.startswith("sharddemo:")]
    assert "missing: 3 (" in line and "iter_torch_batches(drop_last=True)" in line, line


def test_ray_data_batches_in_one_process_are_watched_pass_by_pass(ray_cluster, tmp_path):
    """The driver alone (one rank), ds.iterator() over 11 rows, batches of 4: each pass is one
    epoch and yields every row once, in batches of 4, 4 and 3 (by hand; Ray's order of blocks
    varies from pass to pass, preserve_order=False, so the rows are compared as sets);
    calling iter_torch_batches() again and watching it goes on with the same watch (epochs 2
    and 3); a `break` after one batch of 4 leaves an epoch open, which close() reports as
    partial."""
    from sharddemo import watch

    iterator = ray.data.range(N).iterator()
    made = iterator.iter_torch_batches(batch_size=BATCH)
    kind = type(made)
    report = tmp_path / "w.jsonl"
    batches = watch(made, id_field="id", dataset_size=N, report=str(report))
    assert batches is made and isinstance(batches, kind)
    got = [[batch["id"].tolist() for batch in batches] for _ in range(2)]
    for _ in range(2):
        again = watch(iterator.iter_torch_batches(batch_size=BATCH), id_field="id",
                      dataset_size=N, report=str(report))
        got.append([batch["id"].tolist() for batch in again])
    for rows in got:
        assert [len(b) for b in rows] == [4, 4, 3], rows
        assert sorted(i for b in rows for i in b) == list(range(N)), rows
    for batch in batches:
        break
    batches.close()
    entries = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(e["epoch"], e["seen"], e["unique"], e["steps"], e["ok"], e.get("partial"))
            for e in entries] == [(e, N, N, [3], True, None) for e in range(4)] + [
        (4, 4, 4, [1], True, True)]


def test_ray_data_batches_need_an_id_field(ray_cluster):
    from sharddemo import watch

    with pytest.raises(ValueError, match="id_field is needed for Ray Data's batches"):
        watch(ray.data.range(N).iterator().iter_torch_batches(batch_size=BATCH), report=None)
