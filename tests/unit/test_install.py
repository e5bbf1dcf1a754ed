"""The configs ship inside the package: the packaged configs are the top-level ones, and
`sharddemo configs` lists each. The wheel installed and run from outside the checkout:
tests/ranks/test_install.py."""

from __future__ import annotations


from support.launch import ROOT

PACKAGE_CONFIGS = ROOT / "src" / "sharddemo" / "configs"


def test_packaged_configs_are_the_top_level_ones():
    top = {p.name: p.read_bytes() for p in (ROOT / "accelerate_configs").glob("*.yaml")}
    packaged = {p.name: p.read_bytes() for p in PACKAGE_CONFIGS.glob("*.yaml")}
    assert top and packaged == top


def test_configs_lists_every_shipped_config():
    from click.testing import CliRunner

    from sharddemo.cli import cli

    result = CliRunner().invoke(cli, ["configs"])
    assert result.exit_code == 0
    listed = [line.split()[0] for line in result.output.splitlines()]
    assert listed == sorted(p.name for p in PACKAGE_CONFIGS.glob("*.yaml"))
