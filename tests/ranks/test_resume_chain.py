"""`audit --resume-at` chains of stops and restarts on real gloo ranks: an unseeded chain of
two restarts, a resume on 3 ranks of a 2-rank checkpoint, a save after an epoch's last step,
and the chains refused before any rank. The ids are checked against the same library loaders
built in this process (tests/support/library_loops.py), or against literals worked out by
hand."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from support.library_loops import flat, ids_of, library_loader, uninterrupted
from support.launch import ROOT, sharddemo

FACTORIES = str(ROOT / "tests" / "support" / "factories.py")
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


# ---------------------------------------------------------------------------------------------
# The loop, written here against accelerate alone.


# ---------------------------------------------------------------------------------------------
# Bad input: one Error line, exit 2, before any rank starts.

@pytest.mark.parametrize("args,message", [
    (["--resume-at", "0:7,0:3"], "the stops are out of order (0:3 comes before 0:7"),
    (["--resume-at", "1:0,0:last"], "the stops are out of order"),
    (["--resume-at", "0:3,0:7", "--resume-num-processes", "3"],
     "gives 1 world size(s) for 2 restart(s)"),
    (["--resume-at", "0:3", "--resume-num-processes", "3,2"],
     "gives 2 world size(s) for 1 restart(s)"),
    (["--resume-at", "0:3", "--resume-num-processes", "0"], "at least 1"),
    (["--resume-at", "0:3,0:first"], "'0:first' is not EPOCH:STEP"),
    (["--resume-at", "0:3,2:last"], "2:last stops in epoch 2, beyond --epochs 2"),
])
def test_a_chain_that_cannot_run_is_one_error_line_before_any_rank(args, message):
    proc = sharddemo(["audit", f"{FACTORIES}:seeded_80", *args], check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines
    assert "--resume" in lines[0]


# ---------------------------------------------------------------------------------------------
# Real ranks (2 and 3 gloo ranks; N = 80, batch 4: 10 steps per rank on 2 ranks, by hand).

def resume_audit(target, *args, nproc=2, env=None):
    import jsonschema

    proc = sharddemo(["audit", f"{FACTORIES}:{target}", "--num-processes", str(nproc),
                      "--format", "json", *args], check=False, env=env)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    return proc, report


def logged_launches(folder) -> list[list[list[int]]]:
    """[launch][rank] -> the ids each rank's dataset was asked for (factories.Logged), the
    launches in the order they started."""
    launches: dict[str, dict[int, tuple]] = {}
    for path in folder.iterdir():
        start, launcher, rank = path.stem.split("-")
        ids = [int(line) for line in path.read_text().split()]
        launches.setdefault(launcher, {})[int(rank)] = (int(start), ids)
    ordered = sorted(launches.values(), key=lambda ranks: min(s for s, _ in ranks.values()))
    return [[ranks[r][1] for r in sorted(ranks)] for ranks in ordered]


def test_an_unseeded_chain_of_two_restarts_counts_every_sample_each_restart_repeated(tmp_path):
    """An unseeded chain in one epoch: 0:3 then 0:7 in one epoch, no seed. Launches, in order: the stop at
    0:3, the uninterrupted run, the restart that stops at 0:7, the last restart. The ids each
    loop received are its dataset's requests (a prepared loader asks for one batch ahead, so a
    stopped launch's requests past its stop were never received: only the first STEP x 4 count)."""
    env = {"SHARDDEMO_TEST_LOG_DIR": str(tmp_path)}
    import os

    env = {**os.environ, **env}
    proc, report = resume_audit("unseeded_logged_80", "--resume-at", "0:3,0:7", env=env)
    resume = report["modes"]["audit"]["resume"]
    stop, reference, middle, last = logged_launches(tmp_path)
    # per rank (by hand): 3 steps x 4 before 0:3, 4 x 4 from step 3 to 7, 3 x 4 after 7, then
    # epoch 1 whole (10 x 4)
    parts = [[ids[:12] for ids in stop], [ids[:16] for ids in middle],
             [ids[:12] for ids in last]]
    epoch0 = Counter(i for launch in parts for ids in launch for i in ids)
    epoch1 = Counter(i for ids in last for i in ids[12:52])
    ref0 = Counter(i for ids in reference for i in ids[:40])
    ref1 = Counter(i for ids in reference for i in ids[40:80])
    assert ref0 == ref1 == Counter(range(80))  # the uninterrupted run: every id once an epoch
    e0, e1 = resume["epochs"]
    assert e0["seen"] == sum(epoch0.values()) == 80
    assert e0["repeated"]["ids"] == sorted((epoch0 - ref0).elements())
    assert e0["skipped"]["ids"] == sorted((ref0 - epoch0).elements())
    assert e1["repeated"]["ids"] == sorted((epoch1 - ref1).elements()) == []
    assert [e["received"] for e in e0["launches"]] == [24, 32, 24]
    first, second = resume["restarts"]
    before1 = Counter(i for ids in parts[0] for i in ids)
    assert first["repeated"]["ids"] == sorted((Counter(i for ids in parts[1] for i in ids)
                                               & before1).elements())
    before2 = before1 + Counter(i for ids in parts[1] for i in ids)
    assert second["repeated"]["ids"] == sorted((Counter(i for ids in parts[2] for i in ids)
                                                & before2).elements())
    assert (first["received_before"], first["received_after"]) == ([12, 12], [16, 16])
    assert (second["received_before"], second["received_after"]) == ([16, 16], [12, 12])
    assert first["skipped"] is None and not resume["deterministic"]  # no common order
    assert resume["world_sizes"] == [2, 2, 2] and proc.returncode == 1
    assert "restart 1 after 0:3" in resume["explanation"]
    assert "restart 2 after 0:7" in resume["explanation"]


