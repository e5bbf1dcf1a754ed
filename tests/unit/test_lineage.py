"""watch(..., lineage=DIR) and `sharddemo lineage`, ranks simulated in one process (RANK and
WORLD_SIZE set, as torchrun sets them): which samples each rank's loop received at every step.
Expected values come from torch's DistributedSampler(ds, W, r, seed=s) after set_epoch(e),
sliced by step, from accelerate's prepared loader iterated per rank in this process, or from
the ids the loop itself received, logged here; never from the lineage files read back against
themselves. On real gloo ranks: tests/ranks/test_lineage.py."""

from __future__ import annotations

import json

import pytest
import torch
from support.reports import cli_json, lineage_cli
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from sharddemo import watch
from sharddemo.watching.lineage import flush_all


def sampler_batches(n: int, world: int, rank: int, seed: int, epoch: int,
                    batch: int) -> list[list[int]]:
    """torch's own order for `rank` in `epoch`, sliced into the loop's batches."""
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=seed)
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [order[k:k + batch] for k in range(0, len(order), batch)]


def simulate_run(folder, monkeypatch, n: int, world: int, batch: int, seed: int,
                 epochs: int, workers: int = 0) -> dict:
    """Each rank's watched loop, one after the other in this process; returns the ids each
    loop received, logged from its batches: {rank: [batch, ...]}."""
    received = {}
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        data = TensorDataset(torch.arange(n))
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=seed)
        loader = watch(DataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers),
                       report=None, on_violation="ignore", lineage=str(folder))
        received[rank] = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            received[rank] += [b[0].tolist() for b in loader]
        loader.__dict__["_sharddemo_watch"].lineage.close()
    return received


@pytest.mark.parametrize("world,workers", [(2, 0), (3, 2)])
def test_every_step_of_every_rank_is_the_samplers_batch(tmp_path, monkeypatch, world, workers):
    n, batch, seed, epochs = 23, 4, 5, 2
    folder = tmp_path / "lineage"
    received = simulate_run(folder, monkeypatch, n, world, batch, seed, epochs, workers)
    for rank in range(world):
        expected = [b for epoch in range(epochs)
                    for b in sampler_batches(n, world, rank, seed, epoch, batch)]
        assert received[rank] == expected  # the loop received torch's batches
        per_epoch = len(expected) // epochs
        for step, ids in enumerate(expected):
            got = cli_json(folder, "--step", step, "--rank", rank)["batches"]
            assert got == [{"rank": rank, "epoch": step // per_epoch, "step": step,
                            "ids": ids}]
        # --epoch E: the epoch's K-th batch
        got = cli_json(folder, "--step", 1, "--rank", rank, "--epoch", 1)["batches"]
        assert got[0]["ids"] == sampler_batches(n, world, rank, seed, 1, batch)[1]
    # every rank at one step
    assert [b["rank"] for b in cli_json(folder, "--step", 0)["batches"]] == list(range(world))
    # --id: every (epoch, step, rank) at which torch's samplers dealt the sample
    for sample in (0, 7, 22):
        expected = []
        for epoch in range(epochs):
            for rank in range(world):
                for k, ids in enumerate(sampler_batches(n, world, rank, seed, epoch, batch)):
                    step = epoch * len(sampler_batches(n, world, rank, seed, 0, batch)) + k
                    expected += [{"epoch": epoch, "step": step, "rank": rank}] * (sample in ids)
        expected.sort(key=lambda hit: (hit["step"], hit["rank"]))
        assert cli_json(folder, "--id", sample)["received"] == expected


