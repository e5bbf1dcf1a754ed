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
from support.launch import ROOT, sharddemo

from sharddemo.render import render

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


def interleave(per_worker: list[list]) -> list:
    """A rank's batches as torch's DataLoader takes an IterableDataset's workers' batches:
    one from each worker in turn, a worker that has run out skipped."""
    batches, step = [], 0
    while any(step < len(w) for w in per_worker):
        batches += [w[step] for w in per_worker if step < len(w)]
        step += 1
    return batches


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
        out.append(interleave(per_worker))
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
    """WebDataset's own pipeline, as rank 0 of 2, raises this (the library's answer). Raised
    inside WebDataset on every rank, it is the loader's finding, not a failed run: the report says
    it, in one line with why, and the audit fails its verdict loader-runs-every-epoch."""
    with as_worker(0, 2, 0, 1), pytest.raises(ValueError, match="explicit nodesplitter") as raised:
        next(iter(examples.default_nodesplitter(None).dataset))
    proc, report = audit(tmp_path, "default_nodesplitter", "--dataset-size", "48")
    assert proc.returncode == 1 and report is not None
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0] == "Error: verdict(s) failed: loader-runs-every-epoch (epoch 0)"
    mode = report["modes"]["audit"]
    assert mode["epochs"] == [] and [r["rank"] for r in mode["raised"]] == [0, 1]
    for entry in mode["raised"]:
        # (raised in a DataLoader worker: torch's line for it, then the worker's error)
        assert entry["error"].startswith("ValueError: ")
        assert f"ValueError: {' '.join(str(raised.value).split())}" in entry["error"]
        assert "nodesplitter=wds.split_by_node" in entry["error"]
        assert "every shard" in entry["error"]
    [verdict] = mode["verdicts"]
    assert not verdict["ok"] and "nodesplitter=wds.split_by_node" in verdict["detail"]
    assert mode["conclusion"].startswith("The loader raised inside webdataset on every rank")


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


# -- compare --source webdataset: sharddemo's own five WebDataset modes ------------------------
# The source writes N samples in order, sample i keyed "sample{i:06d}" with id i, into COUNT
# shards whose sizes differ by at most one (the first N % COUNT one larger): the layout the
# docs state. The test writes the same layout and asks WebDataset's own pipeline what each
# rank and worker reads.


