"""The watch's checks within an epoch: every `check_every` steps the ranks meet once and judge
the window of steps so far. The judgement alone (analysis.watch_window, literals worked out by
hand), then on real gloo ranks running tests/watch_loop.py `windows`, checked against the ids
each rank's loop itself received (logged by the script beside the watch)."""

from __future__ import annotations

import json

import pytest
from conftest import accelerate_launch, ended_or_aborted_at_teardown
from test_watch import entries

from sharddemo.analysis.watch_window import judge_window

LOOP = "tests/watch_loop.py"


def failed(entry: dict) -> set[str]:
    return {v["verdict"] for v in entry["verdicts"] if not v["ok"]}


# -- the judgement alone ----------------------------------------------------------------------

def head(steps: int, done: int = 0, n: int = 100) -> dict:
    return {"done": done, "steps": steps, "n": n}


def test_a_window_whose_ranks_share_nothing_holds():
    """2 ranks, 2 steps of 2: rank 0 got 0, 2, 4, 6 and rank 1 got 1, 3, 5, 7."""
    entry = judge_window(epoch=0, name="train", first=1, last=2, at=3,
                         heads=[head(2), head(2)], ids=[[0, 2, 4, 6], [1, 3, 5, 7]], earlier=0,
                         n=100)
    assert entry["ok"] and not failed(entry) and entry["seen"] == entry["unique"] == 8
    assert entry["window"] == {"first_step": 1, "last_step": 2, "checked_at": 3}


def test_the_same_samples_on_every_rank_is_replication():
    entry = judge_window(epoch=1, name="train", first=51, last=100, at=101,
                         heads=[head(100), head(100)], ids=[[5, 6, 7], [5, 6, 7]], earlier=0,
                         n=100)
    assert failed(entry) == {"no-silent-replication"}
    assert entry["duplicated"] == {"count": 3, "ids": [5, 6, 7], "reasons": ["replication"]}
    assert entry["line"].startswith("sharddemo: epoch 1 train steps 51-100 (checked at step "
                                    "101): FAIL no-silent-replication: 3 samples")
    assert "not sharded" in entry["line"]


def test_overlapping_shares_and_an_earlier_window_are_named():
    # rank 0: 1, 2, 3; rank 1: 3, 4, 5 -> sample 3 on both (an overlap, not replication)
    entry = judge_window(epoch=0, name="train", first=1, last=1, at=2,
                         heads=[head(1), head(1)], ids=[[1, 2, 3], [3, 4, 5]], earlier=0, n=9)
    assert entry["duplicated"]["ids"] == [3] and "overlap" in entry["line"]
    # nothing shared in this window, but 2 found at the previous one across windows
    entry = judge_window(epoch=0, name="train", first=2, last=2, at=3,
                         heads=[head(2), head(2)], ids=[[6], [7]], earlier=2, n=9)
    assert failed(entry) == {"no-silent-replication"}
    assert "2 samples of the previous window" in entry["line"]


def test_a_rank_out_of_data_and_ranks_that_disagree_on_the_dataset():
    entry = judge_window(epoch=0, name="train", first=11, last=15, at=16,
                         heads=[head(15, done=1, n=-1), head(15, n=-1)], ids=[[], [9, 11]],
                         earlier=0, n=None)
    assert failed(entry) == {"equal-step-counts"}
    assert "rank 0 ran out of data after 15 steps while rank 1 went on to step 16" in \
        entry["line"]
    entry = judge_window(epoch=0, name="train", first=1, last=5, at=6,
                         heads=[head(5, n=1000), head(5, n=999)], ids=[[0], [1]], earlier=0,
                         n=1000)
    assert failed(entry) == {"ranks-agree-on-dataset"}
    assert "rank 0 has 1,000, rank 1 has 999" in entry["line"]


def test_every_rank_at_its_end_is_no_fault():
    """The last exchange of an epoch: every rank done (1: its loader ran out; 2: closing)."""
    entry = judge_window(epoch=0, name="train", first=1, last=7, at=8,
                         heads=[head(7, done=1), head(5, done=2)], ids=[[], []], earlier=0,
                         n=100)
    assert entry["ok"]


# -- real ranks -------------------------------------------------------------------------------

def run(tmp_path, *args, nproc: int = 2, check: bool = True):
    report = tmp_path / "w.jsonl"
    proc = accelerate_launch([LOOP, "windows", "--report", str(report), "--ids", str(tmp_path),
                              *args], nproc=nproc, check=False)
    if check:
        assert ended_or_aborted_at_teardown(proc), proc.stderr
    ids = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    got = entries(report) if report.exists() else []
    return proc, got, ids


