"""watch(..., lineage=DIR) and `sharddemo lineage` on real gloo ranks
(tests/scripts/lineage_loop.py): workers, a resume in the middle, a crash then a resume on more
ranks, ranks ending with os._exit, a lineage folder removed mid-run. Expected values come from
torch's DistributedSampler and accelerate's prepared loader built in this process, or from the
ids the loop itself received, logged beside the watch."""

from __future__ import annotations

import json

import torch
from support.reports import cli_json, lineage_cli
from support.launch import accelerate_launch, ended_or_aborted_at_teardown
from torch.utils.data import DataLoader, TensorDataset



# -- real ranks --------------------------------------------------------------------------------

def test_real_ranks_three_with_workers(tmp_path):
    """3 gloo ranks, 2 DataLoader workers each, 2 epochs: each rank's lineage is accelerate's
    batches for it (the workers fetch; the order is the sampler's, in the main process)."""
    folder = tmp_path / "lineage"
    proc = accelerate_launch(["examples/watch_accelerate.py", "--report",
                              str(tmp_path / "w.jsonl"), "--lineage", str(folder),
                              "--workers", "2"], nproc=3, check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    uninterrupted = prepared_batches(3, epochs=2)
    for rank in range(3):
        got = [cli_json(folder, "--step", k, "--rank", rank)["batches"][0]["ids"]
               for k in range(len(uninterrupted[rank]))]
        assert got == uninterrupted[rank], rank
    # epoch 1's first batch of every rank, by --epoch
    assert [b["ids"] for b in cli_json(folder, "--step", 0, "--epoch", 1)["batches"]] == [
        uninterrupted[rank][len(uninterrupted[rank]) // 2] for rank in range(3)]
    # the files' size, by hand: one chunk an epoch (the writer writes at the epoch's change and
    # at the exit), each a 32-byte header, at most 1 byte of runs' bitmap and 2 of sizes (4
    # batches of at most 4: 3 bits each), and the epoch's ids at 6 bits (all below 40); the
    # 16-byte file header. (Format 1 took 24 bytes a batch and 4 an id: 336 bytes a rank here.)
    for rank in range(3):
        half = len(uninterrupted[rank]) // 2
        epochs = [uninterrupted[rank][:half], uninterrupted[rank][half:]]
        bound = 16 + sum(32 + 1 + 2 + -(-6 * sum(map(len, batches)) // 8) for batches in epochs)
        assert (folder / f"rank{rank}.lineage").stat().st_size <= bound, rank


def prepared_batches(world: int, epochs: int) -> list[list[list[int]]]:
    """Every rank's batches, epoch after epoch, for examples/watch_accelerate.py's loader
    uninterrupted (N=40, batch 4), from accelerate's prepared loader iterated per rank in this
    process after the example's own draws from torch's seeded generator (its model's weights,
    its dataset's features)."""
    from accelerate.data_loader import prepare_data_loader
    from support.oracle import ACCELERATOR_RNG_TYPES, ensure_accelerator_state

    out = []
    for rank in range(world):
        torch.manual_seed(0)
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        data = TensorDataset(torch.arange(40), torch.randn(40, 8))
        ensure_accelerator_state()
        loader = prepare_data_loader(DataLoader(data, batch_size=4, shuffle=True),
                                     num_processes=world, process_index=rank,
                                     put_on_device=False, rng_types=list(ACCELERATOR_RNG_TYPES))
        out.append([b[0].tolist() for _ in range(epochs) for b in loader])
    return out


def test_real_ranks_resumed_in_the_middle_keep_every_step(tmp_path):
    """2 gloo ranks: save_state after 3 steps and stop; a new launch load_states and trains
    on (the example's seeded resume, exact: tests/ranks/test_watch.py). Each rank's lineage is
    accelerate's batches for it, epoch 0 then epoch 1, steps 0..9, the restart at step 3."""
    folder, checkpoint = tmp_path / "lineage", tmp_path / "ckpt"
    common = ["examples/watch_accelerate.py", "--report", str(tmp_path / "w.jsonl"),
              "--lineage", str(folder)]
    for args in (["--save-at", "3", "--checkpoint", str(checkpoint)],
                 ["--resume-from", str(checkpoint)]):
        proc = accelerate_launch([*common, *args], check=False)
        assert ended_or_aborted_at_teardown(proc), proc.stderr
    uninterrupted = prepared_batches(2, epochs=2)
    for rank in range(2):
        expected = uninterrupted[rank]
        got = [cli_json(folder, "--step", k, "--rank", rank)["batches"][0]
               for k in range(len(expected))]
        assert [b["ids"] for b in got] == expected, rank
        assert [b["epoch"] for b in got] == [0] * 5 + [1] * 5
    assert lineage_cli(folder, "--step", 10).exit_code == 2
    # the restart is recorded where launch 2 went on: after the 3 steps saved (--save-at 3)
    from sharddemo.lineage import Lineage

    assert [Lineage(str(folder)).rank(rank).restarts for rank in range(2)] == [[3], [3]]
    run = json.loads((folder / "lineage.json").read_text())
    assert (run["world_size"], run["dataset_size"]) == (2, 40)


# -- a resume on more ranks, a crash, a folder removed, a process that ends with
# os._exit (tests/scripts/lineage_loop.py: N = 40 unless said, batches of 4, each rank logs the ids its
# loop received, step by step, beside the lineage)

LOOP = "tests/scripts/lineage_loop.py"


def logged(log, launch: int, rank: int) -> list[list]:
    """The [epoch, ids] of each step the loop received, as it logged them."""
    path = log / f"launch{launch}_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def lineage_steps(folder, rank: int, steps) -> list[list]:
    """[epoch, ids] of each step in `steps` of `rank`, read back with the command."""
    out = []
    for k in steps:
        (batch,) = cli_json(folder, "--step", k, "--rank", rank)["batches"]
        assert batch["step"] == k
        out.append([batch["epoch"], batch["ids"]])
    return out


def test_real_ranks_a_crash_then_a_resume_on_more_ranks(tmp_path):
    """Launch 0, 2 gloo ranks: save_state after 3 steps, then a crash (os._exit) after step 5
    of epoch 0: what is written is the 3 steps the checkpoint flushed (steps 0..2), and the
    reader says "written up to step 2", not that the ranks received no more. Launch 1, 3 gloo
    ranks, resumes from that checkpoint (its steps counted on from 3, the checkpoint's) and
    walks the rest of epoch 0 and epoch 1: rank 2's file, new, is read with the others, from
    step 3 on; every rank's every step and every id's every receipt is what the loops logged."""
    folder, log, checkpoint = tmp_path / "lineage", tmp_path / "log", tmp_path / "ckpt"
    log.mkdir()
    common = [LOOP, "--lineage", str(folder), "--log", str(log)]
    proc = accelerate_launch([*common, "--launch", "0", "--save-at", "3", "--checkpoint",
                              str(checkpoint), "--crash-at", "5"], check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    before = {rank: logged(log, 0, rank) for rank in range(2)}
    assert [len(before[rank]) for rank in range(2)] == [5, 5]  # steps 0..4 received
    for rank in range(2):
        assert lineage_steps(folder, rank, range(3)) == before[rank][:3]
    # the steps 3 and 4 the ranks trained after the checkpoint were never written
    result = lineage_cli(folder, "--step", 3)
    assert (result.exit_code, result.output) == (2, "Error: no rank's written lineage has "
                                                    "--step 3 (rank 0: written up to step 2; "
                                                    "rank 1: written up to step 2)\n")
    unwritten = before[0][3][1][0]  # an id rank 0 received at step 3, after the checkpoint
    result = lineage_cli(folder, "--id", unwritten)
    assert (result.exit_code, result.output) == (0, f"id {unwritten}: not in the written "
                                                    "lineage (written: rank 0 up to step 2, "
                                                    "rank 1 up to step 2)\n")
    result = lineage_cli(folder, "--id", 40)  # N = 40: ids 0..39
    assert (result.exit_code, result.output) == (2, "Error: --id 40 is outside the dataset: "
                                                    "its ids are 0..39 (dataset_size 40 in "
                                                    "lineage.json)\n")

    # launch 1: 3 ranks; the 2 ranks' 3 steps took 6 batches of 4: 2 a rank on 3 ranks
    proc = accelerate_launch([*common, "--launch", "1", "--resume-from", str(checkpoint),
                              "--skip", "2"], nproc=3, check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    after = {rank: logged(log, 1, rank) for rank in range(3)}
    expected = {0: before[0][:3] + after[0], 1: before[1][:3] + after[1], 2: after[2]}
    assert len(after[2]) > 1
    for rank in range(3):
        first = 3 if rank == 2 else 0  # rank 2 joined at the resume, at the checkpoint's step
        assert lineage_steps(folder, rank, range(first, 3 + len(after[rank]))) == \
            expected[rank], rank
    assert [b["rank"] for b in cli_json(folder, "--step", 3)["batches"]] == [0, 1, 2]
    result = lineage_cli(folder, "--step", 1)
    assert result.exit_code == 0
    assert result.output.splitlines()[2] == ("rank 2: its lineage begins at step 3 (it joined "
                                             "the run at a resume there)")
    result = lineage_cli(folder, "--step", 1, "--rank", 2)
    assert (result.exit_code, result.output) == (2, "Error: no rank's written lineage has "
                                                    "--step 1 (rank 2: begins at step 3)\n")
    # epoch 0's first batch is the run's step 0: ranks 0 and 1 had it, rank 2 (joined at step
    # 3) did not (the trial: its step 3 was given as epoch 0's step 0)
    got = cli_json(folder, "--epoch", 0, "--step", 0)["batches"]
    assert [(b["rank"], b["step"], b["ids"]) for b in got] == [
        (0, 0, expected[0][0][1]), (1, 0, expected[1][0][1])]
    # every id's receipts: the (epoch, step, rank) of each logged batch that holds it
    for sample in range(40):
        receipts = sorted(({"epoch": epoch, "step": step + (3 if rank == 2 else 0),
                            "rank": rank}
                           for rank in range(3)
                           for step, (epoch, ids) in enumerate(expected[rank])
                           for _ in range(ids.count(sample))),
                          key=lambda hit: (hit["step"], hit["rank"]))
        assert cli_json(folder, "--id", sample)["received"] == receipts, sample
    run = json.loads((folder / "lineage.json").read_text())
    assert [(launch["first_step"], launch["world_size"]) for launch in run["launches"]] == [
        (0, 2), (3, 3)]


def test_real_ranks_ending_with_os_exit_keep_every_step_written(tmp_path):
    """2 gloo ranks, accelerate's even_batches=False over 36 samples in batches of 4: 9 batches
    an epoch, rank 0 takes 5, rank 1 takes 4 (by hand: batch j to rank j mod 2), 2 epochs;
    then each process ends with os._exit, as Ray Train's workers do (no close(), no exit
    handler). Every step the loops logged is in the lineage (each epoch written at its end),
    and a step past rank 1's end names that rank's end."""
    folder, log = tmp_path / "lineage", tmp_path / "log"
    log.mkdir()
    proc = accelerate_launch([LOOP, "--lineage", str(folder), "--log", str(log), "--n", "36",
                              "--uneven", "--end", "os-exit"], check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    received = {rank: logged(log, 0, rank) for rank in range(2)}
    assert [len(received[rank]) for rank in range(2)] == [10, 8]  # 5 + 5, 4 + 4 by hand
    for rank in range(2):
        assert lineage_steps(folder, rank, range(len(received[rank]))) == received[rank]
    result = lineage_cli(folder, "--step", 8)
    assert (result.exit_code, result.output.splitlines()[1:]) == (
        0, ["rank 1: its lineage ends before step 8 (written up to step 7)"])
    got = cli_json(folder, "--step", 8)
    assert [b["ids"] for b in got["batches"]] == [received[0][8][1]]
    assert got["not_written"] == [{"rank": 1, "first_step": 0, "last_step": 7, "note": (
        "rank 1: its lineage ends before step 8 (written up to step 7)")}]
    # epoch 1's fifth batch (--step 4 --epoch 1): rank 0's only
    result = lineage_cli(folder, "--step", 4, "--epoch", 1)
    assert result.output.splitlines()[1] == ("rank 1: its lineage holds 4 batches of epoch 1 "
                                             "(written up to step 7)")
    result = lineage_cli(folder, "--step", 10)
    assert (result.exit_code, result.output) == (2, "Error: no rank's written lineage has "
                                                    "--step 10 (rank 0: written up to step 9; "
                                                    "rank 1: written up to step 7)\n")
    # an id's places, with where each rank's written lineage ends (they differ here)
    sample = received[0][9][1][0]  # in rank 0's last batch
    places = sorted((step, rank) for rank in range(2)
                    for step, (_, ids) in enumerate(received[rank]) if sample in ids)
    result = lineage_cli(folder, "--id", sample)
    assert result.output.splitlines() == [
        f"epoch {received[rank][step][0]} step {step} rank {rank}" for step, rank in places] + [
        "(written: rank 0 up to step 9, rank 1 up to step 7)"]


def test_real_ranks_a_lineage_folder_gone_warns_once_per_rank_and_training_goes_on(tmp_path):
    """2 gloo ranks: after watch() made the lineage folder, rank 0 removes it and puts a file
    in its place, before the first batch. Each rank warns once that its lineage could not be
    opened; both loops take every step (40 samples, batches of 4, 2 epochs: 5 steps an epoch
    a rank, by hand), the report is written, and no rank raises."""
    folder, log = tmp_path / "lineage", tmp_path / "log"
    log.mkdir()
    proc = accelerate_launch([LOOP, "--lineage", str(folder), "--log", str(log),
                              "--remove-lineage"], check=False)
    assert ended_or_aborted_at_teardown(proc) and "Traceback" not in proc.stderr, proc.stderr
    assert [len(logged(log, 0, rank)) for rank in range(2)] == [10, 10]
    for rank in range(2):
        warned = [line for line in proc.stderr.splitlines()
                  if f"[rank {rank}/2] sharddemo.watch: lineage" in line]
        assert len(warned) == 1, proc.stderr
        assert warned[0].endswith(
            f"RuntimeWarning: [rank {rank}/2] sharddemo.watch: lineage '{folder}': this rank's "
            "lineage could not be opened (NotADirectoryError: [Errno 20] Not a directory: "
            f"'{folder / ('lineage.json.tmp' if rank == 0 else 'rank1.lineage')}'); this "
            "rank's lineage ends before step 0; training goes on"), warned[0]
    entries = [json.loads(line) for line in (log / "watch.jsonl").read_text().splitlines()]
    assert [(e["epoch"], e["ok"]) for e in entries] == [(0, True), (1, True)]
