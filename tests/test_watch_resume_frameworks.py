"""The watch's resume verdicts through the frameworks' own checkpoints, on real ranks: the
Trainer (chains across epochs, 2 -> 3 ranks, a checkpoint without the watch's state) and
Lightning (chains within and across epochs, 2 -> 3 ranks, a save at an epoch's last step),
checked against the ids each rank's loop logged and the samplers' own orders. Split from
tests/test_watch_resume_chain.py (whose Chain it reuses) so that the two files' launches run
side by side under `--dist loadfile`."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
from conftest import accelerate_launch, ended_or_aborted_at_teardown, transformers_older_than

from test_watch import entries
from test_watch_resume_chain import Chain

def whole_train_epochs(report) -> list[dict]:
    """The report's entries of whole train epochs (no eval, no partial part)."""
    return [e for e in entries(report) if e["loader"] == "train" and not e.get("partial")]


def said_unknown_before(report, output: str, missing: str) -> None:
    """A 2-epoch run (N = 40, 2 ranks, 5 steps an epoch) stopped at step 3 with a checkpoint
    that lacks the watch's state (`missing`), then resumed: epoch 0's part after the restart,
    16 samples in 2 steps a rank, judged with what came before unknown; epoch 1 whole."""
    train = whole_train_epochs(report)
    assert [e["epoch"] for e in train] == [0, 1]
    resumed = train[0]
    assert resumed["resume"]["unknown_before"] and resumed["missing"] is None
    assert resumed["seen"] == 16 and resumed["steps"] == [2, 2] and resumed["ok"]
    assert f"holds no {missing}" in output
    assert train[1]["ok"] and train[1]["seen"] == 40


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
    tests/test_watch_frameworks.py), so by hand: epoch 0 holds 24 samples before its stop
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


def test_a_lightning_fit_resumed_from_a_checkpoint_without_the_callbacks_state(tmp_path):
    """fit() stopped after 3 steps, its checkpoint stripped of LightningWatch's state (as one
    saved before the callback was added), then fit(ckpt_path=...): Lightning runs the epoch's
    remaining 2 steps (2 x 2 ranks x batch 4 = 16 samples, by hand); the part before the stop
    is unknown, the rest judged."""
    pytest.importorskip("pytorch_lightning")
    import sys

    from conftest import launch_env, run_cmd

    ckpt = tmp_path / "checkpoints" / "epoch=0-step=3.ckpt"
    outputs = []
    for args in (["--stop-at", "3"], ["--resume", str(ckpt)]):
        proc = run_cmd([sys.executable, "examples/watch_lightning.py", "--root", str(tmp_path),
                        *args], env=launch_env(), check=False)
        assert ended_or_aborted_at_teardown(proc), proc.stderr
        outputs.append(proc.stdout + proc.stderr)
        if args[0] == "--stop-at":
            saved = torch.load(ckpt, weights_only=False)
            assert any("LightningWatch" in k for k in saved["callbacks"])
            saved["callbacks"] = {k: v for k, v in saved["callbacks"].items()
                                  if "LightningWatch" not in k}
            torch.save(saved, ckpt)
    said_unknown_before(tmp_path / "sharddemo-watch.jsonl", outputs[1], "LightningWatch state")


# -- Lightning: chains and a changed world size (tests/lightning_chain_loop.py, N = 40, batch 4) --

LIGHTNING_LOOP = "tests/lightning_chain_loop.py"


class LightningChain(Chain):
    """fit() launches of tests/lightning_chain_loop.py sharing one root (checkpoints, report)
    and one folder of logged ids (what each rank's training_step received)."""

    def __init__(self, tmp_path) -> None:
        super().__init__(tmp_path)
        self.report = tmp_path / "sharddemo-watch.jsonl"  # (<default_root_dir>/...)

    def fit(self, devices: int, *args: str) -> None:
        import sys

        from conftest import launch_env, run_cmd

        self.launches += 1
        proc = run_cmd([sys.executable, LIGHTNING_LOOP, "--root", str(self.tmp), "--ids",
                        str(self.ids), "--launch", str(self.launches), "--devices",
                        str(devices), *args], env=launch_env(), check=False)
        assert ended_or_aborted_at_teardown(proc), proc.stderr
        self.outputs.append(proc.stdout + proc.stderr)

    def checkpoint(self, step: int) -> str:
        (path,) = (self.tmp / "checkpoints").glob(f"epoch=*-step={step}.ckpt")
        return str(path)

    def batches(self, launch: int, epoch: int, rank: int) -> list[list[int]]:
        got = json.loads((self.ids / f"launch{launch}_rank{rank}.json").read_text())
        return [ids for e, ids in got if e == epoch]


