"""A WebDataset worker's error of several lines, re-raised by torch's DataLoader, is kept whole
on one line. WebDataset loaders audited on real ranks: tests/ranks/test_webdataset.py."""

from __future__ import annotations

import sys

import pytest
from support.launch import ROOT


wds = pytest.importorskip("webdataset")
sys.path.insert(0, str(ROOT / "examples"))


# -- compare --source webdataset: sharddemo's own five WebDataset modes ------------------------
# The source writes N samples in order, sample i keyed "sample{i:06d}" with id i, into COUNT
# shards whose sizes differ by at most one (the first N % COUNT one larger): the layout the
# docs state. The test writes the same layout and asks WebDataset's own pipeline what each
# rank and worker reads.


def test_a_worker_error_of_several_lines_is_kept_whole_on_one_line():
    """torch's DataLoader re-raises a worker's error with the worker's traceback in the
    message; WebDataset's empty_check error is two lines. Raised for real by torch here: a
    DataLoader with one worker over a pipeline with no shard for it."""
    from torch.utils.data import DataLoader

    from sharddemo.errors import describe_exception

    # a worker with no shard: the stage WebDataset(empty_check=True) ends its pipeline with
    pipeline = wds.DataPipeline(lambda: iter(()), wds.compat.check_empty)
    with pytest.raises(ValueError) as raised:
        next(iter(DataLoader(pipeline, batch_size=None, num_workers=1)))
    assert "Original Traceback" in str(raised.value)
    line = describe_exception(raised.value)
    assert "\n" not in line and line.startswith("ValueError: Caught ValueError in DataLoader")
    assert ("No samples found in dataset; perhaps you have fewer shards than workers. Turn off "
            "using empty_check=False") in line
    assert "at least ranks x workers shards" in line
