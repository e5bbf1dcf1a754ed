"""litdata's StreamingDataset + StreamingDataLoader, watched with `id_field="id"`, its
`loader.state_dict()` saved with torch.save on every rank and loaded in the next launch
(docs/resume.md, "litdata"; docs/watch.md, "litdata").

Real ranks: torchrun, gloo, three launches of tests/scripts/litdata_loop.py shared by every test
here (2 ranks: the uninterrupted runs and the first part of the resumed ones; 2 ranks: the
resumes; 3 ranks: a 2-rank state resumed on 3, with a 3-rank uninterrupted run). The datasets are
written here with litdata's own writer: ids 0..N-1 in chunks of 7. What litdata itself does
(its split by rank, its resume, its elastic resume, litData issue 760) is read from the ids each
rank's loop logged, against the uninterrupted runs; every figure of the watch is checked against
those logs. Skipped where litdata is not installed (the extra `[litdata]`)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("litdata")

from support.launch import SCRIPTS, launch_env  # noqa: E402
from support.reports import entry, launch_cases, received  # noqa: E402

LOOP = str(SCRIPTS / "litdata_loop.py")
CHUNK, BATCH, EPOCHS = 7, 4, 3
SIZES = {"n40": 40, "n46": 46}  # the datasets written: ids 0..N-1

# (tag, ranks, cases): NAME:DATA:SHUFFLE:DROP:WORKERS:KIND:LOAD:STOP:LIMIT (tests/scripts/
# litdata_loop.py); a -ref case runs uninterrupted
LAUNCHES = [
    ("a", 2, ["base:n40:1:-:0:s:-:-:-", "odd-ref:n46:1:-:0:s:-:-:-", "keep:n46:0:0:0:s:-:-:-",
              "early:n40:0:-:0:e:-:-:-", "w2-ref:n40:1:-:2:s:-:-:-",
              "mid:n40:1:-:0:s:-:0.2:-", "ep2:n40:1:-:0:s:-:2.2:-", "edge:n40:1:-:0:s:-:0.5:-",
              "w2:n40:1:-:2:s:-:0.2:-", "odd:n46:1:-:0:s:-:0.3:-", "r3:n40:1:-:0:s:-:0.2:-",
              "cycle:n40:0:-:0:p:-:-:2"]),
    ("b", 2, ["mid:n40:1:-:0:s:t:-:-", "ep2:n40:1:-:0:s:t:-:-", "edge:n40:1:-:0:s:t:-:-",
              "w2:n40:1:-:2:s:t:-:-", "odd:n46:1:-:0:s:t:-:-"]),
    ("c", 3, ["r3:n40:1:-:0:s:t:-:-", "r3-ref:n40:1:-:0:s:-:-:-"]),
]
# each resumed case: the uninterrupted run it must equal (litdata resumes it exactly), the
# epoch it was resumed in, and its dataset's N
EXACT = {"mid": ("base", 0, 40), "ep2": ("base", 2, 40), "w2": ("w2-ref", 0, 40),
         "odd": ("odd-ref", 0, 46)}


def write_dataset(folder: Path, n: int) -> None:
    """ids 0..n-1, one {"id": i} per sample, in chunks of CHUNK, with litdata's own writer."""
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(folder), chunk_size=CHUNK)
    for i in range(n):
        writer[i] = {"id": i}
    writer.done()
    writer.merge()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("litdata")
    for name, n in SIZES.items():
        write_dataset(out / name, n)
    env = launch_env()
    env["LITDATA_DISABLE_VERSION_CHECK"] = "1"  # (litdata asks PyPI for a newer version)
    return launch_cases(LOOP, out, LAUNCHES, env)


def part(run, tag: str, case: str, epoch: int) -> list[int]:
    """Every id the ranks of launch `tag` received in `epoch` (with repeats)."""
    return [i for rank in range(len(run["logs"][tag]))
            for i in received(run, tag, case, rank).get(epoch, [])]


def steps(run, tag: str, case: str, epoch: int) -> list[int]:
    return [len(p["batches"]) for log in run["logs"][tag]
            for p in log[case]["passes"] if p["epoch"] == epoch]


def expected(parts: list[list[int]], n: int) -> dict:
    """A resumed epoch's figures from the ids each launch received in it."""
    before, after = parts
    every = before + after
    return {"seen_before": len(before), "seen": len(every), "unique": len(set(every)),
            "repeated": sorted(set(before) & set(after)),
            "skipped": sorted(set(range(n)) - set(every))}


