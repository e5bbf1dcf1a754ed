"""sharddemo.watch on real gloo ranks running examples/watch_accelerate.py (a plain accelerate
loop) and tests/scripts/watch_loop.py, with each pitfall caught live. Expected values come from
torch's and accelerate's own objects built in this process for each rank (prepare_data_loader,
skip_first_batches, DistributedSampler), or from literals worked out by hand."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from support.launch import ROOT, accelerate_launch, ended_or_aborted_at_teardown
from support.reports import entries
from torch.utils.data import (DataLoader, DistributedSampler, TensorDataset)


EXAMPLE = "examples/watch_accelerate.py"


# -- one process, started as a subprocess -----------------------------------------------------


def test_every_entry_names_its_run(tmp_path):
    """Two runs of the same script append to one report: each entry carries its run's id and
    start, the same within a run (2 epochs of 2 loaders) and different between the runs."""
    import datetime
    import subprocess

    report = tmp_path / "w.jsonl"
    script = ("import torch\n"
              "from torch.utils.data import DataLoader, TensorDataset\n"
              "from sharddemo import watch\n"
              "data = TensorDataset(torch.arange(4))\n"
              f"a = watch(DataLoader(data, batch_size=2), report={str(report)!r}, name='a')\n"
              f"b = watch(DataLoader(data, batch_size=4), report={str(report)!r}, name='b')\n"
              "for epoch in range(2):\n"
              "    list(a); list(b)\n")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                       timeout=120)
    got = entries(report)
    assert [(e["loader"], e["epoch"]) for e in got] == [("a", 0), ("b", 0), ("a", 1),
                                                         ("b", 1)] * 2
    runs = [{(e["run_id"], e["run_started"]) for e in got[:4]},
            {(e["run_id"], e["run_started"]) for e in got[4:]}]
    assert len(runs[0]) == len(runs[1]) == 1 and runs[0] != runs[1]
    started = [datetime.datetime.fromisoformat(e["run_started"]) for e in (got[0], got[4])]
    assert all(s.utcoffset() == datetime.timedelta(0) for s in started)
    assert started[0] <= started[1]


# -- real ranks -------------------------------------------------------------------------------

def library_batches(world: int, pitfall: str, epoch: int) -> list[list[int]]:
    """Every rank's ids of `epoch` for the example's loader (N=40, batch 4), from torch's and
    accelerate's own objects in this process."""
    from accelerate.data_loader import prepare_data_loader, skip_first_batches
    from support.oracle import ensure_accelerator_state

    from support.oracle import ACCELERATOR_RNG_TYPES

    data = TensorDataset(torch.arange(40))
    out = []
    for rank in range(world):
        torch.manual_seed(0)  # every rank's process is seeded alike (the example's manual_seed)
        if pitfall == "replicated":
            loader = DataLoader(data, batch_size=4, shuffle=True)
        elif pitfall == "no-set-epoch":
            sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
            loader = DataLoader(data, batch_size=4, sampler=sampler)  # set_epoch never called
        else:
            ensure_accelerator_state()
            loader = prepare_data_loader(DataLoader(data, batch_size=4, shuffle=True),
                                         num_processes=world, process_index=rank,
                                         put_on_device=False,
                                         rng_types=list(ACCELERATOR_RNG_TYPES))
            if pitfall == "skip" and epoch == 0:
                loader = skip_first_batches(loader, 3)
        out.append([i for batch in loader for i in batch[0].tolist()])
    return out


@pytest.mark.parametrize("pitfall,world,workers", [
    ("none", 2, 0), ("none", 3, 2), ("replicated", 2, 0), ("no-set-epoch", 2, 0),
    ("no-set-epoch", 3, 0), ("skip", 2, 0)])
