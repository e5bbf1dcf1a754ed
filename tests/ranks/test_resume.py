"""The resume audit on real gloo ranks: `audit --resume-at` really stops, saves, restarts
in fresh processes and resumes. Expected values come from accelerate's own objects in this
process (prepare_data_loader, skip_first_batches, the StatefulDataLoader's state_dict and
load_state_dict: `library_resume` below), or from literals worked out by hand."""

from __future__ import annotations

import json
import os
import time

import pytest
from support.launch import ROOT, sharddemo

FACTORIES = str(ROOT / "tests" / "support" / "factories.py")
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


def resume_audit(target, *args, nproc=2, check=True, env=None):
    import jsonschema

    proc = sharddemo(["audit", f"{FACTORIES}:{target}", "--num-processes", str(nproc),
                      "--format", "json", *args], check=False, env=env)
    if check:
        assert proc.returncode in (0, 1), proc.stderr
        report = json.loads(proc.stdout)
        jsonschema.validate(report, SCHEMA)
        return proc, report
    return proc, None


def reference_batches(report, epoch):
    return [r["batches"] for r in report["modes"]["audit"]["epochs"][epoch]["ranks"]]


def library_resume(world: int, stateful: bool, stop: int = 3) -> list:
    """[epoch][rank] -> batches of `seeded_40` (tests/support/factories.py) stopped after `stop` steps
    of epoch 0 and resumed, as accelerate's own objects deal them for each rank in this
    process: the loader built again the same way (set_seed(0), prepare_data_loader with the
    rng handling an Accelerator uses), then `skip_first_batches(loader, stop)`, or the
    StatefulDataLoader's `state_dict()` at the stop given to the new loader's
    `load_state_dict()`; then epoch 1 of the new loader. No sharddemo code."""
    import torch
    from accelerate.data_loader import prepare_data_loader, skip_first_batches
    from accelerate.utils import set_seed
    from support.oracle import ACCELERATOR_RNG_TYPES, ensure_accelerator_state
    from torch.utils.data import DataLoader, TensorDataset

    ensure_accelerator_state()

    def build(rank):
        set_seed(0)
        return prepare_data_loader(DataLoader(TensorDataset(torch.arange(40)), batch_size=4,
                                              shuffle=True), num_processes=world,
                                   process_index=rank, put_on_device=False,
                                   rng_types=list(ACCELERATOR_RNG_TYPES),
                                   use_stateful_dataloader=stateful)

    def ids(batch):
        return batch[0].tolist()

    out = [[], []]
    for rank in range(world):
        first = build(rank)
        walk = iter(first)
        before = [ids(next(walk)) for _ in range(stop)]
        again = build(rank)
        if stateful:
            again.load_state_dict(first.state_dict())
            rest = [ids(b) for b in again]
        else:
            rest = [ids(b) for b in skip_first_batches(again, stop)]
        out[0].append(before + rest)
        out[1].append([ids(b) for b in again])
    return out


def test_stateful_with_a_seed_resumes_exactly_and_keep_checkpoint_keeps_it(tmp_path):
    pytest.importorskip("torchdata")
    keep = tmp_path / "ckpt"
    proc, report = resume_audit("seeded_40", "--resume-at", "0:3", "--resume-strategy",
                                "stateful", "--keep-checkpoint", str(keep))
    resume = report["modes"]["audit"]["resume"]
    assert resume["resume_exact"], resume["explanation"]
    assert resume["world_sizes"] == [2, 2] and resume["deterministic"]
    library = library_resume(2, stateful=True)
    for e in resume["epochs"]:
        # the resumed run's batches are what accelerate's stateful loader resumes to, rank by
        # rank, and the uninterrupted run's
        assert [r["batches"] for r in e["ranks"]] == library[e["epoch"]]
        assert [r["batches"] for r in e["ranks"]] == reference_batches(report, e["epoch"])
    assert any(keep.iterdir())  # accelerate's save_state files, kept