def test_ids_packed_to_the_bits_the_chunk_needs(tmp_path, monkeypatch):
    """One chunk for the loop's 3 batches (written at the exit): a 32-byte header, then the
    sizes and the ids packed to the bits they need; a batch of consecutive ids is its first id."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    order = [9, 2, 7, 0, 5, 1, 8, 3, 6, 4]
    loader = watch(DataLoader(TensorDataset(torch.arange(10)), batch_size=4, sampler=order),
                   report=None, lineage=str(tmp_path / "shuffled"))
    assert [b[0].tolist() for b in loader] == [order[:4], order[4:8], order[8:]]
    flush_all()
    # by hand: a 16-byte file header, a 32-byte chunk header, the sizes 4, 4, 2 at 3 bits
    # (9 bits: 2 bytes), the 10 ids below 16 at 4 bits (40 bits: 5 bytes): 16 + 32 + 7 = 55
    assert (tmp_path / "shuffled" / "rank0.lineage").stat().st_size == 55

    loader = watch(DataLoader(TensorDataset(torch.arange(10)), batch_size=4), report=None,
                   lineage=str(tmp_path / "in_order"))
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    flush_all()
    # every batch a run: a 1-byte bitmap of runs, the sizes (2 bytes), the first ids 0, 4, 8
    # at 4 bits (2 bytes): 16 + 32 + 5 = 53
    assert (tmp_path / "in_order" / "rank0.lineage").stat().st_size == 53
    assert cli_json(tmp_path / "in_order", "--step", 2)["batches"][0]["ids"] == [8, 9]
    assert cli_json(tmp_path / "in_order", "--id", 6)["received"] == [
        {"epoch": 0, "step": 1, "rank": 0}]

    big = 2**33  # ids past 32 bits: 34 bits each
    rows = [{"id": torch.tensor(big + k)} for k in (0, 1, 5)]
    loader = watch(DataLoader(rows, batch_size=2), report=None, id_field="id",
                   on_violation="ignore", lineage=str(tmp_path / "big"))
    received = [b["id"].tolist() for b in loader]
    assert received == [[big, big + 1], [big + 5]]
    flush_all()
    # by hand: the runs' bitmap (1 byte), the sizes 2, 1 at 2 bits (1 byte), the first ids
    # 2^33 and 2^33 + 5 at 34 bits (68 bits: 9 bytes; from a base of 2^33, 3 bits each but 8
    # bytes for the base, no fewer): 16 + 32 + 11 = 59
    assert (tmp_path / "big" / "rank0.lineage").stat().st_size == 59
    assert cli_json(tmp_path / "big", "--step", 1)["batches"][0]["ids"] == received[1]
    assert cli_json(tmp_path / "big", "--step", 0)["batches"][0]["ids"] == received[0]
    assert cli_json(tmp_path / "big", "--id", big + 1)["received"] == [
        {"epoch": 0, "step": 0, "rank": 0}]
    assert cli_json(tmp_path / "big", "--id", 1)["received"] == []  # same low 32 bits


def test_a_resume_continues_the_steps_and_a_torn_tail_is_skipped(tmp_path, monkeypatch):
    """Launch 1 takes 3 steps, saves the watch's state (a checkpoint), takes 2 more and
    crashes in the middle of a write; launch 2 loads the checkpoint and walks the rest of
    epoch 0 (torch's order after its first 12) and epoch 1. The lineage is launch 1's first 3 steps, then launch 2's,
    counted on from 3: the steps launch 1 took after its checkpoint are superseded."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    folder = str(tmp_path / "lineage")
    data = TensorDataset(torch.arange(20))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=1)
    first = watch(DataLoader(data, batch_size=4, sampler=sampler), report=None,
                  lineage=folder)
    trained, saved = [], None
    for step, (ids,) in enumerate(first):
        trained.append(ids.tolist())
        if step == 2:  # 3 steps trained: the checkpoint
            saved = first.__dict__["_sharddemo_watch"].state_dict()
        if step == 4:
            break  # the crash
    flush_all()
    with open(tmp_path / "lineage" / "rank0.lineage", "ab") as handle:
        handle.write(b"\x00\x04\x00\x00" + b"\x07" * 13)  # a record cut short by the crash
    order = list(sampler)  # epoch 0's order, from torch's sampler

    class Resumed(torch.utils.data.Sampler):  # torch's sampler, its first 12 skipped once
        def __init__(self, skip):
            self.skip = skip

        def __iter__(self):
            out, self.skip = list(sampler)[self.skip:], 0
            return iter(out)

    rest = watch(DataLoader(data, batch_size=4, sampler=Resumed(12)), report=None,
                 lineage=folder)
    rest.__dict__["_sharddemo_watch"].load_state_dict(saved)
    resumed = [b[0].tolist() for b in rest]
    assert resumed == [order[12:16], order[16:20]]
    sampler.set_epoch(1)
    resumed += [b[0].tolist() for b in rest]
    expected = trained[:3] + resumed
    flush_all()
    got = [cli_json(folder, "--step", k)["batches"][0] for k in range(len(expected))]
    assert [b["ids"] for b in got] == expected
    assert [b["epoch"] for b in got] == [0] * 5 + [1] * 5
    result = lineage_cli(folder, "--step", 10)
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == ("Error: no rank's written lineage has --step "
                                              "10 (rank 0: written up to step 9)")
    # the torn record was cut before launch 2 appended: nothing is skipped now
    assert "Warning" not in lineage_cli(folder, "--step", 0).output


