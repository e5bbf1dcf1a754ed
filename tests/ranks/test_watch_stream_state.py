"""A `datasets` stream checkpointed through the loader's own state: a torchtitan-style loop over
`Dataset.to_iterable_dataset(num_shards=S)` split with `split_dataset_by_node`, read by torchdata's
StatefulDataLoader, watched with `id_field="id"`, its `loader.state_dict()` saved on every rank
(torch.save, DCP of the dict, or DCP of a torchtitan-style loader) and loaded in the next launch.

Real ranks: torchrun, gloo, four launches of tests/scripts/stream_state_loop.py shared by every
test here (2 ranks: every case's uninterrupted run and the first part of the others; 2 ranks:
the resumes, one saving again; 2 ranks: that second resume; 3 ranks: a 2-rank state resumed
on 3, with a 3-rank uninterrupted run). Whether the library itself repeats or skips is measured
by comparing each rank's ids over the launches with the uninterrupted run's (datasets 5.2,
torchdata 0.11 installed here); every figure of the watch is checked against the ids the loop
logged. The known library bugs each case pins (docs/resume.md, "A datasets stream"): datasets
issue 7538 (shards % world == 0), 7630 (.map), 7901 (.shuffle), PR 8295 (resumed twice)."""

from __future__ import annotations

import io

import pytest
import torch

from support.launch import SCRIPTS
from support.reports import entry, launch_cases, received

LOOP = str(SCRIPTS / "stream_state_loop.py")
N = 40  # the loop's stream: ids 0..39, batch 4