def test_resumed_on_3_ranks_the_new_sizes_fill_is_fill_and_the_next_epoch_passes():
    """A changed world size: a 2-rank checkpoint (0:3) resumed on 3 ranks. Expected from
    accelerate's own loaders in this process: the first 3 batches of each of 2 ranks, then
    skip_first_batches(loader, 3) of each of 3 ranks, then epoch 1 of the same loaders."""
    from accelerate.data_loader import skip_first_batches

    proc, report = resume_audit("seeded_80", "--resume-at", "0:3", "--resume-num-processes",
                                "3")
    resume = report["modes"]["audit"]["resume"]
    before = [ids_of(library_loader(80, 4, 2, r))[:3] for r in range(2)]
    after, epoch1 = [], []
    for r in range(3):
        loader = library_loader(80, 4, 3, r)
        after.append(ids_of(skip_first_batches(loader, 3)))
        epoch1.append(ids_of(loader))
    ref2, ref3 = uninterrupted(80, 4, 2, 2), uninterrupted(80, 4, 3, 2)
    got = Counter(flat(before) + flat(after))
    base = Counter(flat(ref2[0]))
    fill3 = Counter(flat(ref3[0])) - base  # the 3-rank loader's own even_batches fill
    assert sum(fill3.values()) == 4  # by hand: 20 batches dealt to 3 ranks, 7 each, 1 filled
    e0, e1 = resume["epochs"]
    assert e0["repeated"]["ids"] == sorted((got - base).elements())  # 4, all fill
    assert e0["skipped"]["ids"] == sorted((base - got).elements())  # 12
    assert e0["fill"] == {"world_size": 3, "repeated": sum((fill3 & (got - base)).values()),
                          "skipped": 0}
    assert not e0["resume_exact"]
    # epoch 1, wholly on 3 ranks: what the 3-rank loaders dealt, its fill explained as fill
    assert [r["batches"] for r in e1["ranks"]] == epoch1 == ref3[1]
    assert e1["repeated"]["count"] == 4 and e1["fill"]["repeated"] == 4
    assert e1["resume_exact"] and e1["order_equal"] is True
    (restart,) = resume["restarts"]
    # skip_first_batches counts batches of the new size: 3 x 3 x 4 = 36 slots for 24 received
    assert "3 x 3 rank(s) x 4 = 36 sample slot(s), where the run had received 24" \
        in restart["reason"]
    assert restart["skipped"]["ids"] == e0["skipped"]["ids"]
    assert resume["world_sizes"] == [2, 3]


def test_a_save_after_the_epochs_last_step_resumes_at_the_next_epoch():
    """A save at the epoch's end: saved inside the loop after epoch 0's last step (0:last, step 10 on
    2 ranks by hand), resumed as accelerate's examples do: the next epoch, skip 0. Nothing of
    epoch 0 comes again and epoch 1 is not skipped; a fresh loader's first pass is epoch 0's
    order again (accelerate's own loader, built again in this process), which the report says."""
    proc, report = resume_audit("seeded_80", "--resume-at", "0:last")
    resume = report["modes"]["audit"]["resume"]
    (restart,) = resume["restarts"]
    assert (restart["epoch"], restart["step"], restart["last"]) == (0, 10, True)
    assert restart["resumed_at"] == {"epoch": 1, "step": 0}
    e0, e1, e2 = resume["epochs"]
    assert e0["resume_exact"] and e0["seen"] == 80
    fresh = [ids_of(library_loader(80, 4, 2, r)) for r in range(2)]
    ref = uninterrupted(80, 4, 2, 2)
    assert [r["batches"] for r in e1["ranks"]] == fresh != ref[1]
    assert e1["seen"] == 80 and e1["whole"] is None
    assert e1["repeated"]["count"] == e1["skipped"]["count"] == 0
    assert e1["order_equal"] is False
    assert "counts its epochs from 0" in resume["explanation"]


@pytest.mark.parametrize("sizes,message", [
    # seeded_40 on 2 ranks: 10 batches of 4, 5 steps per rank (by hand)
    ("2,2", "0:99: an epoch of this loader has 5 steps per rank on 2 rank(s)"),
    # resumed on 3 ranks: accelerate's even_batches deals ceil(10 / 3) = 4 steps per rank
    ("3,3", "0:99: an epoch of this loader has 4 steps per rank on 3 rank(s)"),
])
def test_a_later_stop_past_its_epochs_end_is_one_error_line_before_any_restart(
        tmp_path, sizes, message):
    """A stop after the first, past the end of its epoch on the world size of the launch that
    reaches it: known once the first launch and the uninterrupted runs have walked (the epoch's
    steps on each size), said then, before any restart's ranks start: the factory is called by
    the first launch and the uninterrupted runs alone (one line per rank per launch, its
    world size), and no report is written."""
    from support.launch import launch_env

    env = launch_env()
    env["SHARDDEMO_TEST_COUNTER_DIR"] = str(tmp_path)
    out = tmp_path / "report.json"
    proc = sharddemo(["audit", f"{FACTORIES}:counts_its_launches_40", "--resume-at", "0:2,0:99",
                      "--resume-num-processes", sizes, "--format", "json", "--output", str(out)],
                     check=False, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines
    calls = sorted((tmp_path / "launches").read_text().split())
    # the stopping launch and the uninterrupted run on 2 ranks, and on 3 where a restart is
    expected = ["2"] * 4 + (["3"] * 3 if sizes == "3,3" else [])
    assert calls == expected and not out.exists()
