"""The watch's resume verdicts in one process: a checkpoint of another dataset size or loader,
a checkpoint saved before the watch (or with it, loaded without it), each part of a chain
counted with its repeats, the fill of a resumed part. Expected values come from accelerate's
own BatchSamplerShard and SkipBatchSampler, or from literals worked out by hand. Real runs that
stop and resume: tests/ranks/test_watch_resume_chain.py."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from sharddemo import watch
from sharddemo.analysis.entry_resume import restart, judge_resume


# -- one process ---------------------------------------------------------------------------------

def test_a_checkpoint_of_another_dataset_size_or_loader_is_one_line_not_a_verdict(tmp_path):
    loader = watch(DataLoader(TensorDataset(torch.arange(8)), batch_size=4), report=None)
    state = loader.__dict__["_sharddemo_watch"]
    saved = {"schema": "sharddemo.watch-state/1", "loader": "train", "epoch": 0,
             "dataset_size": 40, "previous": None, "before": torch.ones(40, dtype=torch.uint8)}
    with pytest.warns(RuntimeWarning, match="saved for a dataset of 40 samples, this loader's "
                                            "has 8"):
        state.load_state_dict(saved)
    assert [i for (b,) in loader for i in b.tolist()] == list(range(8))
    entry = state.entries[-1]
    assert entry["resume"]["unknown_before"] and entry["ok"] and entry["seen"] == 8
    other = watch(DataLoader(TensorDataset(torch.arange(8)), batch_size=4), report=None,
                  name="eval-set").__dict__["_sharddemo_watch"]
    with pytest.warns(RuntimeWarning, match="saved for the loader named 'train', not "
                                            "'eval-set'"):
        other.load_state_dict({**saved, "dataset_size": 8})


def test_a_chain_counts_each_part_and_each_restarts_repeats():
    """N = 8, by hand: 0-3 before the first stop, 2-5 after it (2 and 3 repeated), 5-7 after
    the second (5 repeated); nothing skipped; 4 + 4 + 3 = 11 deliveries."""
    before = np.array([1, 1, 2, 2, 1, 1, 0, 0], dtype=np.uint8)  # the first two parts
    again = np.array([0, 0, 1, 1, 0, 0, 0, 0], dtype=np.uint8)  # the first restart's repeats
    after = np.array([0, 0, 0, 0, 0, 1, 1, 1], dtype=np.uint8)
    first = {**restart(0, 1, 2, 2), "seen_before": 4, "repeated": {"count": 2, "ids": [2, 3]}}
    got = judge_resume(before, after, 0, [first, restart(0, 2, 2, 2)], again)
    assert got["seen_before"] == 8 and got["repeated"] == {"count": 3, "ids": [2, 3, 5]}
    assert got["skipped"]["count"] == 0 and not got["verdict"]["ok"]
    assert [r["repeated"]["ids"] for r in got["restarts"]] == [[2, 3], [5]]
    assert [r["seen_before"] for r in got["restarts"]] == [4, 8]


def test_load_state_of_a_checkpoint_saved_before_the_watch_loads_and_says_so(
        tmp_path, fresh_accelerate_state):
    """accelerate's own load_state raises where the objects registered for checkpointing differ
    from the folder's custom_checkpoint_N.pkl files; the watch is no such object (a file of its
    own, through save_state's and load_state's pre-hooks), so a checkpoint saved before the
    watch was added loads with it (the user's own object gets its state), and the epoch says the
    part before the stop is unknown."""
    from accelerate import Accelerator

    class Position:
        def __init__(self):
            self.at = None

        def state_dict(self):
            return {"at": 3}

        def load_state_dict(self, state):
            self.at = state["at"]

    folder = str(tmp_path / "ckpt")
    Accelerator(cpu=True).save_state(folder)  # nothing registered: no custom_checkpoint_0.pkl
    plain = Accelerator(cpu=True)
    plain.register_for_checkpointing(Position())
    with pytest.raises(RuntimeError, match="Number of custom checkpoints"):
        plain.load_state(folder)  # (accelerate's own rule, which the watch must not meet)
    saved = str(tmp_path / "user")
    user = Accelerator(cpu=True)
    user.register_for_checkpointing(Position())
    user.save_state(saved)  # the user's object only: custom_checkpoint_0.pkl
    watched = Accelerator(cpu=True)
    position = Position()
    watched.register_for_checkpointing(position)
    loader = watch(DataLoader(TensorDataset(torch.arange(8)), batch_size=4), watched,
                   report=None)
    with pytest.warns(RuntimeWarning, match="saved before the watch was added"):
        watched.load_state(saved)
    assert position.at == 3
    assert [i for (b,) in loader for i in b.tolist()] == list(range(8))
    entry = loader.__dict__["_sharddemo_watch"].entries[-1]
    assert entry["resume"]["unknown_before"] and entry["ok"] and entry["missing"] is None


def test_a_checkpoint_saved_with_the_watch_loads_without_it(tmp_path, fresh_accelerate_state):
    """The other way: a run that drops the watch loads the checkpoints it saved. The watch's
    file sits beside accelerate's (no custom_checkpoint_N.pkl of its own), so the user's object
    registered after watch() is still custom_checkpoint_0.pkl and gets its own state back."""
    from accelerate import Accelerator

    class Position:
        def __init__(self, at=None):
            self.at = at

        def state_dict(self):
            return {"at": self.at}

        def load_state_dict(self, state):
            self.at = state["at"]

    folder = tmp_path / "ckpt"
    watched = Accelerator(cpu=True)
    loader = watch(DataLoader(TensorDataset(torch.arange(8)), batch_size=4), watched,
                   report=None, name="train")
    watched.register_for_checkpointing(Position(at=5))
    for _ in loader:
        break
    watched.save_state(str(folder))
    assert sorted(p.name for p in folder.glob("*custom_checkpoint*")) == [
        "custom_checkpoint_0.pkl"]
    assert (folder / "sharddemo_watch-train.pt").exists()
    plain = Accelerator(cpu=True)
    position = Position()
    plain.register_for_checkpointing(position)
    plain.load_state(str(folder))  # raised RuntimeError when the watch was a registered object
    assert position.at == 5


@pytest.mark.parametrize("n,batch,world,skipped,fill", [
    # N = 10, B = 3, W = 2: r0 [[0,1,2],[6,7,8]], r1 [[3,4,5],[9,0,1]] (FACTS): batch 3 of
    # K = 4 is short, completed with 0 and 1
    (10, 3, 2, 0, [0, 1]),
    # N = 80, B = 4, W = 3, resumed after skip_first_batches(4): rank 2's last batch is global
    # batch 20 of K = 20, the order's first batch again
    (80, 4, 3, 4, [0, 1, 2, 3]),
    # N = 80, B = 4, W = 2: K = 20 deals evenly, no fill
    (80, 4, 2, 3, []),
])
def test_the_fill_of_a_resumed_part_is_read_from_each_ranks_last_batch(n, batch, world,
                                                                        skipped, fill):
    from sharddemo.analysis.entry_resume import fill_ids

    inner = BatchSampler(SequentialSampler(range(n)), batch, drop_last=False)
    ranks = []
    for r in range(world):
        part = list(SkipBatchSampler(BatchSamplerShard(inner, world, r), skipped))
        ranks.append({"rank": r, "steps": len(part), "tail": part[-3:]})
    described = {"batch_sampler_shard": True, "even_batches": True, "prepared": True}
    got = fill_ids({"ranks": ranks}, described, n, batch, skipped)
    assert got.tolist() == fill
    assert fill_ids({"ranks": ranks}, {**described, "even_batches": False}, n, batch,
                    skipped).tolist() == []


def test_a_resumed_part_is_judged_on_its_repeats_only():
    """N = 8, by hand: 0-3 delivered before the stop, 2-5 after the restart so far (2 and 3
    repeated); 6 and 7 have not come (no skipped: the rest of the epoch may still come)."""
    before = np.array([1, 1, 1, 1, 0, 0, 0, 0], dtype=np.uint8)
    after = np.array([0, 0, 1, 1, 1, 1, 0, 0], dtype=np.uint8)
    got = judge_resume(before, after, 0, [restart(0, 1, 2, 2)], partial=True)
    assert got["seen_before"] == 4 and got["repeated"] == {"count": 2, "ids": [2, 3]}
    assert got["skipped"] is None and not got["verdict"]["ok"]
    assert got["verdict"]["detail"].startswith("2 sample(s) delivered again after the restart "
                                               "so far")
    # 4-5 after the stop: nothing repeated yet, 6 and 7 still to come: ok
    after = np.array([0, 0, 0, 0, 1, 1, 0, 0], dtype=np.uint8)
    got = judge_resume(before, after, 0, [restart(0, 1, 2, 2)], partial=True)
    assert got["repeated"]["count"] == 0 and got["skipped"] is None and got["verdict"]["ok"]
    # the same part judged as a whole epoch: 6 and 7 skipped (unchanged)
    whole = judge_resume(before, after, 0, [restart(0, 1, 2, 2)])
    assert whole["skipped"] == {"count": 2, "ids": [6, 7]} and not whole["verdict"]["ok"]


def test_a_part_after_a_restart_in_one_process_says_its_repeats(tmp_path):
    """One process, N = 8, batches of 4, in order (no shuffle): a checkpoint's state says 0-3
    were delivered before the stop at step 1; the resumed loop walks the order from its start
    again and stops after its first batch (0-3): all 4 repeated so far, 4-7 not yet come."""
    loader = watch(DataLoader(TensorDataset(torch.arange(8)), batch_size=4), report=None)
    state = loader.__dict__["_sharddemo_watch"]
    before = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.uint8)
    state.load_state_dict({"schema": "sharddemo.watch-state/1", "loader": "train", "epoch": 0,
                           "dataset_size": 8, "previous": None, "before": before,
                           "again": None, "restarts": [], "step": 1, "world_size": 1,
                           "at_edge": False, "unknown_before": False})
    for (ids,) in loader:
        assert ids.tolist() == [0, 1, 2, 3]
        break
    loader.close()
    entry = state.entries[-1]
    assert entry["partial"] and entry["missing"] is None
    resume = entry["resume"]
    assert resume["seen_before"] == 4 and resume["skipped"] is None
    assert resume["repeated"] == {"count": 4, "ids": [0, 1, 2, 3]}
    # 4 before + 4 after = 8 deliveries of 4 distinct samples; 1 step before, 1 after (by hand)
    assert (entry["seen"], entry["unique"], entry["steps"]) == (8, 4, [2])
    assert not entry["ok"] and "FAIL resume-exact: 4 sample(s) delivered again" in entry["line"]
    assert "4 before the stop, 4 repeated so far after the restart" in entry["line"]


def test_a_part_resumed_without_the_watchs_state_says_the_part_before_is_unknown():
    """One process, N = 8: a checkpoint saved for another loader (no usable watch state), then
    one batch of 4 and a stop: the partial entry says the part before the stop is unknown."""
    loader = watch(DataLoader(TensorDataset(torch.arange(8)), batch_size=4), report=None)
    state = loader.__dict__["_sharddemo_watch"]
    with pytest.warns(RuntimeWarning, match="saved for the loader named 'other'"):
        state.load_state_dict({"schema": "sharddemo.watch-state/1", "loader": "other",
                               "epoch": 0, "dataset_size": 8, "previous": None})
    for _ in loader:
        break
    loader.close()
    entry = state.entries[-1]
    assert entry["partial"] and entry["resume"]["unknown_before"]
    assert entry["resume"]["repeated"] is None and entry["resume"]["skipped"] is None
    assert entry["missing"] is None and entry["ok"] and entry["seen"] == 4
    assert "what came before the stop unknown" in entry["line"], entry["line"]