def lightning_order(world: int, epoch: int, n: int = 40, batch: int = 4) -> list[list[list]]:
    """Each rank's batches of `epoch` as Lightning deals them: the shuffling DistributedSampler it
    injects in DDP (seed PL_GLOBAL_SEED, else 0; set_epoch each epoch), torch's own object."""
    from torch.utils.data import DistributedSampler

    out = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = list(sampler)
        out.append([order[i:i + batch] for i in range(0, len(order), batch)])
    return out


def parts_repeated_skipped(parts: list[list[int]], n: int = 40) -> tuple[list, list, set]:
    """Each part's samples that an earlier part delivered, the samples no part delivered."""
    earlier: set = set()
    again = []
    for part in parts:
        again.append(set(part) & earlier)
        earlier |= set(part)
    return again, sorted(set(range(n)) - earlier), earlier


def test_a_lightning_chain_of_restarts_within_and_across_epochs(tmp_path):
    """fit() on 2 ranks, N = 40, batch 4: 5 steps an epoch. Stopped at global steps 2 and 4
    (epoch 0) and 7 (epoch 1 step 2), then resumed to the end. Lightning restores its step
    count, not a plain DataLoader's position: each resumed fit iterates the sampler's order
    from its start and stops at the epoch's 5 steps (what the loop logged, checked against
    Lightning's DistributedSampler below). The watch counts the chain from those logged ids
    and says what Lightning did."""
    pytest.importorskip("pytorch_lightning")
    chain = LightningChain(tmp_path)
    chain.fit(2, "--stop-at", "2")
    chain.fit(2, "--stop-at", "4", "--resume", chain.checkpoint(2))
    chain.fit(2, "--stop-at", "7", "--resume", chain.checkpoint(4))
    chain.fit(2, "--resume", chain.checkpoint(7))
    # what Lightning did, from the ids its training_step received and its own sampler: each
    # launch took the first steps of the epoch's order again (2, 2, 1 steps of epoch 0; 2, 3
    # of epoch 1)
    for epoch, launches in ((0, {1: 2, 2: 2, 3: 1}), (1, {3: 2, 4: 3})):
        order = lightning_order(2, epoch)
        for launch, steps in launches.items():
            assert [chain.batches(launch, epoch, r) for r in (0, 1)] == \
                [order[r][:steps] for r in (0, 1)], (epoch, launch)

    whole = {e["epoch"]: e for e in whole_train_epochs(chain.report)}
    assert sorted(whole) == [0, 1]
    # by hand, in steps of 2 ranks x 4: epoch 0 takes steps 0-1, 0-1, 0 (16 repeated at the first
    # restart, 8 at the second, 16 in all; steps 2-4 never: 24), epoch 1 steps 0-1, 0-2 (16
    # repeated, steps 3-4 never: 16)
    for epoch, launches, restarts, counts in (
            (0, (1, 2, 3), [(0, 2, 2, 2), (0, 4, 2, 2)], (16, 24)),
            (1, (3, 4), [(1, 2, 2, 2)], (16, 16))):
        parts = [chain.received(k, epoch) for k in launches]
        again, skipped, _ = parts_repeated_skipped(parts)
        entry, resume = whole[epoch], whole[epoch]["resume"]
        assert [(r["epoch"], r["step"], r["saved_on"], r["resumed_on"])
                for r in resume["restarts"]] == restarts
        assert [r["repeated"]["ids"] for r in resume["restarts"]] == \
            [sorted(x) for x in again[1:]]
        assert resume["repeated"]["ids"] == sorted(set().union(*again[1:]))
        assert resume["skipped"]["ids"] == skipped
        assert (resume["repeated"]["count"], resume["skipped"]["count"]) == counts
        assert entry["seen"] == sum(map(len, parts)) == 40  # 5 steps x 2 ranks x 4, over the chain
        assert entry["steps"] == [5, 5] and not entry["ok"]
        for r, steps_before in zip(resume["restarts"], [c[1] for c in restarts]):
            assert r["from_start"] == {"by": "Lightning", "steps_before": steps_before,
                                       "epoch_steps": 5}
        (failed,) = [v["detail"] for v in entry["verdicts"] if not v["ok"]]
        assert "Lightning began the epoch's order again from its start" in failed, failed