def test_a_plain_accelerate_loop_is_checked_as_it_trains(tmp_path, pitfall, world, workers):
    report = tmp_path / "w.jsonl"
    proc = accelerate_launch([EXAMPLE, "--pitfall", pitfall, "--report", str(report),
                              "--workers", str(workers)], nproc=world, check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    got = entries(report)
    assert [e["epoch"] for e in got] == [0, 1]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("sharddemo:")]
    assert len(lines) == 2  # the main process alone speaks, once per epoch
    for e, line in zip(got, lines):
        ranks = library_batches(world, pitfall, e["epoch"])
        ids = [i for mine in ranks for i in mine]
        assert (e["seen"], e["unique"], e["world_size"]) == (len(ids), len(set(ids)), world)
        assert e["missing"]["count"] == 40 - len(set(ids))
        assert line.endswith(": ok") == e["ok"]
    failed = [{v["verdict"] for v in e["verdicts"] if not v["ok"]} for e in got]
    if pitfall == "none":
        assert failed == [set(), set()] and got[1]["order_changed"] is True
    elif pitfall == "replicated":
        assert all("no-silent-replication" in f for f in failed)
        assert "replication" in lines[0]
    elif pitfall == "no-set-epoch":
        # torch's own sampler deals the same order twice without set_epoch
        assert library_batches(world, pitfall, 0) == library_batches(world, pitfall, 1)
        assert failed == [set(), {"order-changes-each-epoch"}]
        assert got[1]["order_changed"] is False and "set_epoch is never called" in lines[1]
        ids = [i for mine in library_batches(world, pitfall, 1) for i in mine]
        padded = len(ids) - len(set(ids))  # torch's padding: 40 on 3 ranks deals 42, 2 again
        # the padding is named as what it is, never beside the order's FAIL it does not explain
        head, fail = lines[1].split(": FAIL ")
        assert "padding" not in fail
        assert (f"and {padded} again (DistributedSampler padding)" in head) is (padded > 0)
    elif pitfall == "skip":
        # what reached the loop: 2 of 5 steps per rank after skipping 3 (not what was skipped)
        assert got[0]["steps"] == [2, 2] and failed[0] == {"no-missing-samples"}
        assert failed[1] == set()


def test_raise_stops_every_rank_at_the_same_point(tmp_path):
    report = tmp_path / "w.jsonl"
    proc = accelerate_launch([EXAMPLE, "--pitfall", "replicated", "--report", str(report),
                              "--on-violation", "raise"], check=False)
    assert proc.returncode != 0
    # both ranks raised at the end of epoch 0 (neither was left waiting in a collective)
    assert proc.stderr.count("ShardingViolation: sharddemo: epoch 0 train") == 2, proc.stderr
    assert [e["epoch"] for e in entries(report)] == [0]


# -- resume through accelerate's own checkpoint (save_state / load_state) ----------------------

def stop_and_resume(tmp_path, *stop_args, resume_args=(), unseeded=False):
    """The example stops and saves (launch 1), then loads and trains on (launch 2)."""
    report, checkpoint = tmp_path / "w.jsonl", tmp_path / "ckpt"
    common = [EXAMPLE, "--report", str(report), *(["--unseeded"] if unseeded else [])]
    for args in ([*stop_args, "--checkpoint", str(checkpoint)],
                 ["--resume-from", str(checkpoint), *resume_args]):
        proc = accelerate_launch([*common, *args], check=False)
        assert ended_or_aborted_at_teardown(proc), proc.stderr
    got = entries(report)
    # a stop mid-epoch reports the part before it (partial; tests/ranks/test_watch_stop.py)
    assert [e["epoch"] for e in got if e.get("partial")] == ([0] if stop_args[-1] != "0"
                                                             else [])
    return [e for e in got if not e.get("partial")]


def test_a_seeded_resume_mid_epoch_is_exact(tmp_path):
    got = stop_and_resume(tmp_path, "--save-at", "3")
    resumed = got[0]
    # 3 steps x 2 ranks x batch 4 = 24 delivered before the stop (by hand); accelerate's
    # skip_first_batches over the same seeded order delivers the other 16 (test_resume.py's
    # library_resume shows the same with accelerate's objects)
    assert resumed["resume"]["seen_before"] == 24 and resumed["steps"] == [5, 5]  # 3 + 2
    assert resumed["resume"]["steps_after"] == [2, 2]
    assert resumed["resume"]["repeated"]["count"] == resumed["resume"]["skipped"]["count"] == 0
    assert resumed["ok"] and resumed["seen"] == 40
    assert [e["epoch"] for e in got] == [0, 1]  # the stopped launch ended no epoch


def test_an_unseeded_resume_repeats_as_many_as_it_skips(tmp_path):
    got = stop_and_resume(tmp_path, "--save-at", "3", unseeded=True)
    resume = got[0]["resume"]
    # 24 before the stop and 16 after make 40 deliveries of 40 samples: every sample delivered
    # twice leaves one never delivered (by hand). A new permutation after the restart makes
    # some (FACTS: 8 of 40 in one run)
    assert resume["seen_before"] == 24
    assert resume["repeated"]["count"] == resume["skipped"]["count"] > 0
    assert not got[0]["ok"] and "resume-exact" in {v["verdict"] for v in got[0]["verdicts"]
                                                   if not v["ok"]}


