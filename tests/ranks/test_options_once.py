"""The library entry point (`sharddemo.testing.audit`) refuses the resume options without
--resume-at with the CLI's own line (the other options-once checks, in one process:
tests/unit/test_options_once.py)."""

from __future__ import annotations


import pytest
from click.testing import CliRunner

from sharddemo.cli import cli
from sharddemo.errors import UsageError
from sharddemo.options import (AuditOptions)


def test_the_library_refuses_resume_options_without_resume_at_like_the_cli():
    from sharddemo.testing import audit

    line = "--resume-num-processes and --keep-checkpoint go with --resume-at EPOCH:STEP"
    from sharddemo.commands.audit import audit_run

    with pytest.raises(UsageError, match=line):
        audit_run(AuditOptions(target="examples/good.py:make_loader"), resume_num_processes=3)
    result = CliRunner().invoke(cli, ["audit", "examples/good.py:make_loader",
                                      "--resume-num-processes", "3"])
    assert result.exit_code == 2 and line in result.output
    # and sharddemo.testing.audit validates as the CLI does
    with pytest.raises(UsageError, match="--epochs must be at least 1, got 0"):
        audit("examples/good.py:make_loader", epochs=0)