# (tag, ranks, cases): NAME:SHARDS:MAP:BUFFER:WORKERS:LOAD:STOP (a -ref case runs uninterrupted)
LAUNCHES = [
    ("a", 2, ["even-ref:4:0:0:0:-:-", "even:4:0:0:0:-:0.2", "odd-ref:3:0:0:0:-:-",
              "odd:3:0:0:0:-:0.2", "map-ref:4:1:0:0:-:-", "map:4:1:0:0:-:0.2",
              "shuf-ref:4:0:8:0:-:-", "shuf:4:0:8:0:-:0.2", "twice:4:0:0:0:-:0.1",
              "edge:4:0:0:0:-:0.5", "ep1:4:0:0:0:-:1.2", "w2-ref:4:0:0:2:-:-",
              "w2:4:0:0:2:-:0.2", "r3:6:0:0:0:-:0.2", "dcp:4:0:0:0:-:0.2d",
              "titan:4:0:0:0:-:0.2T", "noep:4:0:0:0:-:0.2"]),
    ("b", 2, ["even:4:0:0:0:t:-", "odd:3:0:0:0:t:-", "map:4:1:0:0:t:-", "shuf:4:0:8:0:t:-",
              "twice:4:0:0:0:t:0.3", "edge:4:0:0:0:t:-", "ep1:4:0:0:0:t:-", "w2:4:0:0:2:t:-",
              "dcp:4:0:0:0:d:-", "titan:4:0:0:0:T:-",
              "noep:4:0:0:0:t:-"]),
    ("c", 2, ["twice:4:0:0:0:t:-"]),
    ("d", 3, ["r3:6:0:0:0:t:-", "r3-ref:6:0:0:0:-:-"]),
]
# each resumed case, the uninterrupted run it must equal where the library resumes exactly, and
# the epoch it was resumed in
EXACT = {"even": ("even-ref", 0), "odd": ("odd-ref", 0), "map": ("map-ref", 0),
         "twice": ("even-ref", 0), "edge": ("even-ref", 0), "ep1": ("even-ref", 1),
         "w2": ("w2-ref", 0), "titan": ("even-ref", 0)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return launch_cases(LOOP, tmp_path_factory.mktemp("stream_state"), LAUNCHES)


def part(run, tag: str, case: str, epoch: int) -> list[int]:
    """Every id the ranks of launch `tag` received in `epoch` (with repeats)."""
    return [i for rank in range(len(run["logs"][tag]))
            for i in received(run, tag, case, rank).get(epoch, [])]


def expected(parts: list[list[int]]) -> dict:
    """A resumed epoch's figures from the ids each launch received in it: the samples received
    before a restart and again after it, the samples in no part."""
    repeated: set[int] = set()
    for k in range(1, len(parts)):
        repeated |= {i for p in parts[:k] for i in p} & set(parts[k])
    every = [i for p in parts for i in p]
    return {"seen_before": sum(len(p) for p in parts[:-1]), "seen": len(every),
            "unique": len(set(every)), "repeated": sorted(repeated),
            "skipped": sorted(set(range(N)) - set(every))}


def figures(e: dict) -> dict:
    resume = e["resume"]
    return {"seen_before": resume["seen_before"], "seen": e["seen"], "unique": e["unique"],
            "repeated": resume["repeated"]["ids"], "skipped": resume["skipped"]["ids"]}


def launches(case: str) -> str:
    return {"twice": "abc", "r3": "ad"}.get(case, "ab")


@pytest.mark.parametrize("case", sorted(EXACT))
def test_the_stream_resumes_exactly_and_the_watch_says_so(run, case):
    """datasets 5.2 + torchdata 0.11 resume these exactly: shards % world == 0 (even, datasets
    7538) and != 0 (odd), after .map (7630), resumed twice (PR 8295), at the epoch's last step,
    in epoch 1, with 2 workers, through DCP as torchtitan saves a loader. Each rank's ids over
    the launches equal the uninterrupted run's, and the watch counts what the loop received:
    what came before the stop, nothing repeated, nothing skipped."""
    ref, resumed_in = EXACT[case]
    for r in range(2):
        assert received(run, launches(case), case, r) == received(run, "a", ref, r)
    parts = [part(run, tag, case, resumed_in) for tag in launches(case)]
    parts = [p for p in parts if p] if case != "edge" else parts[:1] + [[]]
    e = entry(run, launches(case)[-1] if case != "edge" else "b", case, resumed_in)
    want = expected(parts)
    assert figures(e) == want and want["repeated"] == want["skipped"] == []
    assert e["ok"] and all(r.get("loader_state") for r in e["resume"]["restarts"])
    assert f"{want['seen_before']} before the stop, 0 repeated after the restart" in e["line"]


@pytest.mark.parametrize("case", ["even", "odd", "map", "w2", "twice"])
def test_the_epoch_after_a_resumed_epoch_is_not_called_reordered(run, case):
    """An unshuffled stream walks the same order each epoch (its uninterrupted run's epochs 0
    and 1 are equal per rank, and the watch says `order changed: no` there); after an epoch
    resumed mid-way, whose record holds the order of the part after the restart alone, the
    watch cannot compare the orders: `-`, not `yes` (it said `yes` before)."""
    ref = EXACT[case][0]
    for r in range(2):
        walked = received(run, "a", ref, r)
        assert walked[0] == walked[1]
    assert entry(run, "a", ref, 1)["order_changed"] is False
    e = entry(run, launches(case)[-1], case, 1)
    assert e["order_changed"] is None and "order changed: -" in e["line"]
    assert e["ok"] and e["seen"] == N


def test_a_resumed_epoch_1_is_compared_with_no_order(run):
    """Resumed at epoch 1 step 2: the part after the restart is no whole epoch's order to
    compare with epoch 0's (the same order, by the logs): `-`, not `yes`."""
    e = entry(run, "b", "ep1", 1)
    assert e["order_changed"] is None and "order changed: -" in e["line"]


def test_a_shuffled_stream_does_not_resume_exactly_and_the_watch_names_datasets(run):
    """datasets issue 7901, still in 5.2: `.shuffle(buffer_size=8)`, saved at step 2: the
    resumed stream deals other samples than the uninterrupted run (its state holds the source's
    position, not the shuffle buffer). The watch counts what the loop received (repeats and
    skips from the logs) and names the stream's own state as the cause, not a missing seed."""
    for r in range(2):
        got, ref = received(run, "ab", "shuf", r)[0], received(run, "a", "shuf-ref", r)[0]
        assert got[:8] == ref[:8] and got != ref
    want = expected([part(run, "a", "shuf", 0), part(run, "b", "shuf", 0)])
    e = entry(run, "b", "shuf", 0)
    assert figures(e) == want and want["repeated"] and want["skipped"]
    assert not e["ok"]
    assert (f"{len(want['repeated'])} repeated after the restart, {len(want['skipped'])} "
            "skipped") in e["line"]
    assert ("the loader restored its own state (loader.state_dict()), the stream's own state "
            "with it (datasets IterableDataset): a shuffled stream's state holds its source's "
            "position, not its shuffle buffer (datasets issue 7901)") in e["line"]
    assert "the loader's order and position were not restored" not in e["line"]


def test_dcp_of_the_loaders_state_dict_holds_the_watchs_part_once(run):
    """dcp.save({"loader": loader.state_dict(), ...}) on every rank: the watch's part no longer
    breaks DCP's save (it failed with `item.index.fqn not in md`: the main process's part
    held a tensor where the others held None); DCP keeps one copy of it, the main process's,
    counting the 16 ids the ranks received before the stop. DCP's load into a fresh loader's
    state is refused for the stream's own state (its fresh state lacks keys the saved one
    has), the library's refusal; torchtitan's way (test above, `titan`) resumes exactly."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert [run["logs"]["a"][r]["dcp"]["error"] for r in range(2)] == [None, None]
    plain = run["out"] / "dcp.pt"
    dcp_to_torch_save(run["out"] / "dcp.dcp", plain)
    saved = torch.load(plain, weights_only=False)
    watch_part = torch.load(io.BytesIO(saved["loader"]["_sharddemo_watch"]), weights_only=True)
    assert sorted(torch.nonzero(watch_part["before"]).flatten().tolist()) == sorted(
        part(run, "a", "dcp", 0))
    for r in range(2):
        error = run["logs"]["b"][r]["dcp"]["error"]
        assert error.startswith("load: RuntimeError: Missing key in checkpoint state_dict: "
                                "loader.dataset_state."), error


def test_a_two_rank_stream_state_resumed_on_three_ranks(run):
    """6 shards, saved at step 2 on 2 ranks (each rank at its second shard's second sample),
    loaded on 3 (rank 2 loads rank 0's state): each rank restores that position in its own
    3-rank shards, so samples are skipped; the watch counts them from what the loop received
    and names 2 -> 3 ranks."""
    for r in range(3):
        ref = received(run, "d", "r3-ref", r)[0]
        got = received(run, "d", "r3", r)[0]
        assert set(got) < set(ref) and got == [i for i in ref if i in set(got)]
    want = expected([part(run, "a", "r3", 0), part(run, "d", "r3", 0)])
    e = entry(run, "d", "r3", 0)
    assert figures(e) == want and want["skipped"] and not want["repeated"]
    assert e["resume"]["restarts"][-1]["changed"] == {"world_size": [2, 3]}
    assert "(2 -> 3 ranks" in e["line"] and not e["ok"]


def test_a_restored_stream_without_set_epoch_replays_its_position_each_epoch(run):
    """noep: the loop never calls the stream's set_epoch. Resumed at epoch 0 step 2, epoch 0 is
    exact, but datasets 5.2 applies the restored state again at epoch 1's start: each rank's
    epoch 1 begins where epoch 0 was restored (the loops' logs: the first 2 batches of each
    rank's shards never come). The watch reports exactly what the loops received and names the
    restored state as the cause."""
    e0, e1 = entry(run, "b", "noep", 0), entry(run, "b", "noep", 1)
    assert figures(e0) == expected([part(run, "a", "noep", 0), part(run, "b", "noep", 0)])
    got = part(run, "b", "noep", 1)
    assert sorted(set(got)) != list(range(N))  # (the library's own replay, in the logs)
    assert (e1["seen"], e1["unique"]) == (len(got), len(set(got)))
    [missing] = [v for v in e1["verdicts"] if v["verdict"] == "no-missing-samples"]
    assert not missing["ok"]
    assert f"{N - len(set(got))} never seen" in missing["detail"]
    assert "until set_epoch(epoch) is called on the dataset" in missing["detail"]
    assert "set_epoch(epoch) is called on the dataset" in e1["line"]
