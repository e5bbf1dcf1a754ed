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

    monkeypatch.setattr(counting.counters, "FLUSH_IDS", 64)
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
    assert type(log.state) is counting.DeviceRunning and log.state.device.type == "meta"
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


def test_arguments_are_checked_when_watch_is_called(tmp_path):
    """Each mistake stops watch() itself with one error naming the argument, before any step
    (the issue's reproductions: a list, a generator, accelerator="cpu", id_field=5.0, a report
    folder that does not exist)."""
    data = TensorDataset(torch.arange(4))
    for loader in ([1, 2], (b for b in [1, 2]), 7, data):
        with pytest.raises(TypeError, match="loader must be a torch.utils.data.DataLoader"):
            watch(loader, report=None)
    for accelerator in ("cpu", ["cpu"], (a for a in [1])):
        with pytest.raises(TypeError, match="accelerator must be your accelerate.Accelerator"):
            watch(DataLoader(data), accelerator, report=None)
    for field in (["x"], 0.5, True):
        with pytest.raises(TypeError, match="id_field must be a str .* or an int"):
            watch(DataLoader(data), report=None, id_field=field)
    with pytest.raises(TypeError, match="report must be a file path"):
        watch(DataLoader(data), report=5)
    with pytest.raises(ValueError, match="is a folder; give a file path"):
        watch(DataLoader(data), report=str(tmp_path))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="its folder cannot be made"):
        watch(DataLoader(data), report=str(tmp_path / "a-file" / "w.jsonl"))
    # a folder that does not exist yet is made at watch(), so the epoch's end can write there
    report = tmp_path / "new" / "deeper" / "w.jsonl"
    loader = watch(DataLoader(data, batch_size=2), report=str(report))
    assert report.parent.is_dir()
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3]]
    assert [e["seen"] for e in entries(report)] == [4]


def test_a_report_path_is_refused_on_every_rank_and_made_by_the_main_one(tmp_path, monkeypatch):
    """A rank other than the main one (torchrun's RANK=1, no process group yet) stops at watch()
    with the main process's error for a report under a file (before, it trained on and died in
    gloo when rank 0 stopped), and makes no folder: the main process does that."""
    monkeypatch.setenv("RANK", "1")
    data = TensorDataset(torch.arange(4))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"its folder cannot be made \(Not a directory\)"):
        watch(DataLoader(data), report=str(tmp_path / "a-file" / "deeper" / "w.jsonl"))
    with pytest.raises(ValueError, match="is a folder; give a file path"):
        watch(DataLoader(data), report=str(tmp_path))
    watch(DataLoader(data), report=str(tmp_path / "new" / "w.jsonl"))
    assert not (tmp_path / "new").exists()
    monkeypatch.setenv("RANK", "0")  # the main process: the same message from os.makedirs
    with pytest.raises(ValueError, match=r"its folder cannot be made \(Not a directory\)"):
        watch(DataLoader(data), report=str(tmp_path / "a-file" / "deeper" / "w.jsonl"))


