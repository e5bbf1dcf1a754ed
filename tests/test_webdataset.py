"""WebDataset loaders audited on real ranks (examples/webdataset_loaders.py, --id-field
__key__). Expected values come from iterating WebDataset's own pipeline in this process for
each rank and worker (its pytorch_worker_info reads RANK/WORLD_SIZE and WORKER/NUM_WORKERS
from the environment), interleaved as torch's DataLoader takes an IterableDataset's workers:
one batch from each worker in turn."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager

import jsonschema
import pytest
from conftest import ROOT, sharddemo

wds = pytest.importorskip("webdataset")
sys.path.insert(0, str(ROOT / "examples"))
import webdataset_loaders as examples  # noqa: E402

SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())
FACTORIES = "examples/webdataset_loaders.py"


@contextmanager
def as_worker(rank: int, world: int, worker: int, workers: int):
    """This process seen by WebDataset as `worker` of `workers` on `rank` of `world`."""
    keys = ("RANK", "WORLD_SIZE", "WORKER", "NUM_WORKERS")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), WORKER=str(worker),
                      NUM_WORKERS=str(workers))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def library_batches(factory, world: int) -> list[list[list[str]]]:
    """[rank] -> the batches of keys that rank's DataLoader yields, from WebDataset's own
    pipeline iterated per worker in this process."""
    out = []
    for rank in range(world):
        loader = factory(None)
        per_worker = []
        for worker in range(loader.num_workers):
            with as_worker(rank, world, worker, loader.num_workers):
                samples = list(loader.dataset)
            if loader.batch_size is None:  # batched in the pipeline
                per_worker.append([list(b["__key__"]) for b in samples])
            else:  # batched by the DataLoader, each worker its own samples
                keys = [s["__key__"] for s in samples]
                b = loader.batch_size
                per_worker.append([keys[k:k + b] for k in range(0, len(keys), b)])
        batches, step = [], 0
        while any(step < len(w) for w in per_worker):
            batches += [w[step] for w in per_worker if step < len(w)]
            step += 1
        out.append(batches)
    return out


def audit(tmp_path, name: str, *args: str, nproc: int = 2):
    out = tmp_path / f"{name}.json"
    proc = sharddemo(["audit", f"{FACTORIES}:{name}", "--id-field", "__key__",
                      "--num-processes", str(nproc), "--format", "json", "--output", str(out),
                      *args], check=False)
    report = json.loads(out.read_text()) if out.exists() else None
    if report is not None:
        jsonschema.validate(report, SCHEMA)
    return proc, report


@pytest.mark.parametrize("world", [2, 3])
def test_the_documented_split_deals_each_sample_once(tmp_path, world):
    proc, report = audit(tmp_path, "split", "--dataset-size", "48", nproc=world)
    assert proc.returncode == 0, proc.stderr
    expected = library_batches(examples.split, world)
    for e in report["modes"]["audit"]["epochs"]:
        assert [r["batches"] for r in e["ranks"]] == expected
        assert (e["seen"], e["unique"], e["missing_count"]) == (48, 48, 0)
        assert {w["worker"] for w in e["workers"]} == {0, 1}


def test_the_default_nodesplitter_raises_and_the_line_says_why(tmp_path):
    """WebDataset's own pipeline, as rank 0 of 2, raises this (the library's answer)."""
    with as_worker(0, 2, 0, 1), pytest.raises(ValueError, match="explicit nodesplitter"):
        next(iter(examples.default_nodesplitter(None).dataset))
    proc, report = audit(tmp_path, "default_nodesplitter", "--dataset-size", "48")
    assert proc.returncode == 1 and report is None
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "you need to add an explicit nodesplitter" in errors[0]
    assert "nodesplitter=wds.split_by_node" in errors[0] and "every shard" in errors[0]


def test_the_silenced_nodesplitter_replicates(tmp_path):
    proc, report = audit(tmp_path, "silenced", "--dataset-size", "48")
    assert proc.returncode == 1
    expected = library_batches(examples.silenced, 2)
    assert expected[0] == expected[1]  # every rank reads every shard (the library's answer)
    e = report["modes"]["audit"]["epochs"][0]
    assert [r["batches"] for r in e["ranks"]] == expected
    assert (e["seen"], e["unique"], e["duplicate_count"]) == (96, 48, 48)
    failed = {v["verdict"] for v in report["modes"]["audit"]["verdicts"] if not v["ok"]}
    assert "no-silent-replication" in failed
    assert {d["reason"] for d in e["duplicates"]} <= {"stream-replication", "replication"}


def test_resampled_repeats_and_gaps_are_its_design(tmp_path):
    """resampled=True with .with_epoch(3): each worker yields 3 batches of 4 (the pipeline's
    own nsamples), shards drawn with replacement: the repeats and gaps are reported as its
    draw (sampler-draws), not failed. With --keys the samples never drawn are named."""
    keys = tmp_path / "keys.txt"
    keys.write_text("".join(f"sample{i:06d}\n" for i in range(48)))
    proc, report = audit(tmp_path, "resampled", "--keys", str(keys))
    assert proc.returncode == 0, proc.stderr
    per_worker = examples.resampled(None).dataset.nsamples
    assert per_worker == 3
    for e in report["modes"]["audit"]["epochs"]:
        assert [r["steps"] for r in e["ranks"]] == [per_worker * 2] * 2  # 2 workers a rank
        seen = [k for r in e["ranks"] for b in r["batches"] for k in b]
        assert e["seen"] == len(seen) == 48 and e["unique"] == len(set(seen))
        assert sorted(e["missing"]) == sorted(
            {f"sample{i:06d}" for i in range(48)} - set(seen))
        if e["duplicate_count"]:
            assert {d["reason"] for d in e["duplicates"]} == {"sampler-draws"}
        if e["missing_count"]:
            assert e["missing_reason"] == "sampler-draws"
    assert report["modes"]["audit"]["loader"]["draws"]["sampler"] == "WebDataset(resampled=True)"
    assert all(v["ok"] for v in report["modes"]["audit"]["verdicts"])


def test_shards_that_do_not_divide_over_the_ranks_make_unequal_steps(tmp_path):
    """11 shards over 2 ranks: 6 and 5 (the library's own split), batched by the DataLoader."""
    proc, report = audit(tmp_path, "uneven_shards", "--dataset-size", "44")
    assert proc.returncode == 1
    expected = library_batches(examples.uneven_shards, 2)
    e = report["modes"]["audit"]["epochs"][0]
    assert [r["batches"] for r in e["ranks"]] == expected
    steps = [len(b) for b in expected]
    assert [r["steps"] for r in e["ranks"]] == steps and steps[0] != steps[1]
    assert e["hang_at_step"] == min(steps)
    failed = {v["verdict"]: v["detail"] for v in report["modes"]["audit"]["verdicts"]
              if not v["ok"]}
    assert set(failed) == {"equal-step-counts"} and "DDP would hang" in failed[
        "equal-step-counts"]