def test_a_resume_at_an_epoch_boundary_that_replays_the_order_is_caught(tmp_path):
    got = stop_and_resume(tmp_path, "--save-at", "0", resume_args=["--epochs", "3"])
    assert [e["epoch"] for e in got] == [0, 1, 2]
    # the restarted prepared loader counts its epochs from 0: epoch 1 walks epoch 0's order
    # (FACTS, checked by hand with the same loader), then epoch 2 a new one
    assert got[1]["order_changed"] is False and not got[1]["ok"]
    failed = {v["verdict"]: v["detail"] for v in got[1]["verdicts"] if not v["ok"]}
    # the mechanism the loader has (a prepared RandomSampler), not a set_epoch it would ignore
    assert ("accelerate's prepared RandomSampler takes no epoch: with set_seed a new launch "
            "deals epoch 0's order again") in failed["order-changes-each-epoch"]
    assert got[2]["order_changed"] is True and got[2]["ok"]


# -- what the watch costs the run: collectives ------------------------------------------------

LOOP = "tests/scripts/watch_loop.py"


def collectives_of(*args, nproc: int = 2) -> dict:
    proc = accelerate_launch([LOOP, "collectives", *args], nproc=nproc, check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("COLLECTIVES "))
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.parametrize("world,how", [(2, "warn"), (3, "raise")])
def test_the_watch_adds_two_collectives_per_epoch_and_none_per_step(world, how):
    """The same prepared loop (N = 40, batch 4) unwatched, then watched, each torch.distributed
    collective counted: the watch adds two at each epoch's end (the exchange every rank at
    its end answers, so that none is left waiting in a window's; then the all-reduce: with
    on_violation="raise" too, every rank judges the record it gave) and none at any step of
    an epoch shorter than a window (5 steps, check_every 50)."""
    runs = collectives_of("--on-violation", how, nproc=world)
    for plain, watched in zip(runs["plain"], runs["watched"]):
        assert watched["steps"] == plain["steps"]
        assert watched["total"] == plain["total"] + 2


@pytest.mark.parametrize("sources,extra", [("index", 0), ("name", 1)])
def test_tokens_and_sources_by_index_ride_in_the_epochs_exchange(sources, extra):
    """tokens= and sources= (N = 40, batch 4, 2 ranks): with sources by index each rank's
    epoch part rides in the exchange every rank at its end answers, so the epoch's end still
    adds two collectives; with sources by name the parts are exchanged as objects, one more."""
    runs = collectives_of("--tokens", sources)
    for plain, watched in zip(runs["plain"], runs["watched"]):
        assert watched["steps"] == plain["steps"]
        assert watched["total"] == plain["total"] + 2 + extra


def test_a_window_costs_one_collective_at_the_step_after_it():
    """check_every=2 over 5 steps a rank (N = 40, batch 4, 2 ranks): a window is checked as
    batches 3 and 5 arrive (steps 1-2, 3-4; the last batch is never in a window): one
    collective each, none at the other steps."""
    runs = collectives_of("--check-every", "2")
    for plain, watched in zip(runs["plain"], runs["watched"]):
        assert [w - p for w, p in zip(watched["steps"], plain["steps"])] == [0, 0, 1, 0, 1]
        assert watched["total"] == plain["total"] + 2 + 2


@pytest.mark.parametrize("world", [2, 3])
def test_the_default_windows_grow_one_collective_each(world):
    """check_every="auto" (the default), 800 steps a rank (N = 800 x world, batch 1, 2 epochs):
    the windows end at steps 50, 150 (50 + 100), 350 (150 + 200) and 750 (350 + 400); the next
    would end at 1550 (750 + 800), past the epoch. Each costs one collective as the batch after
    it arrives (batches 51, 151, 351, 751), on every rank, and each epoch starts the schedule
    again; none at the other steps, two at each epoch's end."""
    runs = collectives_of("--n", str(800 * world), "--batch", "1", "--check-every", "auto",
                          nproc=world)
    for plain, watched in zip(runs["plain"], runs["watched"]):
        extra = [w - p for w, p in zip(watched["steps"], plain["steps"])]
        assert len(extra) == 800
        assert [k + 1 for k, more in enumerate(extra) if more] == [51, 151, 351, 751]
        assert set(extra) == {0, 1}
        assert watched["total"] == plain["total"] + 4 + 2