def test_a_torn_tail_is_detected_and_skipped_on_read(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    folder = tmp_path / "lineage"
    loader = watch(DataLoader(TensorDataset(torch.arange(6)), batch_size=2), report=None,
                   lineage=str(folder))
    received = []
    for (ids,) in loader:
        received.append(ids.tolist())
        if len(received) == 2:
            flush_all()  # steps 0 and 1 in one chunk; step 2 in the next, at the exit
    flush_all()
    whole = (folder / "rank0.lineage").read_bytes()
    # a crash in the middle of the last chunk's write: its first 32 bytes of 32 + 2 (a
    # batch [4, 5]: the runs' bitmap, 1 byte, and its first id, 1 byte)
    (folder / "rank0.lineage").write_bytes(whole[:-2])
    result = lineage_cli(folder, "--step", 1)
    assert result.exit_code == 0
    assert result.stderr.startswith("Warning: rank0.lineage ends in a chunk cut short (32 "
                                    "bytes")
    assert result.stdout == f"rank 0 epoch 0 step 1: 2 samples: {received[1][0]} " \
        f"{received[1][1]}\n"
    assert lineage_cli(folder, "--step", 2).exit_code == 2  # the torn step is not there
    # a last chunk whole in length but not in content: its CRC fails
    (folder / "rank0.lineage").write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    assert lineage_cli(folder, "--step", 2).exit_code == 2
    assert cli_json(folder, "--step", 1)["batches"][0]["ids"] == received[1]


def test_another_runs_folder_is_refused_unless_the_run_resumes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    folder = str(tmp_path / "lineage")
    data = TensorDataset(torch.arange(8))
    first = watch(DataLoader(data, batch_size=4), report=None, lineage=folder)
    list(first)
    saved = first.__dict__["_sharddemo_watch"].state_dict()
    flush_all()
    second = watch(DataLoader(data, batch_size=4), report=None, lineage=folder)
    with pytest.raises(ValueError, match=r"^sharddemo.watch: lineage .* already holds .*'s "
                       "lineage .* this run does not resume it"):
        next(iter(second))
    resumed = watch(DataLoader(data, batch_size=4), report=None, lineage=folder)
    resumed.__dict__["_sharddemo_watch"].load_state_dict(saved)
    assert len(list(resumed)) == 2  # its own lineage: continued
    flush_all()
    assert cli_json(folder, "--step", 3)["batches"][0]["ids"] == [4, 5, 6, 7]
    other = dict(saved, lineage={"run_id": "0123456789ab", "step": 2})
    elsewhere = watch(DataLoader(data, batch_size=4), report=None, lineage=folder)
    elsewhere.__dict__["_sharddemo_watch"].load_state_dict(other)
    with pytest.raises(ValueError, match="not run 0123456789ab's that this checkpoint"):
        next(iter(elsewhere))


def test_bad_input_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    data = TensorDataset(torch.arange(8))
    with pytest.raises(ValueError, match=r"^sharddemo.watch: lineage .* is a file; give a"):
        watch(DataLoader(data), report=None, lineage=str(a_file))
    with pytest.raises(ValueError, match=r"^sharddemo.watch: lineage .*: the folder cannot "
                       "be made"):
        watch(DataLoader(data), report=None, lineage=str(a_file / "inside"))
    with pytest.raises(TypeError, match="lineage must be a folder path"):
        watch(DataLoader(data), report=None, lineage=3)
    folder = tmp_path / "lineage"
    list(watch(DataLoader(data, batch_size=4), report=None, on_violation="ignore",
               lineage=str(folder)))
    flush_all()
    for args, line in [
            ((tmp_path, "--step", 0), f"Error: {tmp_path} is not a lineage folder (no "
             "lineage.json of schema sharddemo.lineage/1): give the folder passed to "
             "watch(..., lineage=DIR)"),
            ((folder, "--step", 2), "Error: no rank's written lineage has --step 2 (rank 0: "
             "written up to step 1; rank 1: no lineage file)"),
            ((folder, "--step", 0, "--rank", 1), "Error: rank 1 wrote no lineage file (the "
             "run had ranks 0..1); ranks with a lineage file: 0"),
            ((folder, "--step", 0, "--rank", 5), "Error: --rank 5 does not exist: this run "
             "had ranks 0..1; ranks with a lineage file: 0"),
            ((folder,), "Error: give one of --step K or --id ID")]:
        result = lineage_cli(*args)
        assert (result.exit_code, result.output.splitlines()) == (2, [line])


def test_a_step_never_reads_ids_on_a_device_back_to_the_host(tmp_path, monkeypatch):
    """The lineage keeps a batch's ids where they are until its chunk is written: shown on
    torch's meta device (no data: any read on the host raises), 40 steps of 16 ids with
    lineage raise nothing; the chunk's one copy (every 256 batches, here 40 and more) is the
    first read."""
    from torch.utils.data import default_collate

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    loader = watch(DataLoader(TensorDataset(torch.arange(1000)), batch_size=16,
                              collate_fn=lambda items: [t.to("meta")
                                                        for t in default_collate(items)]),
                   report=None, id_field=0, lineage=str(tmp_path / "lineage"))
    for step, (ids,) in enumerate(loader):
        assert ids.device.type == "meta"
        if step == 39:
            break
    writer = loader.__dict__["_sharddemo_watch"].lineage
    assert len(writer.pending) == 40
    with pytest.warns(RuntimeWarning, match=r"steps 0\.\.39 could not be written "
                      r"\(NotImplementedError: .*meta"):
        writer.flush()  # the chunk's copy: what the steps never do (its fault only warns)
    assert writer.pending == []


def test_a_resume_on_fewer_ranks_supersedes_the_dropped_ranks_later_steps(tmp_path,
                                                                          monkeypatch):
    """The writer alone, its ranks one after the other (RANK, WORLD_SIZE set): launch 0 on 3
    ranks writes steps 0..2 on each rank (the checkpoint at step 2, step 2 written before the
    crash); launch 1 resumes on 2 ranks from step 2. Rank 2's step 2 was superseded by the
    resume, as ranks 0 and 1's are by their restart records: the reader shows the resumed
    steps of ranks 0 and 1 and says where rank 2's lineage ends. Ids by hand."""
    from types import SimpleNamespace

    from sharddemo.watching.lineage import LineageWriter, validate_lineage_folder

    folder = str(tmp_path / "lineage")
    validate_lineage_folder(folder)  # (what watch() does: the folder made)
    state = SimpleNamespace(accelerator=None, n=200, name="train", epoch=0)
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        writer = LineageWriter(folder, state)
        for step in range(3):  # rank r, step k: ids 10r + 2k, 10r + 2k + 1
            writer.append(step // 2, torch.tensor([10 * rank + 2 * step,
                                                   10 * rank + 2 * step + 1]))
        writer.close()
        if rank == 0:
            place = {"run_id": writer.run_id, "step": 2}  # the checkpoint after 2 steps
    monkeypatch.setenv("WORLD_SIZE", "2")
    state.epoch = 1
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        writer = LineageWriter(folder, state)
        writer.resume(place)
        writer.append(1, torch.tensor([100 + rank]))
        writer.close()
    got = cli_json(folder, "--step", 2)
    assert [(b["rank"], b["ids"]) for b in got["batches"]] == [(0, [100]), (1, [101])]
    assert [m["note"] for m in got["not_written"]] == [
        "rank 2: its lineage ends before step 2 (written up to step 1)"]
    assert cli_json(folder, "--step", 1)["batches"][2]["ids"] == [22, 23]
    assert cli_json(folder, "--id", 24)["received"] == []  # rank 2's superseded step 2
    assert cli_json(folder, "--id", 4)["received"] == []  # rank 0's, superseded likewise
    run = json.loads((tmp_path / "lineage" / "lineage.json").read_text())
    assert [(launch["first_step"], launch["world_size"]) for launch in run["launches"]] == [
        (0, 3), (2, 2)]


