"""Options are declared once (options.py) and read by one rule on every side: the CLI's click
options are the dataclasses' fields, the rerun line parses back to the same options, the rank
commands take the options file only, the library entry points refuse what the CLI refuses,
and `audit --id-field` and the watch's `id_field` read a batch by one rule (rank.ids)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from sharddemo.cli import cli
from sharddemo.errors import UsageError
from sharddemo.options import (COUNTED_NO_PLOT, AuditOptions, ResumeOptions, RunOptions,
                               command_line, read_rank_options, write_rank_options)


def _params(name: str) -> dict:
    return {p.name: p for p in cli.commands[name].params}


@pytest.mark.parametrize("command,cls", [("run", RunOptions), ("compare", RunOptions),
                                         ("audit", AuditOptions), ("audit", ResumeOptions)])
def test_every_declared_field_is_the_commands_option_with_its_flag_and_default(command, cls):
    params = _params(command)
    declared = [f for f in dataclasses.fields(cls) if "flag" in f.metadata]
    assert declared
    for f in declared:
        assert f.name in params, f"{command} lacks --{f.name}"
        param = params[f.name]
        flags = f.metadata["flag"].split("/")
        assert flags[0] in param.opts, (param.opts, flags)
        assert param.default == f.default, f.name
        assert param.help == f.metadata["help"]


@pytest.mark.parametrize("command", ["audit-rank", "resume-rank", "resume-demo-rank"])
def test_the_rank_commands_take_the_options_file_and_no_option_of_their_own(command):
    assert set(_params(command)) == {"options_file", "device", "trace_out", "quiet"}
    assert cli.commands[command].hidden


runs = st.builds(
    RunOptions,
    dataset_size=st.integers(1, 10**7), batch_size=st.integers(1, 512),
    epochs=st.integers(1, 5), seed=st.integers(0, 2**31 - 1),
    modes=st.sampled_from([("prepared",), ("sampler", "replicated"), ("double-split",)]),
    shuffle=st.booleans(), drop_last=st.booleans(), set_epoch=st.booleans(),
    num_workers=st.integers(0, 4), shards=st.integers(1, 9), even_batches=st.booleans(),
    split_batches=st.booleans(), dispatch_batches=st.sampled_from([None, True, False]),
    gather=st.sampled_from(["auto", "batch", "epoch", "count"]),
    timeout=st.sampled_from([60.0, 5.0, 0.5, 120.0]))


@settings(max_examples=60, deadline=None)
@given(runs)
def test_the_rerun_line_parses_back_to_the_same_options(opts):
    """command_line(opts) typed after `sharddemo run --modes ...` gives these options again
    (click parses it; nothing of the run starts)."""
    args = ["--modes", ",".join(opts.modes), *command_line(opts)]
    ctx = cli.commands["run"].make_context("run", args)
    parsed = {k: v for k, v in ctx.params.items() if k != "modes" and k in {
        f.name for f in dataclasses.fields(RunOptions)}}
    assert RunOptions(**parsed, modes=opts.modes) == opts


@settings(max_examples=30, deadline=None)
@given(runs)
def test_the_options_file_gives_the_ranks_the_same_options(tmp_path_factory, opts):
    path = tmp_path_factory.mktemp("o") / "options.json"
    write_rank_options(str(path), {"run": opts.to_dict(), "phase": "stop"})
    got = read_rank_options(str(path))
    assert got["run"] == opts and got["phase"] == "stop"


def test_the_library_refuses_a_counted_plot_with_the_clis_line(tmp_path):
    """The refusal lives in options.validate_compare: the CLI and compare_run say the same."""
    from sharddemo.commands.compare import compare_run

    opts = RunOptions(dataset_size=1_000_000, modes=("prepared",)).validate()
    with pytest.raises(UsageError) as caught:
        compare_run(opts, plot=True)
    assert str(caught.value) == COUNTED_NO_PLOT
    result = CliRunner().invoke(cli, ["compare", "--dataset-size", "1000000",
                                      "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2 and f"Error: {COUNTED_NO_PLOT}" in result.output


# -- one id reader ---------------------------------------------------------------------------

def _audit_reader(field):
    from torch.utils.data import DataLoader

    from sharddemo.rank.audit import id_reader

    return id_reader(DataLoader(range(4)), field)


def _watch_reader(field):
    from sharddemo.watching.recording import read_field

    return lambda batch, tag: read_field(batch, field)


@pytest.mark.parametrize("reader,error", [(_audit_reader, UsageError),
                                          (_watch_reader, ValueError)])
def test_audit_and_the_watch_read_an_id_field_by_one_rule(reader, error):
    # a dict's key; a tuple's position (int or digits); "." the batch itself
    assert reader("id")({"id": torch.tensor([3, 1])}, None).tolist() == [3, 1]
    assert reader("1")((torch.zeros(2), torch.tensor([5, 6])), None).tolist() == [5, 6]
    assert reader(".")(torch.tensor([[7], [2]]), None).tolist() == [7, 2]
    # floats that are whole are ids; fractions and bools are not
    assert reader("id")({"id": torch.tensor([4.0, 0.0])}, None).tolist() == [4, 0]
    with pytest.raises(error, match="not whole numbers"):
        reader("id")({"id": torch.tensor([0.5])}, None)
    with pytest.raises(error, match="torch.bool"):
        reader("id")({"id": torch.tensor([True])}, None)
    # a missing field is named with the fields the batch has
    with pytest.raises(error, match=r"no field 'nope'; they have 'x', 'y'"):
        reader("nope")({"x": torch.tensor([0]), "y": torch.tensor([1])}, None)
    with pytest.raises(error, match=r"no position 5; they have positions 0..1"):
        reader("5")((torch.tensor([0]), torch.tensor([1])), None)