def test_the_default_windows_of_large_batches_keep_a_bounded_number_of_ids():
    """check_every="auto", batches of 6,000 ids, 250 steps a rank (N = 3,000,000, 2 ranks): a
    rank keeps at most 524,288 ids a window (4 MB) beyond the first. Worked out by hand: the
    first window ends at step 50 (300,000 ids a rank); the next would be 100 steps (600,000
    ids), so it is cut to 524,288 // 6,000 = 87 steps: it ends at 137; the one after would be
    174 steps, cut to 87 again: it ends at 224; the next, at 311, is past the epoch. One
    collective as batches 51, 138 and 225 arrive, on both ranks alike (the exchange of one
    window decides the next's length). At the epoch's end three: the epoch's slots are sized
    for batches of 64 on every rank (never from a rank's own batch size, which ranks may not
    share), so batches of 6,000 outgrow them and every rank joins one ragged gather, as in the
    test below."""
    runs = collectives_of("--n", "3000000", "--batch", "6000", "--check-every", "auto")
    for plain, watched in zip(runs["plain"], runs["watched"]):
        extra = [w - p for w, p in zip(watched["steps"], plain["steps"])]
        assert len(extra) == 250
        assert [k + 1 for k, more in enumerate(extra) if more] == [51, 138, 225]
        assert watched["total"] == plain["total"] + 3 + 3


def test_batches_larger_than_the_slot_cost_one_more_collective():
    """Batches of 4000 where the loader names no batch size (the slot is sized for 64): the
    detail outgrows its slot, and every rank joins one ragged gather: three at each epoch's
    end (with the exchange before the all-reduce), still none per step."""
    runs = collectives_of("--uneven", "--on-violation", "raise")
    for plain, watched in zip(runs["plain"], runs["watched"]):
        assert watched["steps"] == plain["steps"] == [0, 0]
        assert watched["total"] == plain["total"] + 3


def test_a_prepared_stateful_loader_with_workers_resumed_by_load_state_is_caught(tmp_path):
    """use_stateful_dataloader=True, 2 workers, shuffled, unseeded (accelerate issue 4204):
    save_state after 3 steps, a new launch, load_state. The loader goes on at the right step
    but in a new order (FACTS: 10-11 of 40 repeated, as many never seen). Expected: what the
    loop itself received on each rank (the batches the library made), before and after."""
    report, ids = tmp_path / "w.jsonl", tmp_path
    for args in (["--save-at", "3", "--checkpoint", str(tmp_path / "ckpt")],
                 ["--resume-from", str(tmp_path / "ckpt")]):
        proc = accelerate_launch([LOOP, "stateful", "--report", str(report), "--ids", str(ids),
                                  *args], check=False)
        assert ended_or_aborted_at_teardown(proc), proc.stderr

    def received(launch: int, epoch: int) -> list[int]:
        return [i for r in range(2)
                for i in json.loads((ids / f"launch{launch}_rank{r}.json").read_text())[epoch]]

    before, after = set(received(1, 0)), set(received(2, 0))
    got = entries(report)
    [stop] = [e for e in got if e.get("partial")]  # launch 1's part of epoch 0, before the stop
    assert (stop["epoch"], stop["unique"]) == (0, len(before))
    got = [e for e in got if not e.get("partial")]
    assert [e["epoch"] for e in got] == [0, 1]
    resume = got[0]["resume"]
    assert resume["seen_before"] == len(before) and got[0]["steps"] == [5, 5]  # 3 + 2
    assert resume["steps_after"] == [2, 2]
    assert resume["repeated"]["count"] == len(before & after)
    assert resume["repeated"]["ids"] == sorted(before & after)
    assert resume["skipped"]["ids"] == sorted(set(range(40)) - before - after)
    assert got[0]["ok"] == (not before & after and len(before | after) == 40)
    epoch1 = received(2, 1)
    assert (got[1]["seen"], got[1]["unique"]) == (len(epoch1), len(set(epoch1)))