# -- the Trainer's and Lightning's own loops, in this process ---------------------------------


def logged_trainer():
    """The watch_trainer example with its own account of the run: a model that logs the ids
    each training forward received (its x is [i, i] for sample i), and a callback that logs,
    at each optimizer step, the Trainer's global_step and the forwards made so far."""
    pytest.importorskip("transformers")
    from support.frameworks import example
    from transformers import TrainerCallback

    wt = example("watch_trainer")
    received: list[list[int]] = []
    made_at: list[tuple[int, int]] = []  # (global_step, forwards so far)

    class Logged(wt.TinyModel):
        def forward(self, x, labels=None):
            if self.training:
                received.append(x[:, 0].long().tolist())
            return super().forward(x, labels)

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            made_at.append((state.global_step, len(received)))

    return wt, received, made_at, Logged, Steps


def test_trainer_lineage_with_gradient_accumulation_and_a_resume(tmp_path,
                                                                 fresh_accelerate_state):
    """TrainerWatch(lineage=DIR), one process, 40 samples in batches of 4, 2 epochs, gradient
    accumulation 2 (5 optimizer steps an epoch), stopped after optimizer step 7 with a
    checkpoint there and resumed from it. Expected: the ids each training forward received,
    logged by the model itself (its x is [i, i] for sample i), launch after launch; and the
    Trainer's own global_step at each optimizer step, against the forwards made so far: step
    s is made of the batches (s-1)*G .. s*G-1 (docs/watch.md)."""
    wt, received, made_at, Logged, Steps = logged_trainer()

    out, folder = tmp_path / "run", tmp_path / "lineage"
    for stop, resume in ((7, None), (None, True)):
        wt.make_trainer(str(out), 2, stop_at=stop, lineage=str(folder), model=Logged(),
                        accumulation=2, callbacks=[Steps()]).train(resume_from_checkpoint=resume)
        flush_all()
    assert len(received) == 20  # 14 before the stop, the 6 after (by hand: 7 x 2, 10 x 2)
    got = [cli_json(folder, "--step", k)["batches"][0] for k in range(20)]
    assert [b["ids"] for b in got] == received
    assert [b["epoch"] for b in got] == [0] * 10 + [1] * 10
    assert [s for s, _ in made_at] == list(range(1, 11))
    assert all(forwards == step * 2 for step, forwards in made_at)


