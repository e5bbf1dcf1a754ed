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


def test_the_litdata_extras_hint_keeps_the_installed_torch():
    """litdata needs torchvision, whose newest wheel brings a newer torch (docs/frameworks.md):
    the hint names the installed torch (importlib.metadata's version, the local build tag
    dropped) and a torchvision built for it, in the same command; other extras get none."""
    from importlib.metadata import version

    from sharddemo.extras import install_hint

    torch_version = version("torch").split("+")[0]
    hint = install_hint("litdata")
    assert hint.startswith(f"pip install 'sharddemo[litdata]' torch=={torch_version} "
                           f"torchvision==<the one built for torch {torch_version}>")
    assert install_hint("webdataset") == ("pip install 'sharddemo[webdataset]' (from a "
                                          "checkout: pip install -e '.[webdataset]')")
