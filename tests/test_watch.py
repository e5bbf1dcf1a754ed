"""sharddemo.watch inside a training loop: in one process (batches untouched, everything a
loader does still works), then on real gloo ranks running examples/watch_accelerate.py, a plain
accelerate loop, with each pitfall caught live. Expected values come from torch's and
accelerate's own objects built in this process for each rank (prepare_data_loader,
skip_first_batches, DistributedSampler), or from literals worked out by hand."""

from __future__ import annotations

import json
import pickle
import sys

import pytest
import torch
from conftest import ROOT, accelerate_launch, ended_or_aborted_at_teardown
from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset, Subset,
                              TensorDataset)

from sharddemo import ShardingViolation, watch

EXAMPLE = "examples/watch_accelerate.py"


WATCH_SCHEMA = json.loads((ROOT / "docs" / "watch.schema.json").read_text())


def entries(path) -> list[dict]:
    """The report file's lines, each validated against docs/watch.schema.json."""
    import jsonschema

    out = [json.loads(line) for line in path.read_text().splitlines()]
    for entry in out:
        jsonschema.validate(entry, WATCH_SCHEMA)
    return out


# -- one process --------------------------------------------------------------------------------

def test_batches_len_and_set_epoch_are_untouched(tmp_path, capsys):
    """10 samples, batches of 4, one process: 3 steps, every sample once (by hand)."""
    data = TensorDataset(torch.arange(10))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    plain_sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    watched = watch(DataLoader(data, batch_size=4, sampler=sampler),
                    report=str(tmp_path / "w.jsonl"))
    plain = DataLoader(data, batch_size=4, sampler=plain_sampler)
    assert isinstance(watched, DataLoader) and len(watched) == 3
    for epoch in range(2):
        watched.sampler.set_epoch(epoch)
        plain_sampler.set_epoch(epoch)
        got = [b[0].tolist() for b in watched]
        assert got == [b[0].tolist() for b in plain]  # the same batches, as the loader made them
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sharddemo")]
    assert lines == ["sharddemo: epoch 0 train: 10 of 10 samples once across 1 rank, 3 steps "
                     "each, order changed: -: ok",
                     "sharddemo: epoch 1 train: 10 of 10 samples once across 1 rank, 3 steps "
                     "each, order changed: yes: ok"]
    got = entries(tmp_path / "w.jsonl")
    assert [(e["epoch"], e["seen"], e["unique"], e["steps"], e["ok"]) for e in got] == [
        (0, 10, 10, [3], True), (1, 10, 10, [3], True)]
    assert got[0]["schema"] == "sharddemo.watch/1" and got[0]["missing"]["count"] == 0
    # a tapped sampler still pickles as the plain one (accelerate's save_state pickles some)
    assert type(pickle.loads(pickle.dumps(watched.sampler))) is DistributedSampler


def test_workers_a_subset_and_an_id_field(tmp_path):
    report = tmp_path / "w.jsonl"
    data = TensorDataset(torch.arange(12))
    with_workers = watch(DataLoader(data, batch_size=5, num_workers=2), name="workers",
                         report=str(report))
    assert [b[0].tolist() for b in with_workers] == [list(range(5)), list(range(5, 10)),
                                                      [10, 11]]
    part = watch(DataLoader(Subset(data, [11, 3, 7]), batch_size=2), name="part",
                 report=str(report))
    assert [b[0].tolist() for b in part] == [[11, 3], [7]]

    class Stream(IterableDataset):
        def __iter__(self):
            return iter({"id": i} for i in (0, 1, 1, 2))

    stream = watch(DataLoader(Stream(), batch_size=2), name="stream", id_field="id",
                   report=str(report))
    assert [b["id"].tolist() for b in stream] == [[0, 1], [1, 2]]
    got = {e["loader"]: e for e in entries(report)}
    assert (got["workers"]["seen"], got["workers"]["steps"], got["workers"]["ok"]) == (12, [3],
                                                                                      True)
    # the Subset's positions are the root dataset's ids 11, 3, 7: 3 of the part of 3
    assert (got["part"]["unique"], got["part"]["deals"], got["part"]["ok"]) == (3, 3, True)
    assert got["stream"]["duplicated"]["ids"] == [1] and not got["stream"]["ok"]


def test_a_step_never_reads_ids_on_a_device_back_to_the_host(monkeypatch):
    """Ids that live on a device are counted there: a step queues work and never waits for
    it. Shown here without a GPU on torch's meta device, whose tensors hold no data, so that
    any read of a value on the host (.item(), .tolist(), .cpu(), int(), a branch on a
    value) raises at once: 40 steps of batches of 16 on 'meta', counted in flushes of 64 ids
    (10 flushes), raise nothing. The epoch's end reads the counter once (not reached here:
    the loop stops first)."""
    from torch.utils.data import default_collate

    from sharddemo.rank import counting

    monkeypatch.setattr(counting, "FLUSH_IDS", 64)
    data = TensorDataset(torch.arange(1000))
    loader = watch(DataLoader(data, batch_size=16,
                              collate_fn=lambda items: [t.to("meta")
                                                        for t in default_collate(items)]),
                   report=None, id_field=0)
    for step, (ids,) in enumerate(loader):
        assert ids.device.type == "meta"
        if step == 39:
            break
    log = loader.__dict__["_sharddemo_watch"].recorder.log
    assert log.steps == 40 and log.samples == 640
    assert type(log.state) is counting._DeviceRunning and log.state.device.type == "meta"
    with pytest.raises(NotImplementedError, match="meta"):
        log.state.to_host(log.counts)  # the end's read: what the steps never do


