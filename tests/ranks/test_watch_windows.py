"""The watch's checks within an epoch on real gloo ranks running tests/scripts/watch_loop.py
`windows`: every `check_every` steps the ranks meet once and judge the window of steps so far,
checked against the ids each rank's loop itself received (logged by the script beside the
watch)."""

from __future__ import annotations

import json

import pytest
from support.launch import accelerate_launch, ended_or_aborted_at_teardown
from support.reports import entries


LOOP = "tests/scripts/watch_loop.py"


def failed(entry: dict) -> set[str]:
    return {v["verdict"] for v in entry["verdicts"] if not v["ok"]}


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
    # every id of the window's 50 steps on both ranks, as the loops logged them
    window_ids = ids[0][0][:400] + ids[1][0][:400]
    assert (first["seen"], first["unique"]) == (len(window_ids), len(set(window_ids))) == (
        800, 400)
    assert failed(first) == {"no-silent-replication"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("sharddemo:")]
    assert lines[0].startswith("sharddemo: epoch 0 train steps 1-50 (checked at step 52): FAIL")


@pytest.mark.parametrize("loader,world", [("prepared", 2), ("prepared", 3), ("sampler", 2),
                                          ("sampler", 3)])
def test_sharded_loaders_never_fail_a_window(tmp_path, loader, world):
    """accelerate's prepared loader (its fill at the end) and a DistributedSampler with
    set_epoch (its padding at the end), 1001 samples, batch 8, windows of 5 steps, 2 epochs:
    no window fails (neither replication nor a repeat: the fill and the padding come in a
    rank's last batch; nor the order in epoch 1: both deal a new one), and each epoch's entry
    agrees with what the loops received."""
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


# -- a sample a rank received twice; the order of the previous epoch --------------------------


def run_cases(tmp_path, cases: str, *args, nproc: int = 2, check: bool = True):
    report = tmp_path / "w.jsonl"
    proc = accelerate_launch([LOOP, "cases", "--cases", cases, "--report", str(report),
                              "--ids", str(tmp_path), "--check-every", "5", *args],
                             nproc=nproc, check=False)
    if check:
        assert ended_or_aborted_at_teardown(proc), proc.stderr
    ids = {case: [json.loads((tmp_path / f"{case}_rank{r}.json").read_text())
                  for r in range(nproc)] for case in cases.split(",")}
    return proc, entries(report), ids


