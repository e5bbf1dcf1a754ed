"""Two "machines" without a launch: --machine-rank without --num-machines is refused, and
the two-node configs load. The launch itself: tests/ranks/test_multinode.py."""

from __future__ import annotations


from support.launch import ROOT


def test_machine_rank_without_multinode_is_refused():
    from click.testing import CliRunner

    from sharddemo.cli import cli

    result = CliRunner().invoke(cli, ["compare", "--machine-rank", "1"])
    assert result.exit_code == 2
    assert result.output.strip() == ("Error: --machine-rank 1 needs a multi-node launch: "
                                     "pass --num-machines")
    result = CliRunner().invoke(cli, ["compare", "--num-machines", "2", "--num-processes", "4"])
    assert result.exit_code == 2
    assert "needs --main-process-ip and --main-process-port" in result.output


def test_two_node_configs_load():
    from sharddemo.config import load_config

    for rank in (0, 1):
        config = load_config(str(ROOT / "accelerate_configs" / f"2node-2gpu-rank{rank}.yaml"))
        assert config.num_machines == 2 and config.num_processes == 4
        assert config.raw["machine_rank"] == rank