def test_bad_arguments_say_what_to_do():
    data = TensorDataset(torch.arange(4))
    with pytest.raises(ValueError, match="on_violation must be one of warn, raise, ignore"):
        watch(DataLoader(data), on_violation="explode")

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ValueError, match="pass id_field="):
        watch(DataLoader(Stream()))

    class Keyed(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"key": f"k{i}"}

    with pytest.raises(ValueError, match="holds keys"):
        next(iter(watch(DataLoader(Keyed(), batch_size=2), report=None, id_field="key")))


def test_raise_in_one_process(tmp_path):
    data = TensorDataset(torch.arange(6))

    class Twice(torch.utils.data.Sampler):
        def __iter__(self):
            return iter([0, 1, 2, 0, 1, 2])

        def __len__(self):
            return 6

    loader = watch(DataLoader(data, batch_size=3, sampler=Twice()), report=None,
                   on_violation="raise")
    with pytest.raises(ShardingViolation, match="FAIL no-missing-samples") as caught:
        list(loader)
    assert caught.value.entry["missing"]["ids"] == [3, 4, 5]


# -- real ranks -------------------------------------------------------------------------------

def library_batches(world: int, pitfall: str, epoch: int) -> list[list[int]]:
    """Every rank's ids of `epoch` for the example's loader (N=40, batch 4), from torch's and
    accelerate's own objects in this process."""
    from accelerate.data_loader import prepare_data_loader, skip_first_batches
    from oracle import ensure_accelerator_state

    from oracle import ACCELERATOR_RNG_TYPES

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
    ("skip", 2, 0)])
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
    # a stop mid-epoch reports the part before it (partial; tests/test_watch_stop.py)
    assert [e["epoch"] for e in got if e.get("partial")] == ([0] if stop_args[-1] != "0"
                                                             else [])
    return [e for e in got if not e.get("partial")]


def test_a_seeded_resume_mid_epoch_is_exact(tmp_path):
    got = stop_and_resume(tmp_path, "--save-at", "3")
    resumed = got[0]
    # 3 steps x 2 ranks x batch 4 = 24 delivered before the stop (by hand); accelerate's
    # skip_first_batches over the same seeded order delivers the other 16 (test_resume.py's
    # library_resume shows the same with accelerate's objects)
    assert resumed["resume"]["seen_before"] == 24 and resumed["steps"] == [2, 2]
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
    assert "counts its epochs from 0" in failed["order-changes-each-epoch"]
    assert got[2]["order_changed"] is True and got[2]["ok"]


@pytest.mark.parametrize("workers,batch_sampler", [(0, False), (2, False), (0, True),
                                                    (2, True)])
def test_a_stateful_loader_saves_and_resumes_as_it_did_unwatched(tmp_path, workers,
                                                                 batch_sampler):
    """torchdata's StatefulDataLoader: its state_dict after 2 batches, given to a new loader,
    resumes the epoch; watched or not, the same batches come (the library's own answer: the
    unwatched loader), and the watch counts what came: the resumed pass's ids, not the ones
    torchdata draws and throws away to fast-forward a sampler without a state of its own
    (Plain), nor the first epoch of an iterator state_dict() built before the watch."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    data = TensorDataset(torch.arange(20))

    class Plain(torch.utils.data.Sampler):  # a batch sampler whose iterator keeps no state
        def __iter__(self):
            return iter([[0, 5, 9], [1, 2, 3], [4, 6, 7], [8, 10, 11]])

        def __len__(self):
            return 4

    def run(watched: bool):
        def make():
            if batch_sampler:
                made = stateful.StatefulDataLoader(data, batch_sampler=Plain(),
                                                   num_workers=workers)
            else:
                made = stateful.StatefulDataLoader(data, batch_size=3, shuffle=True,
                                                   num_workers=workers,
                                                   generator=torch.Generator().manual_seed(4))
            return watch(made, report=None, name=f"w{workers}") if watched else made

        first = make()
        walk = iter(first)
        before = [next(walk)[0].tolist() for _ in range(2)]
        state = first.state_dict()
        again = make()
        again.load_state_dict(state)
        after = [b[0].tolist() for b in again]
        if watched:
            entry = again.__dict__["_sharddemo_watch"].entries[-1]
            delivered = {i for b in after for i in b}
            assert entry["seen"] == sum(map(len, after))
            assert entry["missing"]["ids"] == sorted(set(range(20)) - delivered)
            assert "unattributed_batches" not in entry
            # a loader whose first iterator state_dict() built before the watch
            early = stateful.StatefulDataLoader(data, batch_size=3, num_workers=workers)
            early.state_dict()
            early = watch(early, report=None, name="early")
            assert [i for b in early for i in b[0].tolist()] == list(range(20))
            got = early.__dict__["_sharddemo_watch"].entries[-1]
            assert (got["seen"], got["unique"], got["ok"]) == (20, 20, True)
        return before, after

    assert run(watched=True) == run(watched=False)


# -- what the watch costs the run: collectives ------------------------------------------------

LOOP = "tests/watch_loop.py"


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


def test_a_window_costs_one_collective_at_the_step_after_it():
    """check_every=2 over 5 steps a rank (N = 40, batch 4, 2 ranks): a window is checked as
    batches 3 and 5 arrive (steps 1-2, 3-4; the last batch is never in a window): one
    collective each, none at the other steps."""
    runs = collectives_of("--check-every", "2")
    for plain, watched in zip(runs["plain"], runs["watched"]):
        assert [w - p for w, p in zip(watched["steps"], plain["steps"])] == [0, 0, 1, 0, 1]
        assert watched["total"] == plain["total"] + 2 + 2


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
    assert resume["seen_before"] == len(before) and got[0]["steps"] == [2, 2]
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
    from conftest import free_port, run_cmd

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
