"""The watch's state rides in the watched loader's own state_dict(): a torchtitan-style loop that
checkpoints the loader itself (`{"loader": loader.state_dict()}` with torch.save on every rank,
no accelerate) resumes with the watch knowing what came before the stop.

Real ranks: torchrun, gloo, three launches of tests/scripts/loader_state_loop.py shared by every
test here (2 ranks: save at the stop; 2 ranks: resume, one case saving again; 3 ranks: resume),
several scenarios per launch: mid-epoch with 0 and 2 workers, at the epoch's edge, a chain of
two restarts (the second on 3 ranks), 2 -> 3 ranks, batch size 4 -> 8, and workers 2 -> 4
(torchdata refuses it). Every figure is checked against the ids each launch's loop logged
(repeated and skipped counted from those logs) and the logs against torch's own
DistributedSampler (the order each rank must have received, from the position restored)."""

from __future__ import annotations


import pytest
from torch.utils.data import DistributedSampler

from support.launch import SCRIPTS
from support.reports import entry, launch_cases

LOOP = str(SCRIPTS / "loader_state_loop.py")
N = 40  # the loop's dataset; DistributedSampler(shuffle=True, seed=0), batch 4 unless said

# (tag, ranks, cases): NAME:WORKERS:BATCH:LOAD:STOP
LAUNCHES = [
    ("a", 2, ["mid0:0:4:0:2", "mid2:2:4:0:2", "edge:0:4:0:5", "chain:2:4:0:1",
              "workers:2:4:0:2", "batch:0:4:0:2", "ranks:0:4:0:2"]),
    ("b", 2, ["mid0:0:4:1:-", "mid2:2:4:1:-", "edge:0:4:1:-", "chain:2:4:1:3",
              "workers:4:4:1:-", "batch:0:8:1:-"]),
    ("c", 3, ["chain:2:4:1:-", "ranks:0:4:1:-"]),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return launch_cases(LOOP, tmp_path_factory.mktemp("loader_state"), LAUNCHES)


def order(world: int, rank: int, epoch: int) -> list[int]:
    """What torch's DistributedSampler deals rank `rank` of `world` in `epoch`."""
    sampler = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[k:k + size] for k in range(0, len(ids), size)]


def passes(run, tag: str, case: str, rank: int) -> list[dict]:
    return run["logs"][tag][rank][case]["passes"]


def epoch0(run, tag: str, case: str) -> list[int]:
    """Every id the ranks of launch `tag` received in epoch 0 (with repeats)."""
    return [i for rank in run["logs"][tag] for p in rank[case]["passes"] if p["epoch"] == 0
            for batch in p["batches"] for i in batch]


def padding_after(run, tag: str, case: str, world: int, position: int) -> set[int]:
    """The ids at the DistributedSampler's padding positions (rank r's p-th sample is position
    p*W + r of the padded order, padding from N on) that launch `tag` received after it
    restored the loader at the rank's sample `position`."""
    out = set()
    for r in range(world):
        got = [i for p in passes(run, tag, case, r) if p["epoch"] == 0 for b in p["batches"]
               for i in b]
        out |= {i for k, i in enumerate(got) if (position + k) * world + r >= N}
    return out


def expected(parts: list[list[int]], fill: set[int] = frozenset()) -> dict:
    """The figures of a resumed epoch from the ids each launch received in it: each restart's
    repeats (received before it and again after it; the last restart's own padding is the
    sampler's fill, not a repeat), the samples in no part."""
    repeated: set[int] = set()
    for k in range(1, len(parts)):
        before = {i for part in parts[:k] for i in part}
        again = before & set(parts[k])
        repeated |= again - (set(fill) if k == len(parts) - 1 else set())
    every = [i for part in parts for i in part]
    return {"seen_before": sum(len(p) for p in parts[:-1]), "seen": len(every),
            "unique": len(set(every)), "repeated": len(repeated),
            "skipped": N - len(set(every)), "fill": len(set(fill) & {i for p in parts[:-1]
                                                                      for i in p})}


def check(e: dict, want: dict) -> None:
    resume = e["resume"]
    got = {"seen_before": resume["seen_before"], "seen": e["seen"], "unique": e["unique"],
           "repeated": resume["repeated"]["count"], "skipped": resume["skipped"]["count"],
           "fill": (resume["restarts"][-1].get("fill") or {}).get("count", 0)}
    assert got == want
    assert e["ok"] == (want["repeated"] == 0 and want["skipped"] == 0)
    assert all(r.get("loader_state") for r in resume["restarts"])


@pytest.mark.parametrize("case", ["mid0", "mid2"])
def test_a_mid_epoch_resume_from_the_loaders_own_state_is_exact(run, case):
    """0 and 2 workers: saved at epoch 0 step 2, resumed from `loader.state_dict()`: the loop
    goes on where it stopped, and the watch counts the 16 samples before the stop."""
    for r in range(2):
        mine = order(2, r, 0)
        assert passes(run, "a", case, r)[0]["batches"] == chunks(mine, 4)[:2]
        after = passes(run, "b", case, r)
        assert after[0]["batches"] == chunks(mine[8:], 4)
        assert after[1]["batches"] == chunks(order(2, r, 1), 4)
    stopped = entry(run, "a", case, 0, partial=True)
    assert stopped["seen"] == 16 and stopped["ok"]
    e = entry(run, "b", case, 0)
    check(e, expected([epoch0(run, "a", case), epoch0(run, "b", case)]))
    assert e["resume"]["seen_before"] == 16 and e["ok"] and e["steps"] == [5, 5]
    assert "16 before the stop, 0 repeated after the restart, 0 skipped" in e["line"]
    assert entry(run, "b", case, 1)["ok"]


