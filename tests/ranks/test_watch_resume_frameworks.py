"""The watch's resume verdicts through the Trainer's own checkpoints, on real ranks (chains
across epochs, 2 -> 3 ranks, a checkpoint without the watch's state), checked against the
Trainer's seeded sampler and literals worked out by hand; Lightning's:
tests/ranks/test_watch_resume_lightning.py. Split from tests/ranks/test_watch_resume_chain.py so
that the files' launches run side by side under `--dist loadfile` (and the Lightning half from this one, so
that neither, among the last files xdist hands out, leaves one worker running alone)."""

from __future__ import annotations

import shutil

import pytest
from support.launch import accelerate_launch, ended_or_aborted_at_teardown, transformers_older_than
from support.reports import said_unknown_before, whole_train_epochs


@pytest.fixture(scope="module")
def trainer_stopped_at_3(tmp_path_factory):
    """One launch that the Trainer tests below all begin with: examples/watch_trainer.py on 2
    ranks stopped at step 3 (checkpoint-3 and the report). Each test resumes its own copy."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("trainer") / "run"
    proc = accelerate_launch(["examples/watch_trainer.py", "--output-dir", str(out),
                              "--stop-at", "3"], check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    return out


def resume_trainer(stopped, tmp_path):
    """A copy of the Trainer run stopped at step 3, for one test to resume (and change)."""
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    return out


def test_a_trainer_resumed_from_a_checkpoint_without_the_watchs_state(tmp_path,
                                                                    trainer_stopped_at_3):
    """The Trainer's checkpoint at step 3 of epoch 0 without checkpoint-3/sharddemo_watch.pt
    (saved before TrainerWatch was added): the resumed epoch's part before the stop is
    unknown, the rest (2 steps x 2 ranks x batch 4 = 16 samples, by hand) is judged."""
    out = resume_trainer(trainer_stopped_at_3, tmp_path)
    (out / "checkpoint-3" / "sharddemo_watch.pt").unlink()
    proc = accelerate_launch(["examples/watch_trainer.py", "--output-dir", str(out), "--resume"],
                             check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    said_unknown_before(out / "sharddemo-watch.jsonl", proc.stdout + proc.stderr,
                        "sharddemo_watch.pt")


def test_a_trainer_chain_of_restarts_across_epochs_is_exact(tmp_path, trainer_stopped_at_3):
    """The Trainer stopped at step 3 (checkpoint-3), resumed and stopped again at step 6
    (checkpoint-6: the Trainer keeps the first launch's save_steps=3 from its trainer_state,
    so 6, not 4, is where the second launch can save), then resumed to the end: 2 ranks,
    N = 40, batch 4, 5 steps an epoch, so the second stop is at epoch 1's first step. The
    Trainer's seeded sampler and its skip_first_batches resume exactly (its single restart:
    tests/ranks/test_watch_frameworks.py), so by hand: epoch 0 holds 24 samples before its stop
    (3 steps x 2 ranks x 4) and 16 after, epoch 1 8 before its stop (1 step) and 32 after;
    each 40 seen, none repeated or skipped, each with its own restart (epoch, step, ranks)."""
    pytest.importorskip("transformers")
    if transformers_older_than("5.18.0"):
        pytest.skip("transformers < 5.18 cannot resume a Trainer on CPU ranks")
    out = resume_trainer(trainer_stopped_at_3, tmp_path)
    for args in (["--resume", "--stop-at", "6"], ["--resume"]):
        proc = accelerate_launch(["examples/watch_trainer.py", "--output-dir", str(out), *args],
                                 check=False)
        assert ended_or_aborted_at_teardown(proc), proc.stderr
    assert (out / "checkpoint-6").is_dir()
    train = whole_train_epochs(out / "sharddemo-watch.jsonl")
    assert [e["epoch"] for e in train] == [0, 1]
    for entry, before, where in zip(train, (24, 8), ((0, 3, 2, 2), (1, 1, 2, 2))):
        assert entry["seen"] == entry["unique"] == 40 and entry["ok"], entry["line"]
        resume = entry["resume"]
        assert resume["seen_before"] == before
        assert resume["repeated"]["count"] == resume["skipped"]["count"] == 0
        assert [(r["epoch"], r["step"], r["saved_on"], r["resumed_on"])
                for r in resume["restarts"]] == [where]


def test_a_trainer_checkpoint_of_2_ranks_resumed_on_3(tmp_path, trainer_stopped_at_3):
    """The Trainer stopped at step 3 on 2 ranks, resumed on 3 (N = 40, batch 4). By hand, from
    the Trainer's one seeded order P dealt round-robin by accelerate's BatchSamplerShard: on 2
    ranks steps 0-2 took global batches 0-5, P[0:24]. On 3 ranks the Trainer skips 3 batches on
    each rank (skip_first_batches at the new size: global batches 0-8, P[0:36]), and the epoch's
    10 batches leave one step: global batch 9 (P[36:40]) and, on ranks 1 and 2, accelerate's
    even_batches fill from the epoch's start (P[0:8]). So 24 before, 12 skipped (P[24:36]),
    none repeated: the 8 again are the new size's fill, said as fill; the epoch fails
    resume-exact with the skip at the new size in words. Epoch 1 on 3 ranks: 4 steps x 3 ranks
    x 4 = 48 deliveries of the 40 (8 of them fill), ok."""
    pytest.importorskip("transformers")
    if transformers_older_than("5.18.0"):
        pytest.skip("transformers < 5.18 cannot resume a Trainer on CPU ranks")
    out = resume_trainer(trainer_stopped_at_3, tmp_path)
    proc = accelerate_launch(["examples/watch_trainer.py", "--output-dir", str(out), "--resume"],
                             nproc=3, check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    train = whole_train_epochs(out / "sharddemo-watch.jsonl")
    assert [e["epoch"] for e in train] == [0, 1]
    resumed, after = train
    resume = resumed["resume"]
    assert (resume["seen_before"], resume["repeated"]["count"], resume["skipped"]["count"]) == \
        (24, 0, 12)
    assert resumed["unique"] == 28 and not resumed["ok"]
    [where] = resume["restarts"]
    assert (where["epoch"], where["step"], where["saved_on"], where["resumed_on"]) == (0, 3, 2, 3)
    assert where["skipped_batches"] == 3 and where["fill"]["count"] == 8
    details = " ".join(v["detail"] for v in resumed["verdicts"] if not v["ok"])
    assert "skip_first_batches(3) skipped 3 batches on each of 3 ranks, 36 samples at the new " \
        "size" in details, details
    assert after["ok"] and (after["seen"], after["unique"]) == (48, 40)
