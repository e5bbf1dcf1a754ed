"""sharddemo.watch inside a training loop, in one process: batches untouched, everything a
loader does still works, arguments checked, messages read calmly. Expected values come from
torch's and accelerate's own objects built in this process (prepare_data_loader,
skip_first_batches, DistributedSampler), or from literals worked out by hand. On real ranks:
tests/ranks/test_watch.py."""

from __future__ import annotations

import pickle

import pytest
import torch
from support.reports import entries
from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset, Subset,
                              TensorDataset)

from sharddemo import ShardingViolation, watch


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
    (the mistakes users make: a list, a generator, accelerator="cpu", id_field=5.0, a report
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


# -- resume through accelerate's own checkpoint (save_state / load_state) ----------------------


@pytest.mark.parametrize("workers,batch_sampler", [(0, False), (2, False), (0, True),
                                                    (2, True)])
def test_a_stateful_loader_saves_and_resumes_as_it_did_unwatched(tmp_path, workers,
                                                                 batch_sampler):
    """torchdata's StatefulDataLoader: its state_dict after 2 batches, given to a new loader,
    resumes the epoch; watched or not, the same batches come (the library's own answer: the
    unwatched loader), and the watch counts what came, the 2 batches before the save (its
    state rode in the loader's) and the resumed pass's ids, not the ones
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
            earlier = [i for b in before for i in b]
            # the watch's state rode in the first loader's state_dict(): the resumed pass is
            # the rest of the epoch the first one began (docs/resume.md, "A loader that keeps
            # its own state")
            assert entry["seen"] == len(earlier) + sum(map(len, after))
            assert entry["resume"]["seen_before"] == len(earlier)
            assert entry["resume"]["repeated"]["count"] == len(set(earlier) & delivered)
            assert entry["resume"]["skipped"]["ids"] == sorted(set(range(20)) - delivered
                                                               - set(earlier))
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


def test_an_id_field_of_fractions_is_refused_without_offering_keys():
    """The watch refuses keys (str, bytes) in id_field (docs/watch.md), so its refusal of a
    field of fractions names integers only; `audit --id-field`, which takes keys, names both (a
    new user's trial read the watch's message as an offer of keys)."""
    from torch.utils.data import DataLoader

    from sharddemo import watch
    from sharddemo.rank.ids import integer_ids

    rows = [{"id": i + 0.5, "x": float(i)} for i in range(4)]
    with pytest.raises(ValueError) as raised:
        for _ in watch(DataLoader(rows, batch_size=2), id_field="id"):
            pass
    said = str(raised.value)
    assert "must hold each sample's id: an integer 0..N-1 (it holds torch.float64 values that " \
           "are not whole numbers)" in said and "key" not in said
    with pytest.raises(Exception) as audit_said:
        integer_ids(torch.tensor([0.5]), "--id-field 'id'")
    assert "an integer 0..N-1 or a key (str, bytes)" in str(audit_said.value)
