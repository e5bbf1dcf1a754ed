"""A watched loop that stops mid-epoch (max_steps, an exception, the process ending) on 2 real
gloo ranks running tests/scripts/watch_loop.py `stop`: the epoch so far is reported as partial,
with the verdicts a part supports. Expected values: the ids each rank's loop itself received
(logged by the script beside the watch), or literals worked out by hand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.launch import ROOT, accelerate_launch, ended_or_aborted_at_teardown, launch_env
from support.reports import entries


LOOP = "tests/scripts/watch_loop.py"
WHOLE_EPOCH_ONLY = {"no-missing-samples", "order-changes-each-epoch",
                    "eval-counts-each-sample-once"}


def verdicts(entry: dict) -> set[str]:
    return {v["verdict"] for v in entry["verdicts"]}


# -- one process, started as a subprocess -----------------------------------------------------


def test_the_process_ending_writes_the_open_epoch(tmp_path):
    """No close(): the interpreter's exit writes the open epoch (one process: the whole
    world, so not marked main-only). 3 steps of 8 (by hand)."""
    report = tmp_path / "w.jsonl"
    script = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
              "from sharddemo import watch\n"
              f"loader = watch(DataLoader(TensorDataset(torch.arange(100)), batch_size=8), "
              f"report={str(report)!r})\n"
              "for step, _ in enumerate(loader):\n    if step == 2:\n        break\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, env=launch_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    [entry] = entries(report)
    assert (entry["partial"], entry["seen"], entry["steps"], entry["ok"]) == (True, 24, [3],
                                                                             True)
    assert "ranks" not in entry


# -- real ranks ---------------------------------------------------------------------------------

def stopped(tmp_path, *args) -> tuple[list[dict], list[list[int]], str]:
    report = tmp_path / "w.jsonl"
    proc = accelerate_launch([LOOP, "stop", "--report", str(report), "--ids", str(tmp_path),
                              *args], check=False)
    assert ended_or_aborted_at_teardown(proc), proc.stderr
    ids = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("sharddemo:")]
    return entries(report), ids, "\n".join(lines)


@pytest.mark.parametrize("end", ["close", "with"])
def test_a_prepared_loader_stopped_at_step_20_on_2_ranks(tmp_path, end):
    """1,000 samples, batch 8, prepared, a break at step 20 then close() on every rank."""
    got, ids, lines = stopped(tmp_path, "--end", end)
    [entry] = got
    both = ids[0] + ids[1]
    assert (entry["seen"], entry["unique"]) == (len(both), len(set(both)))
    assert entry["steps"] == [len(ids[0]) // 8, len(ids[1]) // 8] == [20, 20]
    assert entry["partial"] and entry["missing"] is None and "ranks" not in entry
    assert entry["ok"] == (not set(ids[0]) & set(ids[1])) is True
    assert not verdicts(entry) & WHOLE_EPOCH_ONLY
    assert lines.count("\n") == 0 and "(partial)" in lines and lines.endswith(": ok")


@pytest.mark.parametrize("end", ["exit", "raise", "late"])
def test_where_the_ranks_cannot_meet_the_main_process_writes_its_part(tmp_path, end):
    """No close() before the process ends (exit), an exception leaving the with block
    (raise), or close() after end_training() ended the process group (late): the main process
    writes its own part alone, marked main-only; nothing hangs."""
    got, ids, lines = stopped(tmp_path, "--end", end)
    [entry] = got
    assert entry["ranks"] == "main-only" and entry["world_size"] == 2
    assert (entry["seen"], entry["unique"], entry["steps"]) == (len(ids[0]), len(set(ids[0])),
                                                                [20])
    assert entry["partial"] and entry["ok"]
    assert verdicts(entry) == {"no-unexplained-duplicates"}
    assert "main process alone" in lines
    # what left the ranks apart, said as it happened (not "the ranks could not meet")
    why = {"exit": "close() was not called before the process's exit",
           "raise": "an exception left the with block: ",
           "late": "the process group had ended before close()"}[end]
    assert entry["alone_because"].startswith(why) and why in lines


def test_the_watchs_exit_handler_makes_no_call_on_a_process_group_left_open(tmp_path):
    """A loop stopped at step 20 that neither closes the watch nor ends the process group (the
    process group left to the interpreter's exit, as in docs/reliability.md's teardown
    launches): the watch's exit handler writes the main process's part alone and makes no
    collective, and neither ends nor makes a process group, on any rank (every such call after
    the loop was written to a file by the rank script as it was made). The launch ends with
    0, or with torch's teardown abort and nothing else."""
    got, ids, lines = stopped(tmp_path, "--end", "left")
    [entry] = got
    assert entry["ranks"] == "main-only" and entry["partial"]
    assert (entry["seen"], entry["steps"]) == (len(ids[0]), [20])
    for rank in range(2):
        assert (tmp_path / f"calls{rank}.txt").read_text() == "", f"rank {rank}"