def test_a_lightning_checkpoint_of_2_ranks_resumed_on_3(tmp_path):
    """fit() on 2 ranks stopped at step 3 (24 samples), resumed on 3: Lightning's sampler for 3
    ranks deals ceil(40/3) = 14 samples a rank, 4 steps, and Lightning, its step count restored
    at 3, takes 1 more step from the start of the new order (checked against its
    DistributedSampler). The watch counts what the loops received and says it in words."""
    pytest.importorskip("pytorch_lightning")
    chain = LightningChain(tmp_path)
    chain.fit(2, "--stop-at", "3")
    chain.fit(3, "--resume", chain.checkpoint(3))
    two, three = lightning_order(2, 0), lightning_order(3, 0)
    assert [chain.batches(1, 0, r) for r in range(2)] == [two[r][:3] for r in range(2)]
    assert [chain.batches(2, 0, r) for r in range(3)] == [three[r][:1] for r in range(3)]
    before, after = chain.received(1, 0), chain.received(2, 0)
    whole = {e["epoch"]: e for e in whole_train_epochs(chain.report)}
    resumed = whole[0]
    resume = resumed["resume"]
    (only,) = resume["restarts"]
    assert (only["epoch"], only["step"], only["saved_on"], only["resumed_on"]) == (0, 3, 2, 3)
    assert only["from_start"] == {"by": "Lightning", "steps_before": 3, "epoch_steps": 4}
    assert resume["repeated"]["ids"] == sorted(set(before) & set(after))
    assert resume["skipped"]["ids"] == sorted(set(range(40)) - set(before + after))
    # by hand, with P the epoch's permutation: rank r of W takes P[r::W], so 3 steps on 2
    # ranks are P[0:24] and 1 step on 3 ranks P[0:12]: all 12 again, P[24:40] never
    assert (resume["repeated"]["count"], resume["skipped"]["count"]) == (12, 16)
    assert resumed["seen"] == len(before) + len(after) == 36 and not resumed["ok"]
    assert resumed["steps"] == [4, 4, 4]  # 3 before the stop, 1 after, on each rank
    (failed,) = [v["detail"] for v in resumed["verdicts"] if not v["ok"]]
    assert ("saved at epoch 0 step 3 on 2 ranks (24 samples delivered), resumed on 3: Lightning "
            "began the epoch's order again from its start") in failed, failed
    # epoch 1, wholly on 3 ranks: the sampler's own padding (42 of 40), explained as such
    ids = [i for rank in lightning_order(3, 1) for b in rank for i in b]
    twice = sorted(i for i, c in Counter(ids).items() if c > 1)
    assert len(twice) == 2 and whole[1]["duplicated"]["ids"] == twice
    assert whole[1]["ok"] and "resume" not in whole[1]


def test_a_lightning_save_after_an_epochs_last_step_goes_on_with_the_next_epoch(tmp_path):
    """fit() on 2 ranks stopped at global step 5, epoch 0's last (N = 40, batch 4), resumed:
    Lightning goes on with epoch 1 from its first step (its sampler's epoch-1 order, checked
    against its DistributedSampler); the watch says the epoch restarted before its first step,
    nothing repeated or skipped."""
    pytest.importorskip("pytorch_lightning")
    chain = LightningChain(tmp_path)
    chain.fit(2, "--stop-at", "5")
    chain.fit(2, "--resume", chain.checkpoint(5))
    for launch, epoch in ((1, 0), (2, 1)):
        order = lightning_order(2, epoch)
        assert [chain.batches(launch, epoch, r) for r in (0, 1)] == order, (launch, epoch)
    assert not chain.batches(2, 0, 0)  # the resumed fit took nothing of epoch 0
    got = whole_train_epochs(chain.report)
    assert [e["epoch"] for e in got] == [0, 1] and all(e["ok"] for e in got)
    resumed = got[1]
    assert resumed["seen"] == resumed["unique"] == len(chain.received(2, 1)) == 40
    resume = resumed["resume"]
    assert resume["repeated"]["count"] == resume["skipped"]["count"] == 0
    (edge,) = resume["restarts"]
    assert (edge["epoch"], edge["step"], edge.get("at_edge")) == (0, 5, True)
    assert "from_start" not in edge


# -- a resumed launch that ends mid-epoch: its partial entry says what it knows of the resume ----