def test_the_optimizer_steps_of_an_epoch_whose_batches_g_does_not_divide(
        tmp_path, fresh_accelerate_state):
    """docs/watch.md's rule for the batches behind an optimizer step, against the Trainer's own
    global_step: one process, 40 samples in batches of 4 (B = 10 batches an epoch), 2 epochs,
    gradient accumulation G = 3, so the epoch's last update takes 1 batch (10 = 3 + 3 + 3 + 1)
    and (s-1)*G .. s*G-1 over the run is wrong from step 4 on. Expected: the forwards the model
    itself made before each optimizer step (the Trainer's on_step_end), and the lineage's ids
    of those forwards."""
    wt, received, made_at, Logged, Steps = logged_trainer()

    folder = tmp_path / "lineage"
    wt.make_trainer(str(tmp_path / "run"), 2, lineage=str(folder), model=Logged(),
                    accumulation=3, callbacks=[Steps()]).train()
    flush_all()
    G, B = 3, 10
    U = -(-B // G)  # optimizer steps an epoch: 4
    assert [s for s, _ in made_at] == list(range(1, 2 * U + 1))
    done = 0
    for s, forwards in made_at:
        E, J = (s - 1) // U, (s - 1) % U
        steps = range(J * G, min((J + 1) * G, B))  # the rule, within epoch E
        assert forwards == done + len(steps), (s, forwards)
        got = [cli_json(folder, "--epoch", E, "--step", k)["batches"][0]["ids"] for k in steps]
        assert got == received[done:forwards], s
        done = forwards


def test_lightning_lineage_across_a_resumed_fit(tmp_path):
    """LightningWatch(lineage=DIR), one device in this process, 40 samples in batches of 4,
    2 epochs; a checkpoint at step 13, the fit stopped there, then fit(ckpt_path=...) in a new
    Trainer. Expected: the ids each training_step received (logged by the module itself, its
    x is [i, i] for sample i), fit after fit; the lineage holds exactly those, its steps going
    on from the checkpoint's 13."""
    pytest.importorskip("pytorch_lightning")
    from support.frameworks import example

    from sharddemo.integrations import LightningWatch

    wl = example("watch_lightning")
    pl = wl.pl
    received: list[list[int]] = []

    class Logged(wl.Tiny):
        def training_step(self, batch, index):
            received.append(batch[0][:, 0].long().tolist())
            return super().training_step(batch, index)

    folder = tmp_path / "lineage"

    def fit(*callbacks, ckpt_path=None):
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2,
                             default_root_dir=str(tmp_path),
                             callbacks=[LightningWatch(lineage=str(folder)), *callbacks],
                             enable_progress_bar=False, enable_model_summary=False,
                             logger=False, enable_checkpointing=bool(callbacks),
                             num_sanity_val_steps=0)
        trainer.fit(Logged(), DataLoader(wl.Numbers(40), batch_size=4, shuffle=True),
                    DataLoader(wl.Numbers(7), batch_size=2), ckpt_path=ckpt_path)
        flush_all()

    fit(wl.StopAt(13), pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "checkpoints"),
                                                     every_n_train_steps=13, save_top_k=-1))
    assert len(received) == 13
    fit(ckpt_path=str(tmp_path / "checkpoints" / "epoch=1-step=13.ckpt"))
    got = [cli_json(folder, "--step", k)["batches"][0]["ids"] for k in range(len(received))]
    assert got == received
    assert lineage_cli(folder, "--step", len(received)).exit_code == 2
    from sharddemo.lineage import Lineage

    assert Lineage(str(folder)).rank(0).restarts == [13]  # the checkpoint's step