@pytest.mark.parametrize("set_epoch", [True, False])
def test_torchrun_without_accelerate(tmp_path, set_epoch):
    """torch.distributed alone (torchrun; SLURM's srun sets the same process group up):
    watch(loader) with no accelerator on a DistributedSampler's loader, 2 ranks, 2 epochs.
    Expected from torch's own DistributedSampler for each rank and epoch."""
    from support.launch import free_port, run_cmd

    report = tmp_path / "w.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), LOOP, "torch", "--report", str(report),
           *([] if set_epoch else ["--no-set-epoch"])]
    proc = run_cmd(cmd, check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    data = TensorDataset(torch.arange(40))

    def dealt(rank: int, epoch: int) -> list[int]:
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch if set_epoch else 0)
        return list(sampler)

    got = entries(report)
    assert [e["epoch"] for e in got] == [0, 1]
    for e in got:
        ids = dealt(0, e["epoch"]) + dealt(1, e["epoch"])
        assert (e["seen"], e["unique"], e["world_size"]) == (len(ids), len(set(ids)), 2)
    changed = [dealt(r, 0) != dealt(r, 1) for r in range(2)]
    assert got[1]["order_changed"] == any(changed) == set_epoch
    assert got[1]["ok"] == set_epoch


@pytest.mark.parametrize("some,check_every", [(False, 50), (True, 50), (True, 2), (True, 0)])
def test_a_missing_id_field_is_named_on_every_rank_with_no_hang(tmp_path, some, check_every):
    """2 ranks, a prepared loader of dict batches (40 rows, 4 a batch: 5 steps a rank),
    id_field="nope", missing from every rank's batches or (`some`) from rank 1's alone (rank
    0's rows have it): the ranks learn it together at the next exchange, and each rank's loop
    raises the same ValueError there, with the fields rank 1's batches have (the dataset's own
    "x" and "y"); the script then ends cleanly on both: no rank waits in a collective of the
    watch's. The next exchange: the epoch's end with windows of 50 (each loop received its 5
    batches), the window of steps 1-2 with windows of 2 (its exchange starts as batch 3
    arrives and is judged one batch later, as batch 4 arrives: each loop received 3); with
    windows off (0) the epoch's end too (5)."""
    proc = accelerate_launch([LOOP, "bad-field", "--ids", str(tmp_path),
                              "--report", str(tmp_path / "w.jsonl"),
                              "--check-every", str(check_every),
                              *(["--some"] if some else [])], check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    said = [(tmp_path / f"rank{r}.txt").read_text().split("\n") for r in range(2)]
    where = "(on rank 1)" if some else "(on ranks 0, 1)"
    received = "3" if check_every == 2 else "5"
    assert said == [["sharddemo.watch: id_field 'nope': the batches (dict) have no field "
                     f"'nope'; they have 'x', 'y' {where}", received]] * 2
    assert not (tmp_path / "w.jsonl").exists()  # no epoch ended


def test_the_readme_first_screen_watch_runs_as_shown(tmp_path):
    """The README's watch quickstart: its snippet, launched on 2 ranks word for word, prints
    the lines the README shows, and `sharddemo check` passes its report as shown."""
    import subprocess

    from support.launch import CPU_CONFIG, OUTER_TIMEOUT, free_port, launch_env

    readme = (ROOT / "README.md").read_text()
    after = readme.split("3\\. `watch`", 1)[1]
    script, rest = after.split("```python\n", 1)[1].split("```", 1)
    shown = rest.split("```\n", 1)[1].split("```", 1)[0].splitlines()  # the output block
    assert "accelerator.end_training()" in script  # its clean end
    assert "accelerator.free_memory()" in script  # (and DDP's hold on the group dropped)
    (tmp_path / "train.py").write_text(script)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           CPU_CONFIG, "--num_processes", "2", "--main_process_port",
                           str(free_port()), "train.py"], cwd=tmp_path, env=launch_env(),
                          capture_output=True, text=True, timeout=OUTER_TIMEOUT)
    # exit 0, or torch's teardown abort after the last line and the report (docs/watch.md, "A
    # clean end": it came in a CI rehearsal even with the snippet's end_training())
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("sharddemo:")]
    assert lines == [line for line in shown if line.startswith("sharddemo:")]
    gate = subprocess.run([sys.executable, "-m", "sharddemo", "check", "sharddemo-watch.jsonl"],
                          cwd=tmp_path, env=launch_env(), capture_output=True, text=True,
                          timeout=OUTER_TIMEOUT)
    assert gate.returncode == 0 and gate.stdout.splitlines() == [
        line for line in shown if line.startswith("sharddemo check:")], gate.stderr