def test_a_datasets_stream_resumed_from_the_loaders_own_state_is_what_the_library_gives():
    """A StatefulDataLoader over a datasets stream (tests/support/factories.py:
    hf_stream_state_40), stopped after 2 steps and resumed from its `state_dict()` in new
    launches. Expected: the same objects in this process, rank by rank (datasets'
    split_dataset_by_node, torchdata's state_dict / load_state_dict), then epoch 1 of the
    resumed loader; the audit's walk calls no set_epoch on the dataset, so epoch 1 starts
    again from the restored position (datasets 5.2: docs/resume.md), 16 samples short."""
    pytest.importorskip("torchdata")
    pytest.importorskip("datasets")
    from support.factories import hf_stream_state_40

    proc, report = resume_audit("hf_stream_state_40", "--resume-at", "0:2", "--resume-strategy",
                                "stateful", "--id-field", "id", "--dataset-size", "40")
    resume = report["modes"]["audit"]["resume"]
    library: list = [[], []]
    for rank in range(2):
        first = hf_stream_state_40(None, rank, 2)
        walk = iter(first)
        before = [next(walk)["id"].tolist() for _ in range(2)]
        again = hf_stream_state_40(None, rank, 2)
        again.load_state_dict(first.state_dict())
        library[0].append(before + [b["id"].tolist() for b in again])
        library[1].append([b["id"].tolist() for b in again])
    for e in resume["epochs"]:
        assert [r["batches"] for r in e["ranks"]] == library[e["epoch"]], e["epoch"]
    e0, e1 = resume["epochs"]
    assert e0["repeated"]["count"] == e0["skipped"]["count"] == 0
    # epoch 1: each rank's first 2 batches of 4 (by hand: 2 x 2 x 4 = 16) never come
    assert e1["skipped"]["count"] == 40 - len({i for r in library[1] for b in r for i in b})
    assert e1["skipped"]["count"] == 16 and not resume["resume_exact"]


def test_skip_with_a_seed_resumes_to_what_accelerate_skips_to():
    proc, report = resume_audit("seeded_40", "--resume-at", "0:3")
    resume = report["modes"]["audit"]["resume"]
    assert resume["resume_exact"] and proc.returncode == 0, resume["explanation"]
    library = library_resume(2, stateful=False)
    for e in resume["epochs"]:
        assert [r["batches"] for r in e["ranks"]] == library[e["epoch"]], e["epoch"]


def test_skip_without_a_seed_repeats_and_skips_in_the_resumed_epoch():
    proc, report = resume_audit("unseeded_40", "--resume-at", "0:3")
    resume = report["modes"]["audit"]["resume"]
    e0, e1 = resume["epochs"]
    # a new permutation after the restart: as many samples come twice as never come
    assert e0["repeated"]["count"] == e0["skipped"]["count"] > 0
    assert not resume["deterministic"] and e0["order_equal"] is None
    assert e1["repeated"]["count"] == e1["skipped"]["count"] == 0
    assert not resume["resume_exact"] and proc.returncode == 1


def test_a_changed_world_size_is_reported_with_counts():
    # Stopped on 3 real ranks, resumed on 2.
    proc, report = resume_audit("seeded_40", "--resume-at", "0:1", "--resume-num-processes",
                                "2", nproc=3)
    resume = report["modes"]["audit"]["resume"]
    assert resume["world_sizes"] == [3, 2] and not resume["resume_exact"]
    assert resume["deterministic"]  # the 3-rank stop saw what the 3-rank reference saw
    e0 = resume["epochs"][0]
    assert e0["order_equal"] is None and e0["repeated"]["count"] + e0["skipped"]["count"] > 0
    assert "world size changed (3 -> 2)" in resume["explanation"]


