"""`--mesh` for `compare` and `audit`, with no rank started: the mesh text and the options a
mesh cannot run with refused in one line (exit 2), `pitfalls` adding the world-sampler on a
mesh, and --help naming the option."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from support.launch import FACTORIES, ROOT
from sharddemo.cli import cli
from sharddemo.options import parse_modes

MESH_FACTORIES = str(ROOT / "tests" / "support" / "mesh_factories.py")


def batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[k:k + size] for k in range(0, len(indices), size)]






# -- without ranks: the options refused in one line, before any rank starts ----------------------

def error_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert result.exit_code == 2 and "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("args,words", [
    (["compare", "--mesh", "dp=two"], "--mesh 'dp=two' is not a mesh: give dims as NAME=SIZE"),
    (["compare", "--mesh", "dp=2,dp=2"], "names a dim twice"),
    (["compare", "--mesh", "dp=2,tp=2", "--num-processes", "3"],
     "--mesh dp=2,tp=2 holds 4 ranks but --num-processes is 3"),
    (["compare", "--modes", "world-sampler"], "mode world-sampler is a device mesh's pitfall"),
    (["compare", "--mesh", "dp=2,tp=2", "--source", "iterable"],
     "--mesh runs over a map-style source"),
    (["compare", "--mesh", "dp=2,tp=2", "--modes", "split", "--source", "hf"],
     "mode split is not built on a mesh"),
    (["compare", "--mesh", "dp=2,tp=2", "--gather", "count"], "the count path keeps no batches"),
    (["audit", f"{MESH_FACTORIES}:world_sampler", "--mesh", "tp=x"], "--mesh 'tp=x' is not a mesh"),
    (["audit", f"{MESH_FACTORIES}:world_sampler", "--mesh", "dp=2,tp=2", "--num-processes", "2"],
     "--mesh dp=2,tp=2 holds 4 ranks but --num-processes is 2"),
    (["audit", f"{MESH_FACTORIES}:world_sampler", "--mesh", "dp=2,tp=2", "--resume-at", "0:1"],
     "--resume-at does not run on a mesh yet"),
    (["audit", f"{FACTORIES}:tuple_ids", "--mesh", "dp=2", "--gather", "count"],
     "--gather count keeps none"),
])
def test_mesh_refusals(args, words):
    assert words in error_line(CliRunner().invoke(cli, args))


def test_pitfalls_on_a_mesh_add_the_world_sampler():
    assert parse_modes("pitfalls") == ("double-split", "unseeded")
    assert parse_modes("pitfalls", mesh=True) == ("double-split", "unseeded", "world-sampler")


def test_help_names_the_mesh():
    for command in ("compare", "audit"):
        text = CliRunner().invoke(cli, [command, "--help"]).output
        assert "--mesh DIMS" in text and "init_device_mesh" in text