@pytest.mark.parametrize("stream", ["torch", "datasets"])
def test_an_unsplit_stream_is_named_in_its_first_window(tmp_path, stream):
    """Every rank reads the whole stream (a torch IterableDataset of ids 0..999, or a datasets
    stream of 1001 ids not passed through split_dataset_by_node), batch 8, default
    check_every: the first window, steps 1-50, is exchanged as batch 51 arrives and judged one
    batch later (WINDOW_LAG = 1: as batch 52 arrives), and fails no-silent-replication; each
    failing verdict is reported once an epoch (no line every window)."""
    if stream == "datasets":
        pytest.importorskip("datasets")
    proc, got, ids = run(tmp_path, *(["--loader", "stream"] if stream == "torch" else
                                     ["--loader", "hf", "--no-split"]))
    assert ids[0] == ids[1]  # what the loops received: the same stream on both ranks
    windows = [e for e in got if "window" in e]
    assert len(windows) == 1
    [first] = windows
    assert first["window"] == {"first_step": 1, "last_step": 50, "checked_at": 52}
    shared = set(ids[0][0][:400]) & set(ids[1][0][:400])  # 50 steps of 8 on each rank
    assert first["duplicated"]["count"] == len(shared) == 400
    assert failed(first) == {"no-silent-replication"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("sharddemo:")]
    assert lines[0].startswith("sharddemo: epoch 0 train steps 1-50 (checked at step 52): FAIL")


@pytest.mark.parametrize("loader,world", [("prepared", 2), ("prepared", 3), ("sampler", 2),
                                          ("sampler", 3)])
def test_sharded_loaders_never_fail_a_window(tmp_path, loader, world):
    """accelerate's prepared loader (its fill at the end) and a DistributedSampler with
    set_epoch (its padding at the end), 1001 samples, batch 8, windows of 5 steps, 2 epochs:
    no window fails, and each epoch's entry agrees with what the loops received."""
    proc, got, ids = run(tmp_path, "--loader", loader, "--check-every", "5", "--epochs", "2",
                         nproc=world)
    assert not [e for e in got if "window" in e], [e["line"] for e in got]
    epochs = [e for e in got if "window" not in e]
    assert [e["epoch"] for e in epochs] == [0, 1]
    for e in epochs:
        received = [i for r in range(world) for i in ids[r][e["epoch"]]]
        assert (e["seen"], e["unique"]) == (len(received), len(set(received)))
        assert e["steps"] == [-(-len(ids[r][e["epoch"]]) // 8) for r in range(world)]
        assert e["ok"] and len(set(received)) == 1001


def test_a_rank_out_of_data_is_named_and_nobody_waits(tmp_path):
    """Rank 0's stream ends after 15 steps, rank 1's after 30 (batches of 2; their own logs
    say so), windows of 5: rank 0 answers rank 1's windows from its epoch's end; the window
    rank 1 starts as its batch 16 arrives is judged one batch later (WINDOW_LAG = 1), at step
    17, and names it; both epochs' ends meet."""
    proc, got, ids = run(tmp_path, "--loader", "uneven", "--check-every", "5")
    steps = [len(ids[r][0]) // 2 for r in range(2)]
    assert steps == [15, 30]
    [window] = [e for e in got if "window" in e]
    assert failed(window) == {"equal-step-counts"}
    assert window["window"]["checked_at"] == steps[0] + 2  # started at 16, judged at 17
    assert "rank 0 ran out of data after 15 steps while rank 1 went on to step 16" in \
        window["verdicts"][0]["detail"]
    [epoch] = [e for e in got if "window" not in e]
    assert epoch["steps"] == steps and "equal-step-counts" in failed(epoch)


def test_raise_at_a_window_stops_every_rank_at_the_same_step(tmp_path):
    """The same uneven streams with on_violation="raise": both ranks raise ShardingViolation
    for the exchange rank 1 starts at step 16 and judges at step 17 (rank 0 from its epoch's
    end), nobody hangs."""
    proc, got, ids = run(tmp_path, "--loader", "uneven", "--check-every", "5",
                         "--on-violation", "raise", check=False)
    assert proc.returncode != 0
    raised = [x for x in proc.stderr.splitlines() if "ShardingViolation: sharddemo:" in x]
    assert len(raised) == 2 and all("(checked at step 17)" in x for x in raised), proc.stderr
    assert len(ids[1][0]) // 2 == 16  # rank 1 stopped at its step 17, before taking it
    assert [("window" in e, e["ok"]) for e in got] == [(True, False)]


@pytest.mark.parametrize("world,workers", [(2, 0), (2, 2), (3, 0), (3, 2)])
def test_split_dataset_by_node_is_never_flagged_in_a_window(tmp_path, world, workers):
    """A datasets stream (1001 ids, 4 shards) split with split_dataset_by_node (whole shards
    per rank on 2 ranks, every 3rd example on 3), read with 0 or 2 workers, windows of 5 steps,
    2 epochs: no window finds a sample on two ranks or a disagreement; a rank out of data is
    named only where the ranks' own logs show unequal step counts."""
    pytest.importorskip("datasets")
    proc, got, ids = run(tmp_path, "--loader", "hf", "--workers", str(workers),
                         "--check-every", "5", "--epochs", "2", nproc=world)
    windows = [e for e in got if "window" in e]
    assert not {v for e in windows for v in failed(e)} - {"equal-step-counts"}, \
        [e["line"] for e in windows]
    for e in [e for e in got if "window" not in e]:
        received = [i for r in range(world) for i in ids[r][e["epoch"]]]
        assert (e["seen"], e["unique"]) == (len(received), len(set(received)))
        assert len(received) == len(set(received)) == 1001
        steps = e["steps"]
        if [w for w in windows if w["epoch"] == e["epoch"]]:  # (a rank out of data, named)
            assert len(set(steps)) > 1
        assert e["ok"] == (len(set(steps)) == 1)