def figures(e: dict) -> dict:
    resume = e["resume"]
    return {"seen_before": resume["seen_before"], "seen": e["seen"], "unique": e["unique"],
            "repeated": resume["repeated"]["ids"], "skipped": resume["skipped"]["ids"]}


@pytest.mark.parametrize("case,n", [("base", 40), ("odd-ref", 46)])
def test_litdata_splits_by_rank_and_the_watch_counts_the_whole_dataset(run, case, n):
    """litdata splits by rank itself (its drop_last is on by default on more than one rank):
    each rank gets an equal share, whole batches, and the rest of the N samples is dropped, a
    new set of them each shuffled epoch (the logs: 40 of 46, 6 dropped, under one global batch
    of 8). The watch takes N from the dataset's index (46), not from len(dataset), which is a
    rank's share (20: taken as N, it called rank 1's ids out of range), and its verdicts are
    the logs': what was missing is drop_last's, nothing twice, equal steps."""
    dropped = []
    for epoch in range(EPOCHS):
        ranks = [received(run, "a", case, r)[epoch] for r in range(2)]
        assert len(ranks[0]) == len(ranks[1]) == 20 and not set(ranks[0]) & set(ranks[1])
        got = ranks[0] + ranks[1]
        missing = sorted(set(range(n)) - set(got))
        dropped.append(missing)
        e = entry(run, "a", case, epoch)
        assert (e["dataset_size"], e["seen"], e["unique"]) == (n, len(got), len(set(got)))
        assert e["missing"]["count"] == len(missing) and e["missing"]["ids"] == missing
        assert e["steps"] == steps(run, "a", case, epoch) == [5, 5]
        assert e["ok"] and "ids-in-range" not in e["line"]
        if missing:
            assert e["missing"]["reason"] == "drop-last" and len(missing) < 2 * BATCH
    if n == 46:  # shuffled: another 6 each epoch (the logs)
        assert len({tuple(d) for d in dropped}) == EPOCHS


def test_litdata_without_drop_last_splits_by_chunk_and_the_ranks_take_unequal_steps(run):
    """drop_last=False (litdata warns): 46 samples in chunks of 7 split by whole chunks, 20 to
    rank 0 and 26 to rank 1 (the logs): every sample once, but unequal step counts (5 and 7),
    which the watch fails (DDP would hang there)."""
    for epoch in range(EPOCHS):
        ranks = [received(run, "a", "keep", r)[epoch] for r in range(2)]
        assert sorted(ranks[0] + ranks[1]) == list(range(46))
        e = entry(run, "a", "keep", epoch)
        assert e["steps"] == steps(run, "a", "keep", epoch) == [5, 7]
        assert e["unique"] == 46 and not e["ok"]
        assert "FAIL equal-step-counts: steps per rank [5, 7]" in e["line"]


def test_a_dataset_built_before_the_process_group_reads_every_rank_as_rank_0(run):
    """Built before init_process_group under torchrun (WORLD_SIZE set, GLOBAL_RANK not), litdata
    reads every rank as rank 0: both ranks receive rank 0's 20 samples (the logs). The watch
    fails the replication at each epoch's end, and rank 1 says why at watch(), in a line of its
    own."""
    for epoch in range(EPOCHS):
        ranks = [received(run, "a", "early", r)[epoch] for r in range(2)]
        assert ranks[0] == ranks[1] == list(range(20))
        e = entry(run, "a", "early", epoch)
        assert (e["seen"], e["unique"]) == (40, 20) and not e["ok"]
        assert "no-silent-replication" in e["line"]
    said = [line for line in run["stderr"]["a"].splitlines() if "reads itself as rank" in line]
    assert len(said) == 1 and "[rank 1/2] sharddemo.watch: early: litdata's StreamingDataset " \
        "on this rank reads itself as rank 0 of 2" in said[0], run["stderr"]["a"][-2000:]