def write_layout(folder, n: int, count: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    urls, start = [], 0
    for s in range(count):
        size = n // count + (s < n % count)
        path = str(folder / f"{s}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(start, start + size):
                sink.write({"__key__": f"sample{i:06d}", "id.cls": i})
        urls.append(path)
        start += size
    return urls


def library_ids(urls, world: int, workers: int, batch: int, nodesplitter) -> list[list[list[int]]]:
    """[rank] -> the batches of ids that rank's DataLoader(batch_size=batch,
    num_workers=workers) yields over WebDataset's own pipeline, each worker batching its own
    samples, the DataLoader taking one batch from each worker in turn."""
    out = []
    for rank in range(world):
        per_worker = []
        for worker in range(max(workers, 1)):
            with as_worker(rank, world, worker, max(workers, 1)):
                samples = list(wds.WebDataset(urls, shardshuffle=False, nodesplitter=nodesplitter,
                                              workersplitter=wds.split_by_worker).decode())
            ids = [s["id.cls"] for s in samples]
            per_worker.append([ids[k:k + batch] for k in range(0, len(ids), batch)])
        out.append(interleave(per_worker))
    return out


def compare_wds(tmp_path, *args: str, nproc: int = 2, fmt: str = "json"):
    out = tmp_path / "report.json"
    proc = sharddemo(["compare", "--source", "webdataset", "--num-processes", str(nproc),
                      "--format", fmt, "--output", str(out), *args], check=False)
    report = json.loads(out.read_text()) if out.exists() else None
    if report is not None:
        jsonschema.validate(report, SCHEMA)
    return proc, report


def batches_of(report, mode):
    return [[r["batches"] for r in e["ranks"]] for e in report["modes"][mode]["epochs"]]


def test_compare_webdataset_shows_the_five_cases(tmp_path):
    """2 ranks, no workers, N=8, B=4, --shards 4 (2 samples a shard): the defaults."""
    png = tmp_path / "split.png"
    proc, report = compare_wds(tmp_path, "--check", "--plot", str(png), fmt="table")
    assert proc.returncode == 1, proc.stderr  # --check: silenced and uneven-shards break
    assert list(report["modes"]) == ["split", "no-nodesplitter", "silenced", "resampled",
                                     "uneven-shards"]
    urls = write_layout(tmp_path / "four", 8, 4)
    split = library_ids(urls, 2, 0, 4, wds.split_by_node)
    assert split == [[[0, 1, 4, 5]], [[2, 3, 6, 7]]]  # shards 0, 2 and 1, 3 (by hand)
    assert batches_of(report, "split") == [split, split]
    # the same pipeline with nodesplitter=lambda src: src: every rank every shard
    silenced = library_ids(urls, 2, 0, 4, lambda src: src)
    assert silenced[0] == silenced[1] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert batches_of(report, "silenced") == [silenced, silenced]
    # ranks x workers + 1 = 3 shards of 3, 3, 2: rank 0 reads shards 0 and 2, rank 1 shard 1
    uneven = library_ids(write_layout(tmp_path / "three", 8, 3), 2, 0, 4, wds.split_by_node)
    assert uneven == [[[0, 1, 2, 6], [7]], [[3, 4, 5]]]
    assert batches_of(report, "uneven-shards") == [uneven, uneven]
    e = report["modes"]["uneven-shards"]["epochs"][0]
    assert e["hang_at_step"] == 1 and not e["steps_equal"]
    # the default nodesplitter: WebDataset's own answer as rank 0 of 2
    with as_worker(0, 2, 0, 1), pytest.raises(ValueError) as raised:
        next(iter(wds.WebDataset(urls, shardshuffle=False)))
    refused = report["modes"]["no-nodesplitter"]
    assert refused["epochs"] == [] and [r["rank"] for r in refused["raised"]] == [0, 1]
    assert all(str(raised.value) in r["error"] for r in refused["raised"])
    assert "nodesplitter=wds.split_by_node" in refused["conclusion"]
    assert refused["broken_promises"] == []
    # resampled: with_epoch(ceil(8 / 2)) = 4 samples a rank, drawn with replacement
    for e in report["modes"]["resampled"]["epochs"]:
        assert [r["samples"] for r in e["ranks"]] == [4, 4]
        assert all(i in range(8) for r in e["ranks"] for b in r["batches"] for i in b)
        assert e["missing_count"] == 8 - e["unique"]
        if e["missing_count"]:
            assert e["missing_reason"] == "sampler-draws" and e["missing_explained"]
    assert report["modes"]["resampled"]["broken_promises"] == []
    broken = report["broken_promises"]
    assert {p.split(" ")[0] for p in broken} == {"silenced", "uneven-shards"}
    assert any("stream replication" in p or "unsplit stream" in p for p in broken)
    # the table says it in one place per mode (with --output the CLI prints a summary: the
    # table of the report it wrote), and the plot draws every mode
    table = render(report, "table")
    assert "The loader raised on every rank before its first batch" in table
    assert "files per rank [2, 2]" in table and "files per rank [2, 1]" in table
    assert png.stat().st_size > 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "broken promise" in errors[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("gather", ["batch", "count"])
def test_compare_webdataset_on_three_ranks_with_workers(tmp_path, gather):
    """3 ranks x 2 workers, N=30, --shards 6: one shard a worker; uneven-shards writes 7.
    The markdown says the shard arithmetic; the count path agrees with the id path."""
    proc, report = compare_wds(tmp_path, "--mode", "split,uneven-shards,silenced",
                               "--dataset-size", "30", "--shards", "6", "--num-workers", "2",
                               "--epochs", "1", "--gather", gather, nproc=3, fmt="markdown")
    assert proc.returncode == 0, proc.stderr
    expected = {
        "split": library_ids(write_layout(tmp_path / "six", 30, 6), 3, 2, 4, wds.split_by_node),
        "uneven-shards": library_ids(write_layout(tmp_path / "seven", 30, 7), 3, 2, 4,
                                     wds.split_by_node),
        "silenced": library_ids(write_layout(tmp_path / "six", 30, 6), 3, 2, 4,
                                lambda src: src),
    }
    for mode, ranks in expected.items():
        e = report["modes"][mode]["epochs"][0]
        assert [r["steps"] for r in e["ranks"]] == [len(b) for b in ranks], mode
        assert [r["samples"] for r in e["ranks"]] == [sum(map(len, b)) for b in ranks], mode
        seen = [i for b in ranks for batch in b for i in batch]
        assert (e["seen"], e["unique"]) == (len(seen), len(set(seen))), mode
        if gather == "batch":
            assert [r["batches"] for r in e["ranks"]] == ranks, mode
    # 7 shards over 3 ranks: 3, 2, 2 (by hand), so the steps differ
    streams = report["modes"]["uneven-shards"]["streams"]
    assert streams["files_per_rank"] == [3, 2, 2]
    assert streams["files_per_worker"] == [[2, 1], [1, 1], [1, 1]]
    assert ("files per rank [3, 2, 2], per worker [[2, 1], [1, 1], [1, 1]]"
            in render(report, "markdown"))


def test_fewer_shards_than_workers_is_one_line_that_says_what_to_do(tmp_path):
    """4 shards over 3 ranks x 2 workers: rank 1 reads shard 1 only, so its worker 1 has none
    and WebDataset's empty_check raises in that worker (the library's own answer, below)."""
    urls = write_layout(tmp_path / "four", 12, 4)
    with as_worker(1, 3, 1, 2), pytest.raises(ValueError, match="No samples found"):
        list(wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node))
    proc, report = compare_wds(tmp_path, "--mode", "split", "--dataset-size", "12",
                               "--num-workers", "2", nproc=3, fmt="table")
    assert proc.returncode == 1 and report is None
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "No samples found in dataset" in errors[0]
    assert "at least ranks x workers shards" in errors[0]


@pytest.mark.parametrize("args,words", [
    (["--source", "webdataset", "--mode", "prepared"], "not built over --source webdataset"),
    (["--mode", "silenced"], "pass --source webdataset"),
    (["--source", "toy", "--mode", "split"], "pass --source hf, hf-stream or webdataset"),
])
def test_webdataset_modes_refuse_what_they_do_not_build(args, words):
    proc = sharddemo(["compare", *args], check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("Error:"), proc.stderr
    assert words in lines[0]
