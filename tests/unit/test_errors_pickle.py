"""An error sharddemo raises inside a worker process reaches the process that started it:
Ray Train (and multiprocessing) pickle a worker's exception to send it back, and an exception
whose __init__ takes more than the message did not unpickle (Ray then reported a failed
health check, not the ShardingViolation)."""

from __future__ import annotations

import pickle

from sharddemo.errors import CollectiveFailed, ShardingViolation


def test_a_sharding_violation_pickles_with_its_entry():
    entry = {"epoch": 1, "ok": False}
    back = pickle.loads(pickle.dumps(ShardingViolation("epoch 1 train: FAIL", entry)))
    assert type(back) is ShardingViolation
    assert (str(back), back.entry) == ("epoch 1 train: FAIL", entry)


def test_a_failed_collective_pickles_with_its_kind():
    back = pickle.loads(pickle.dumps(CollectiveFailed("gather timed out", "timeout")))
    assert type(back) is CollectiveFailed
    assert (str(back), back.kind) == ("gather timed out", "timeout")