def test_a_process_alone_where_the_launcher_asked_for_more_is_warned(monkeypatch):
    """The CPU trap: the launcher started 2 processes (WORLD_SIZE=2) but the Accelerator has a
    world of 1 (Accelerator() without cpu=True on a machine without GPUs): each process trains
    on the whole dataset alone, and its watch would see one rank. Here: an Accelerator of this
    one process, then the launcher's WORLD_SIZE."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    try:
        accelerator = Accelerator(cpu=True)
        assert accelerator.num_processes == 1
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.warns(RuntimeWarning, match="launched for 2 processes .WORLD_SIZE. but this "
                                                "accelerator has 1: this process is alone"):
            watch(DataLoader(TensorDataset(torch.arange(4))), accelerator, report=None)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()


def test_an_id_field_missing_from_the_batch_names_the_fields_it_has():
    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": float(i), "y": i}

    with pytest.raises(ValueError, match="id_field 'nope': the batches \\(dict\\) have no field "
                                         "'nope'; they have 'x', 'y'"):
        next(iter(watch(DataLoader(Rows(), batch_size=2), report=None, id_field="nope")))
    # TensorDataset's batches are lists of one tensor: position 0 only
    data = TensorDataset(torch.arange(4))
    with pytest.raises(ValueError, match=r"id_field 5: the batches \(list of 1\) have no "
                                         r"position 5; they have positions 0..0"):
        next(iter(watch(DataLoader(data, batch_size=2), report=None, id_field=5)))


@pytest.mark.parametrize("on_violation", ["warn", "raise"])
def test_an_error_in_the_watchs_own_reporting_does_not_stop_the_training(tmp_path,
                                                                       on_violation):
    """The report's folder disappears after watch() (a file takes its place): the epoch's end
    cannot write its entry. With "warn" that is a warning and every step still runs (2 epochs
    of 2 steps, by hand); with "raise" the error stops the loop, as asked."""
    folder = tmp_path / "reports"
    loader = watch(DataLoader(TensorDataset(torch.arange(4)), batch_size=2),
                   report=str(folder / "w.jsonl"), on_violation=on_violation)
    folder.rmdir()
    folder.write_text("not a folder any more")
    steps = 0
    if on_violation == "raise":
        with pytest.raises(OSError):
            for _ in loader:
                steps += 1
        assert steps == 2
        return
    with pytest.warns(RuntimeWarning, match=r"epoch \d train: the watch could not report "
                                            ".*training goes on") as said:
        for _ in range(2):
            for _ in loader:
                steps += 1
    assert steps == 4 and "epoch 0 train" in str(said[0].message)


def test_ignore_prints_nothing(tmp_path, capsys):
    report = tmp_path / "w.jsonl"
    data = TensorDataset(torch.arange(6))

    class Twice(torch.utils.data.Sampler):  # 0, 1, 2 twice: 3, 4, 5 never (a FAIL)
        def __iter__(self):
            return iter([0, 1, 2, 0, 1, 2])

        def __len__(self):
            return 6

    loader = watch(DataLoader(data, batch_size=3, sampler=Twice()), report=str(report),
                   on_violation="ignore")
    assert len(list(loader)) == 2
    assert capsys.readouterr().out == ""  # the file only
    assert [e["missing"]["ids"] for e in entries(report)] == [[3, 4, 5]]


def test_ok_lines_read_calmly_with_plurals(tmp_path, capsys):
    """A sampler that draws with replacement repeats samples by design: the ok line says
    "and K again (the sampler's own draw)", not an alarm; one sample, one step: singular
    words; an order that did not change where nothing shuffles: "no", not "NO". Expected from
    the ids the loop itself received."""
    data = TensorDataset(torch.arange(6))
    sampler = torch.utils.data.RandomSampler(data, replacement=True, num_samples=6,
                                             generator=torch.Generator().manual_seed(1))
    loader = watch(DataLoader(data, batch_size=3, sampler=sampler), report=None)
    got = [i for b in loader for i in b[0].tolist()]
    unique = len(set(got))
    assert unique < len(got)  # (seed 1 draws some sample twice)
    one = watch(DataLoader(TensorDataset(torch.arange(1)), batch_size=1), report=None,
                name="one")
    for _ in range(2):
        list(one)
    lines = [line for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        f"sharddemo: epoch 0 train: {unique} of 6 samples and {len(got) - unique} again "
        "(the sampler's own draw) across 1 rank, 2 steps each, order changed: -: ok",
        "sharddemo: epoch 0 one: 1 of 1 sample once across 1 rank, 1 step each, order "
        "changed: -: ok",
        "sharddemo: epoch 1 one: 1 of 1 sample once across 1 rank, 1 step each, order "
        "changed: no: ok"]


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
    window decides the next's length)."""
    runs = collectives_of("--n", "3000000", "--batch", "6000", "--check-every", "auto")
    for plain, watched in zip(runs["plain"], runs["watched"]):
        extra = [w - p for w, p in zip(watched["steps"], plain["steps"])]
        assert len(extra) == 250
        assert [k + 1 for k, more in enumerate(extra) if more] == [51, 138, 225]
        assert watched["total"] == plain["total"] + 3 + 2


def test_check_every_is_auto_a_number_of_steps_or_none():
    """One error line naming the argument, at watch()."""
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    with pytest.raises(ValueError, match=r"^sharddemo.watch: check_every must be 'auto' \(the "
                       r"default: windows that grow\), a number of steps \(0: no windows\) or "
                       r"None, got 'often'$"):
        watch(loader, report=None, check_every="often")
    with pytest.raises(ValueError, match=r"^sharddemo.watch: check_every must be 'auto', a "
                       r"number of steps \(0: no windows\) or None, got -1$"):
        watch(loader, report=None, check_every=-1)
    for fine in ("auto", 0, None, 7):
        watch(DataLoader(TensorDataset(torch.arange(8)), batch_size=2), report=None,
              check_every=fine)


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

    from conftest import CPU_CONFIG, OUTER_TIMEOUT, free_port, launch_env

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


@pytest.mark.parametrize("workers", [0, 2])
def test_a_watched_loader_draws_its_order_when_iter_is_called_as_torchs_does(workers):
    """A torch DataLoader with workers draws its sampler's order at iter(): a set_epoch
    between iter() and the first batch does not reach that pass (the late set_epoch
    of Lightning's issue #21938, after a resume with workers). The watched loader yields what
    the same loader unwatched yields, so the watch neither changes the training nor hides that
    bug (before, its lazy __iter__ drew the order at the first batch: epoch 1's)."""
    def make():
        sampler = DistributedSampler(TensorDataset(torch.arange(16)), num_replicas=2, rank=0,
                                     shuffle=True, seed=0)
        return sampler, DataLoader(sampler.dataset, batch_size=2, sampler=sampler,
                                   num_workers=workers)

    def late_set_epoch(sampler, loader):
        sampler.set_epoch(0)
        batches = iter(loader)
        sampler.set_epoch(1)  # after iter(): torch's pass keeps epoch 0's order
        return [b[0].tolist() for b in batches]

    plain = late_set_epoch(*make())
    sampler, loader = make()
    assert late_set_epoch(sampler, watch(loader, report=None)) == plain
    # torch itself: with workers the order is drawn at iter() (the workers are handed their
    # first indices then): epoch 0's; without, at the first batch (BatchSampler is a generator)
    drawn = DistributedSampler(range(16), num_replicas=2, rank=0, seed=0)
    drawn.set_epoch(0 if workers else 1)
    assert [i for b in plain for i in b] == list(drawn)
