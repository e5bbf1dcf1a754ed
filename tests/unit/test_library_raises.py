"""Where a library's exception came from, without ranks: torch re-raises a DataLoader worker's
exception with the worker's traceback, and the frame is still found there; the user's own
dataset raising names no library. A loader raising inside a library on real ranks:
tests/ranks/test_library_raises.py."""

from __future__ import annotations


import pytest
import torch
from support.oracle import torch_collate_error
from support.factories import OneWideSample


# -- torch raising mid-epoch: on every rank (a finding), on one rank (a failed run) -----------


# -- where an exception came from, without ranks -----------------------------------------------

class Corrupt(torch.utils.data.Dataset):
    """The user's own dataset raising: no library's exception."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        raise ValueError(f"corrupt sample {index}")


@pytest.mark.parametrize("workers", [0, 1])
def test_a_library_frame_is_found_in_a_worker_too_and_the_users_code_is_none(workers):
    """torch re-raises a DataLoader worker's exception in the main process with the worker's
    traceback in its message: the frame is read from there. The user's own dataset raising
    is no library's exception (None: a failed run, as before)."""
    from sharddemo.errors import library_error, library_frame

    _, frame = torch_collate_error()  # the frame torch raised from, without workers
    wide = torch.utils.data.DataLoader(OneWideSample(0, (0,), bad=3), batch_size=2,
                                       num_workers=workers)
    with pytest.raises(RuntimeError) as raised:
        list(wide)
    assert library_frame(raised.value) == frame
    said = library_error(raised.value)
    assert said["frame"] == frame and said["error"].endswith(f"(raised in {frame})")
    corrupt = torch.utils.data.DataLoader(Corrupt(), batch_size=2, num_workers=workers)
    with pytest.raises(ValueError) as raised:
        list(corrupt)
    assert library_frame(raised.value) is None and library_error(raised.value) is None
