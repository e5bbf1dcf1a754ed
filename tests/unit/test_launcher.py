"""The launcher's refusal of a process alone where the launcher's environment asked for
more (validate_not_alone), read from the environment in this process. The launcher itself:
tests/ranks/test_launcher.py."""

from __future__ import annotations


import pytest


@pytest.mark.parametrize("env,alone", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, True),           # torchrun said 2, the process group has 1
    ({"MASTER_PORT": "29500", "ACCELERATE_MIXED_PRECISION": "no"}, True),  # plain launcher asked for >1, started 1
    ({"MASTER_PORT": "29500"}, False),                   # a SLURM job's export, plain `python`
    ({"SHARDDEMO_EXPECT_WORLD_SIZE": "3"}, True),        # compare asked for 3
    ({}, False),                                         # a plain `sharddemo run`: world size 1 is fine
    ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_PORT": "1"}, False),  # torchrun with one process
])
def test_check_not_alone_from_the_launchers_environment(monkeypatch, env, alone):
    from sharddemo.errors import UsageError
    from sharddemo.rank.session import validate_not_alone

    for key in ("WORLD_SIZE", "RANK", "MASTER_PORT", "SHARDDEMO_EXPECT_WORLD_SIZE",
                "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if alone:
        with pytest.raises(UsageError, match="but this process is alone .world size 1."):
            validate_not_alone(1)
    else:
        validate_not_alone(1)
    validate_not_alone(3)  # three real ranks always pass
