"""A factory of a litdata loader for `sharddemo audit`, importing litdata at its top, as a user's
file does (tests/ranks/test_extras.py: with litdata hidden, the audit refuses it in one line,
naming the extra `[litdata]`, before any rank starts). Run with litdata installed, it reads the
dataset litdata's writer left in $SHARDDEMO_TEST_LITDATA (ids 0..N-1 under "id")."""

import os

from litdata import StreamingDataLoader, StreamingDataset


def split(accelerator):
    return StreamingDataLoader(StreamingDataset(os.environ["SHARDDEMO_TEST_LITDATA"],
                                                shuffle=True), batch_size=4)