def test_a_resume_after_the_epochs_last_step_goes_on_with_the_next_epoch(run):
    """Saved after epoch 0's 5th (last) step, inside the loop: the launch reports epoch 0
    whole; the resumed StatefulDataLoader's first pass is epoch 0's empty rest (no entry), and
    epoch 1 is judged against epoch 0's order from the checkpoint."""
    for r in range(2):
        assert passes(run, "a", "edge", r)[0]["batches"] == chunks(order(2, r, 0), 4)
        resumed = passes(run, "b", "edge", r)
        assert resumed[0] == {"epoch": 0, "batches": []}  # (torchdata's restored rest)
        assert resumed[1]["batches"] == chunks(order(2, r, 1), 4)
    whole = entry(run, "a", "edge", 0)
    assert whole["seen"] == 40 and whole["ok"] and "resume" not in whole
    assert [e["epoch"] for e in run["entries"]["b"] if e["loader"] == "edge"] == [1]
    e = entry(run, "b", "edge", 1)
    assert e["ok"] and e["seen"] == 40 and e["order_changed"] is True
    last = e["resume"]["restarts"][-1]
    assert last["at_edge"] and last["loader_state"] and last["step"] == 5
    assert "after its last step; the loader restored its own state" in e["line"]


def test_a_chain_of_two_restarts_the_second_on_three_ranks(run):
    """Saved at step 1 (2 ranks), resumed and saved at step 3 (2 ranks), resumed on 3 ranks:
    the 3 ranks' DistributedSampler from sample 12 of each rank's order; the entry counts
    over the chain and names the 2 -> 3 ranks."""
    for r in range(2):
        mine = order(2, r, 0)
        assert passes(run, "a", "chain", r)[0]["batches"] == chunks(mine, 4)[:1]
        assert passes(run, "b", "chain", r)[0]["batches"] == chunks(mine, 4)[1:3]
    for r in range(3):  # (rank 2 loaded rank 0's state: the same position, 12 samples)
        assert passes(run, "c", "chain", r)[0]["batches"] == chunks(order(3, r, 0)[12:], 4)
    part = entry(run, "b", "chain", 0, partial=True)
    assert part["resume"]["seen_before"] == 8 and part["resume"]["repeated"]["count"] == 0
    parts = [epoch0(run, t, "chain") for t in "abc"]
    e = entry(run, "c", "chain", 0)
    check(e, expected(parts, padding_after(run, "c", "chain", 3, 12)))
    assert [r["step"] for r in e["resume"]["restarts"]] == [1, 3]
    assert e["resume"]["restarts"][-1]["changed"] == {"world_size": [2, 3]}
    assert "epoch 0 step 3 (2 -> 3 ranks" in e["line"]
    assert "the restart changed the number of ranks (2 -> 3)" in e["line"]
    assert entry(run, "c", "chain", 1)["ok"]


def test_a_resume_on_three_ranks_of_a_state_saved_on_two_is_named(run):
    """Saved at step 2 on 2 ranks, every rank of 3 loads it (rank 2 rank 0's state): each
    rank skips 8 samples of its own 3-rank order; the entry names 2 -> 3 ranks."""
    for r in range(3):
        assert passes(run, "c", "ranks", r)[0]["batches"] == chunks(order(3, r, 0)[8:], 4)
    e = entry(run, "c", "ranks", 0)
    want = expected([epoch0(run, "a", "ranks"), epoch0(run, "c", "ranks")],
                    padding_after(run, "c", "ranks", 3, 8))
    check(e, want)
    assert want["skipped"] > 0 and not e["ok"]
    assert e["resume"]["restarts"][-1]["changed"] == {"world_size": [2, 3]}
    assert "(2 -> 3 ranks" in e["line"]


def test_a_resume_at_another_batch_size_is_named(run):
    """Saved at step 2 with batches of 4, loaded into batches of 8: torchdata restores the
    position in samples (8 a rank), so nothing repeats; the entry names the change."""
    for r in range(2):
        assert passes(run, "b", "batch", r)[0]["batches"] == chunks(order(2, r, 0)[8:], 8)
    e = entry(run, "b", "batch", 0)
    check(e, expected([epoch0(run, "a", "batch"), epoch0(run, "b", "batch")]))
    assert e["resume"]["restarts"][-1]["changed"] == {"batch_size": [4, 8]}
    assert "batch size 4 -> 8" in e["line"]


def test_a_state_saved_with_two_workers_loaded_into_four_is_named(run):
    """torchdata's StatefulDataLoader refuses a state saved with 2 workers in a loader with 4
    (an AssertionError at iter()): the watch names the change at the load, on the main
    process, before the refusal; no epoch is reported."""
    for r in range(2):
        assert run["logs"]["b"][r]["workers"]["error"].startswith("AssertionError")
    said = [line for line in run["stderr"]["b"].splitlines()
            if "sharddemo.watch: workers: the loader's state was saved with 2 DataLoader "
               "workers and is loaded into a loader with 4" in line]
    assert len(said) == 1
    assert not [e for e in run["entries"]["b"] if e["loader"] == "workers"]