# -- a lineage folder removed mid-run (on real ranks: tests/ranks/test_lineage.py) ----------------


def test_a_lineage_write_that_fails_mid_run_warns_once_and_training_goes_on(tmp_path,
                                                                            monkeypatch):
    """One process, 20 samples in batches of 4 (5 steps an epoch), 3 epochs; the folder is
    removed after epoch 0 was written at its end. Epoch 1's write, at its end, fails: one
    warning naming its steps (5..9, by hand); epoch 2 writes nothing more and warns no more,
    and the loop receives every batch."""
    import shutil
    import warnings

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    folder = tmp_path / "lineage"
    loader = watch(DataLoader(TensorDataset(torch.arange(20)), batch_size=4), report=None,
                   lineage=str(folder))
    assert len(list(loader)) == 5
    assert cli_json(folder, "--step", 4)["batches"][0]["ids"] == [16, 17, 18, 19]
    shutil.rmtree(folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [len(list(loader)) for _ in range(2)] == [5, 5]
        loader.close()
        flush_all()
    lines = [str(w.message) for w in caught if "lineage" in str(w.message)]
    assert lines == [f"[rank 0/1] sharddemo.watch: lineage '{folder}': steps 5..9 could not "
                     "be written (FileNotFoundError: [Errno 2] No such file or directory: "
                     f"'{folder / 'rank0.lineage'}'); this rank's lineage ends before step 5; "
                     "training goes on"]


def test_each_ranks_own_saved_state_resumes_its_lineage(tmp_path, monkeypatch):
    """A loader's own state_dict() is saved on every rank, each its own: rank 1's saved place
    names the run (rank 0 wrote it in the run file at its first batch), so a new launch that
    loads rank 1's own state continues its lineage. Two ranks' loops, one after the other in
    this process, 8 samples in batches of 2 (2 steps a rank); then rank 1 again from its own
    state: its steps go on at 2 (worked by hand: 2 taken before the save)."""
    folder = str(tmp_path / "lineage")
    data = TensorDataset(torch.arange(8))
    saved = {}
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)
        loader = watch(DataLoader(data, batch_size=2, sampler=sampler), report=None,
                       lineage=folder, on_violation="ignore")
        list(loader)
        saved[rank] = loader.__dict__["_sharddemo_watch"].state_dict()
        flush_all()
    assert saved[1]["lineage"]["run_id"] == saved[0]["lineage"]["run_id"] is not None
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
    again = watch(DataLoader(data, batch_size=2, sampler=sampler), report=None, lineage=folder,
                  on_violation="ignore")
    again.__dict__["_sharddemo_watch"].load_state_dict(saved[1])
    list(again)  # (before the change: "already holds run ...'s lineage", a ValueError)
    flush_all()
    assert [b["step"] for b in cli_json(folder, "--step", 3, "--rank", 1)["batches"]] == [3]