@pytest.mark.parametrize("world", [2, 3])
def test_repeats_and_the_previous_order_in_the_windows_of_real_ranks(tmp_path, world):
    """One launch, 2 or 3 ranks, windows of 5 steps of 8, 2 epochs of four loaders (named in the
    report): `dup` (each rank's own sampler deals one id twice) is named in the first window
    after the second copy; `replacement` (RandomSampler(replacement=True), prepared) never in
    a window; a shuffling DistributedSampler with set_epoch never, without it in epoch 1's
    first window. Expected values from the ids each rank's loop received."""
    proc, got, ids = run_cases(tmp_path, "dup,replacement,shuffle,shuffle-no-set-epoch",
                               nproc=world)
    windows = {}
    for e in got:
        if "window" in e:
            windows.setdefault(e["loader"], []).append(e)
    # dup: the first position at which a rank's ids repeat one it received before
    for epoch in (0, 1):
        firsts = []
        for r in range(world):
            mine = ids["dup"][r][epoch]
            firsts.append(next(k for k in range(len(mine)) if mine[k] in mine[:k]))
        assert len(set(firsts)) == 1  # (every rank's repeat at the same position)
        step = firsts[0] // 8 + 1  # the batch of 8 the second copy came in
        last = -(-step // 5) * 5  # the window of 5 steps that holds it
        [window] = [w for w in windows["dup"] if w["epoch"] == epoch]
        # (its exchange starts as batch last + 1 arrives and is judged one batch later)
        assert window["window"] == {"first_step": last - 4, "last_step": last,
                                    "checked_at": last + 2}
        assert failed(window) == {"no-unexplained-duplicates"}
        repeated = sorted(ids["dup"][r][epoch][firsts[r]] for r in range(world))
        assert window["duplicated"]["ids"] == repeated
    # replacement: the ranks' own draws repeat (the library's sampler), no window says so
    drawn = [i for r in range(world) for i in ids["replacement"][r][0]]
    assert len(set(drawn)) < len(drawn)
    assert "replacement" not in windows and "shuffle" not in windows
    # without set_epoch DistributedSampler deals epoch 0's order again (the loops' own ids)
    assert all(ids["shuffle-no-set-epoch"][r][1] == ids["shuffle-no-set-epoch"][r][0]
               for r in range(world))
    assert all(ids["shuffle"][r][1][:40] != ids["shuffle"][r][0][:40] for r in range(world))
    [window] = windows["shuffle-no-set-epoch"]
    assert (window["epoch"], window["window"]) == (1, {"first_step": 1, "last_step": 5,
                                                       "checked_at": 7})
    assert failed(window) == {"order-changes-each-epoch"}


def test_raise_at_a_repeat_stops_every_rank_at_the_same_step(tmp_path):
    """`dup` with on_violation="raise": each rank's 61st id (0-based 60) is its 50th again, in
    its 8th batch of 8 (60 // 8 + 1), so the window of steps 6-10 fails: its exchange starts as
    batch 11 arrives and is judged as batch 12 arrives: both ranks raise ShardingViolation
    there, having received 11 batches, nobody hangs."""
    proc, got, ids = run_cases(tmp_path, "dup", "--on-violation", "raise", check=False)
    assert proc.returncode != 0
    raised = [x for x in proc.stderr.splitlines() if "ShardingViolation: sharddemo:" in x]
    assert len(raised) == 2 and all("steps 6-10 (checked at step 12)" in x for x in raised), \
        proc.stderr
    assert all(len(ids["dup"][r][0]) == 11 * 8 for r in range(2))  # 11 steps taken, not 12
    assert [("window" in e, e["ok"]) for e in got] == [(True, False)]


# (2 ranks: 501 ids a rank, the repeat after the 200th, at step 201, in the window of steps
# 151-350 (150 + 200); 3 ranks: 334 a rank, past the 350 of that window's end, so the repeat
# comes after the 120th, at step 121, in the window of steps 51-150 (50 + 100))
@pytest.mark.parametrize("world,at,first,last", [(2, 200, 151, 350), (3, 120, 51, 150)])
def test_the_default_windows_grow_and_a_late_repeat_raises_on_every_rank(tmp_path, world, at,
                                                                        first, last):
    """check_every="auto" (the default: windows end at steps 50, 150, 350, 750, ... of each
    epoch), batches of 1, on 2 and 3 ranks, with on_violation="raise". First `shuffle` (a
    DistributedSampler with set_epoch over 1001, 2 epochs of 501 or 334 steps: windows at 50,
    150, and 350 on 2 ranks): no window is flagged. Then `dup`, whose sampler deals each
    rank's 50th id again after its `at`-th: the second copy is the rank's step at + 1, in the
    window first-last, whose exchange starts as batch last + 1 arrives and is judged as batch
    last + 2 arrives: every rank raises ShardingViolation there, having received last + 1
    batches. Positions from the ids each rank's loop received."""
    proc, got, ids = run_cases(tmp_path, "shuffle,dup", "--check-every", "auto", "--batch", "1",
                               "--dup-at", str(at), "--on-violation", "raise", nproc=world,
                               check=False)
    assert proc.returncode != 0
    # shuffle: two whole epochs, every sample once, no window entry
    shuffle = [e for e in got if e["loader"] == "shuffle"]
    assert [("window" in e, e["ok"]) for e in shuffle] == [(False, True), (False, True)]
    for epoch in (0, 1):
        received = [i for r in range(world) for i in ids["shuffle"][r][epoch]]
        assert len(set(received)) == 1001
    # dup: where each rank's loop received a sample for the second time
    seconds = []
    for r in range(world):
        mine = ids["dup"][r][0]
        seconds.append(next(k for k in range(len(mine)) if mine[k] in mine[:k]) + 1)
    assert seconds == [at + 1] * world  # (the step, of batches of 1, of the second copy)
    assert all(first <= step <= last for step in seconds)
    raised = [x for x in proc.stderr.splitlines() if "ShardingViolation: sharddemo:" in x]
    assert len(raised) == world, proc.stderr
    said = f"dup steps {first}-{last} (checked at step {last + 2})"
    assert all(said in x for x in raised), raised
    assert all(len(ids["dup"][r][0]) == last + 1 for r in range(world))  # not last + 2
    [window] = [e for e in got if e["loader"] == "dup"]
    assert window["window"] == {"first_step": first, "last_step": last, "checked_at": last + 2}
    assert failed(window) == {"no-unexplained-duplicates"}


def test_ranks_whose_datasets_differ_in_length_are_named_and_training_goes_on(tmp_path):
    """A stream whose len() is each rank's own part's (rank 0: 30 ids, rank 1: 60; batches of
    2, id_field "."), windows of 5 steps, 2 epochs: each rank's counter was sized from its own
    length, and gloo aborted the epoch's all-reduce of unequal sizes ("Received data size
    doesn't match"). Now the loop runs to its end on both ranks, every epoch's entry agrees
    with the ids the loops logged (counted over 0..29, the shortest length) and names the
    disagreement."""
    proc, got, ids = run(tmp_path, "--loader", "sized", "--check-every", "5", "--epochs", "2")
    assert proc.returncode == 0, proc.stderr
    assert "Received data size" not in proc.stderr
    epochs = [e for e in got if "window" not in e]
    assert [e["epoch"] for e in epochs] == [0, 1]
    for e in epochs:
        mine = [ids[r][e["epoch"]] for r in range(2)]
        assert [len(m) for m in mine] == [30, 60]  # (each rank's len(), as its loop received)
        received = mine[0] + mine[1]
        assert e["seen"] == len(received) == 90
        assert e["unique"] == len(set(received))
        assert e["steps"] == [len(m) // 2 for m in mine] == [15, 30]
        assert e["dataset_size"] == 30
        assert e["missing"]["count"] == len(set(range(30)) - set(received))
        assert {"ranks-agree-on-dataset", "equal-step-counts"} <= failed(e)
        [agree] = [v for v in e["verdicts"] if v["verdict"] == "ranks-agree-on-dataset"]
        assert "rank 0 has 30, rank 1 has 60" in agree["detail"]
    windows = [e for e in got if "window" in e]
    assert windows and all(e["window"]["first_step"] <= e["window"]["last_step"]
                           for e in windows)
    assert "ranks-agree-on-dataset" in failed(windows[0])