@pytest.mark.parametrize("case", sorted(EXACT))
def test_litdata_resumes_from_its_own_state_exactly_and_the_watch_says_so(run, case):
    """Saved mid-epoch (epoch 0 step 2; epoch 2 step 2, after two whole epochs: litData issue
    760's "after the 2nd epoch"; with 2 workers; on 46 samples, whose drop_last drops 6), loaded
    into a fresh loader in a new launch: each rank's ids over the launches equal the
    uninterrupted run's (litdata 0.2.76 resumes exactly), and the watch counts the whole epoch
    as the logs give it: what came before the stop, nothing repeated, and nothing skipped but
    what drop_last leaves out of every epoch."""
    ref, resumed_in, n = EXACT[case]
    for r in range(2):
        assert received(run, "ab", case, r) == received(run, "a", ref, r)
    want = expected([part(run, "a", case, resumed_in), part(run, "b", case, resumed_in)], n)
    e = entry(run, "b", case, resumed_in)
    assert figures(e) == want and want["repeated"] == []
    assert want["skipped"] == sorted(set(range(n)) - set(part(run, "a", ref, resumed_in)))
    assert e["ok"] and e["resume"]["restarts"][-1]["loader_state"]
    said = f"{want['seen_before']} before the stop, 0 repeated after the restart, "
    if n == 46:
        assert e["missing"]["reason"] == "drop-last"
        assert said + "6 never delivered (what drop_last leaves out)" in e["line"]
    else:
        assert said + "0 skipped" in e["line"]


def test_saved_after_an_epochs_last_step_litdata_goes_on_with_the_next_epoch(run):
    """Saved after epoch 0's last step: litdata's first pass in the new launch is epoch 1, whole
    (it gives no empty rest of epoch 0, as torchdata's StatefulDataLoader does), and the watch
    numbers it epoch 1, restarted before its first step."""
    for r in range(2):
        assert received(run, "ab", "edge", r) == received(run, "a", "base", r)
    e = entry(run, "b", "edge", 1)
    assert e["ok"] and e["seen"] == e["unique"] == 40
    assert "restarted before its first step: saved at epoch 0 step 5, after its last step" \
        in e["line"]


def test_a_two_rank_state_resumed_on_three_ranks_litdata_resplits_the_rest(run):
    """litData PR 878's elastic resume, 0.2.76: a state saved at step 2 on 2 ranks (16 samples
    delivered), loaded on 3 (rank 2 loads rank 0's). litdata neither refuses nor replays per
    rank: it goes on from its own order of the epoch, from 16 rounded down to a whole global
    batch of the new size (3 x 4 = 12), so 4 samples come again, and its drop_last cuts the
    remaining 28 to 24 (2 batches a rank), so 4 never come (the logs). Epoch 1 is then the
    3-rank run's own. The watch counts the epoch from the logs, names 2 -> 3 ranks and litdata's
    re-split as the cause."""
    before, after = part(run, "a", "r3", 0), part(run, "c", "r3", 0)
    assert (len(before), len(after)) == (16, 24)
    assert len(set(before) & set(after)) == 16 - 12
    assert steps(run, "c", "r3", 0) == [2, 2, 2]
    for r in range(3):
        assert received(run, "c", "r3", r)[1] == received(run, "c", "r3-ref", r)[1]
    want = expected([before, after], 40)
    e = entry(run, "c", "r3", 0)
    assert figures(e) == want and len(want["repeated"]) == len(want["skipped"]) == 4
    assert e["resume"]["restarts"][-1]["changed"] == {"world_size": [2, 3]}
    assert not e["ok"] and "(2 -> 3 ranks, 4 repeated)" in e["line"]
    assert "litdata re-split the rest of the epoch onto the new ranks (its elastic resume, " \
        "litData PR 878)" in e["line"]


def test_a_cycling_parallel_stream_goes_on_after_the_second_epoch(run):
    """litData issue 760 (ParallelStreamingDataset(length=..., resume=True) with a loop that
    breaks early: from the third epoch on, the same samples as the second), 0.2.76: fixed. The
    loop breaks after 2 steps an epoch; the stream takes 12 samples a rank an epoch, going on
    where the last one stopped: each rank's epochs, in the logs, are consecutive windows of its
    share, none dealt again. The loader's own load_state_dict(state_dict()) at each pass's start
    is no resume for the watch (it called each epoch restarted), and the epoch that the stream
    ended (1 step) is a window by design, not a loss."""
    for r in range(2):
        got = received(run, "a", "cycle", r)
        walked = got[0] + got[1] + got[2]
        assert len(walked) == len(set(walked)) == 8 + 4 + 8
        assert walked == list(range(20 * r, 20 * r + 20))
    for epoch, partial in ((0, True), (1, False), (2, True)):
        e = entry(run, "a", "cycle", epoch, partial=partial)
        got = part(run, "a", "cycle", epoch)
        assert (e["seen"], e["unique"]) == (len(got), len(set(got))) and e["ok"]
        assert "resume" not in e and "restarted" not in e["line"]
    assert entry(run, "a", "cycle", 1)["missing"]["reason"] == "sampler-draws"