def test_epochs_capped_at_a_step_budget_are_each_a_partial_epoch_that_holds(tmp_path):
    """3 epochs, each broken out of at step 10 (a step budget per epoch), then close(): each
    new pass ends the epoch before it, so 3 partial entries (epochs 0, 1, 2), each with the
    ids each rank's loop logged for that epoch and ok (a prepared loader: no repeats within an
    epoch; before, the passes were pooled into one epoch 0 that failed on the next pass's
    samples as repeats)."""
    got, _, lines = stopped(tmp_path, "--end", "close", "--epochs", "3", "--stop-at", "10")
    per_rank = [json.loads((tmp_path / f"rank{r}.epochs.json").read_text()) for r in range(2)]
    assert [e["epoch"] for e in got] == [0, 1, 2]
    for epoch, entry in enumerate(got):
        both = per_rank[0][epoch] + per_rank[1][epoch]
        assert (entry["seen"], entry["unique"]) == (len(both), len(set(both))) == (160, 160)
        assert entry["steps"] == [10, 10] and entry["partial"] and entry["ok"], entry["line"]
    assert per_rank[0][0] != per_rank[0][1]  # (accelerate reshuffles each pass: new samples)
    assert lines.count("(partial)") == 3 and "FAIL" not in lines


def test_an_unsplit_stream_stopped_at_step_20_fails_replication(tmp_path):
    """A stream every rank reads whole, with id_field, stopped at step 20: both ranks received
    the same 160 samples (their own logs say so)."""
    got, ids, lines = stopped(tmp_path, "--loader", "stream", "--end", "close")
    [entry] = got
    assert ids[0] == ids[1]
    assert (entry["seen"], entry["unique"]) == (2 * len(ids[0]), len(set(ids[0])))
    failed = {v["verdict"] for v in entry["verdicts"] if not v["ok"]}
    assert "no-silent-replication" in failed and not entry["ok"]
    assert "(partial)" in lines and "FAIL" in lines


def test_a_replicated_loader_stopped_at_step_20_fails_replication_not_repeats(tmp_path):
    """The new-user trial: a plain shuffled DataLoader every rank reads whole (not prepared,
    unseeded: each rank its own order), stopped at step 20. No rank received a sample twice;
    the samples both ranks received (their logs) are replication, named as such (before:
    no-silent-replication held and "N repeats, none explained" was the only FAIL)."""
    got, ids, lines = stopped(tmp_path, "--loader", "replicated", "--end", "close")
    [entry] = got
    assert all(len(set(mine)) == len(mine) for mine in ids)  # no rank repeats itself
    both = set(ids[0]) & set(ids[1])
    assert both  # (two orders of 1,000, 160 each: about 26 shared; by hand)
    seen = len(ids[0]) + len(ids[1])
    assert (entry["seen"], entry["unique"]) == (seen, len(set(ids[0]) | set(ids[1])))
    failed = {v["verdict"]: v["detail"] for v in entry["verdicts"] if not v["ok"]}
    assert failed["no-silent-replication"] == (
        f"{len(both):,} of the {seen:,} deliveries are samples another rank received too: "
        "the loader is not sharded")
    assert "replication" in entry["duplicated"]["reasons"], entry["duplicated"]