@pytest.mark.parametrize("args,message", [
    (["seeded_40", "--resume-at", "0:10"], "an epoch of this loader has 5 steps per rank"),
    (["seeded_40", "--resume-at", "2:0"], "beyond --epochs 2"),
    (["seeded_40", "--resume-at", "x"], "is not EPOCH:STEP"),
    (["plain_40", "--resume-at", "0:1", "--resume-strategy", "stateful"],
     "needs a loader that can save its state"),
    (["seeded_40", "--resume-at", "0:1", "--keep-checkpoint", "/proc/nope/ckpt"],
     "cannot be written"),
])
def test_bad_resume_input_is_one_error_line(args, message):
    proc = sharddemo(["audit", f"{FACTORIES}:{args[0]}", *args[1:]], check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines


def test_a_failed_resume_launch_leaves_no_process_and_no_checkpoint(tmp_path):
    from support.processes import assert_nothing_left, tagged_env

    env, token = tagged_env()
    env["SHARDDEMO_TEST_COUNTER_DIR"] = str(tmp_path)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env["TMPDIR"] = str(scratch)
    start = time.monotonic()
    proc = sharddemo(["audit", f"{FACTORIES}:fails_in_the_third_launch", "--resume-at", "0:2"],
                     check=False, env=env)
    assert proc.returncode == 1
    assert "the resumed run cannot open its shards" in proc.stderr
    assert time.monotonic() - start < 60
    assert_nothing_left(token)
    assert not [p for p in os.listdir(scratch) if p.startswith("sharddemo-checkpoint-")]


def test_compare_resume_runs_every_scenario_side_by_side():
    """compare --modes resume: 3 strategies x 2 stops x workers 0 and 2, in three launches.
    (It is also the suite's check of skip with a seed, restart and a stop at an epoch
    boundary, which `audit --resume-at` runs through the same code.)
    N=40, a batch of 8 split across W=2 (--split-batches): 4 per rank, 5 steps per rank, the
    mid-epoch stop is step 2 (worked out by hand). The header states the per-rank and global
    batch of accelerate's own prepared loader (the resume demo builds its report apart from
    the modes; the other commands: tests/ranks/test_audit.py)."""
    import jsonschema
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from sharddemo.render import render

    proc = sharddemo(["compare", "--modes", "resume", "--dataset-size", "40", "--batch-size", "8",
                      "--split-batches", "--format", "json"], timeout=240)
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    ref = prepare_data_loader(DataLoader(list(range(40)), batch_size=8), num_processes=2,
                              process_index=0, split_batches=True, put_on_device=False)
    per_rank = len(next(iter(ref)))
    assert report["global_batch"] == per_rank * 2
    head = render(report, "table").splitlines()[0]
    assert f"| per-rank batch {per_rank} | global batch {per_rank * 2} |" in head
    rows = {(r["workers"], r["at"]["epoch"], r["at"]["step"], r["strategy"]): r
            for r in report["resume"]}
    assert sorted(rows) == sorted((w, e, s, st) for w in (0, 2) for e, s in ((0, 2), (1, 0))
                                  for st in ("skip", "stateful", "restart"))
    for w in (0, 2):
        # seeded, so skip_first_batches lands where the first launch stopped
        assert rows[(w, 0, 2, "skip")]["resume_exact"]
        # restart: exactly the 2 steps x 2 ranks x 4 the first launch had seen come again
        e0 = rows[(w, 0, 2, "restart")]["epochs"][0]
        assert e0["repeated"]["count"] == 16 and e0["skipped"]["count"] == 0
        # at the epoch boundary a fresh loader replays an earlier order: right samples,
        # other order
        e1 = rows[(w, 1, 0, "skip")]["epochs"][0]
        assert e1["repeated"]["count"] == e1["skipped"]["count"] == 0
        assert e1["order_equal"] is False
        assert "counts its epochs from 0" in rows[(w, 1, 0, "skip")]["explanation"]
    from sharddemo.render import render_table

    assert "workers 0 | stop 0:2 | skip" in render_table(report)


def test_compare_resume_needs_a_mid_epoch_step_and_runs_alone():
    proc = sharddemo(["compare", "--modes", "resume"], check=False)  # N=8, B=4: 1 step
    assert proc.returncode == 2 and "has 1 step per rank" in proc.stderr
    proc = sharddemo(["compare", "--modes", "resume,sampler"], check=False)
    assert proc.returncode == 2 and "mode resume runs alone" in proc.stderr
