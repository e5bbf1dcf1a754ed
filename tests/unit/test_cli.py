"""The CLI in-process (CliRunner): help text, and bad input answered with one `Error:` line,
exit code 2 and no traceback, before any rank is started."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from sharddemo.cli import cli

ROOT = Path(__file__).resolve().parents[2]


def invoke(args):
    return CliRunner().invoke(cli, args)


def error_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got: {result.output!r}"
    assert lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("command", ["run", "compare"])
@pytest.mark.parametrize("args,message", [
    (["--dataset-size", "0"], "Error: --dataset-size must be at least 1, got 0"),
    (["--dataset-size", "-3"], "Error: --dataset-size must be at least 1, got -3"),
    (["--batch-size", "0"], "Error: --batch-size must be at least 1, got 0"),
    (["--epochs", "0"], "Error: --epochs must be at least 1, got 0"),
    (["--num-workers", "-1"], "Error: --num-workers must be 0 or more, got -1"),
    (["--timeout", "0"], "Error: --timeout must be a positive number of seconds, got 0.0"),
])
def test_bad_numbers(command, args, message):
    result = invoke([command, *args])
    assert result.exit_code == 2
    assert error_line(result).startswith(message)


@pytest.mark.parametrize("command,flag", [("run", "--mode"), ("compare", "--modes")])
def test_unknown_mode(command, flag):
    result = invoke([command, flag, "prepared,bogus"])
    assert result.exit_code == 2
    assert error_line(result) == (
        "Error: unknown mode 'bogus'; choose 'all', 'pitfalls' or a comma list of: prepared, "
        "sampler, replicated, double-split, unseeded, split, resume, no-nodesplitter, silenced, "
        "resampled, uneven-shards, world-sampler")


def test_unknown_format():
    result = invoke(["compare", "--format", "yaml"])
    assert result.exit_code == 2
    line = error_line(result)
    assert "Invalid value for '--format'" in line and "'yaml' is not one of" in line


def test_unknown_option_is_one_line():
    result = invoke(["compare", "--frobnicate"])
    assert result.exit_code == 2
    assert "No such option '--frobnicate'" in error_line(result)


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    ("a: [1, 2\n", "is not valid YAML"),
    ("- just\n- a list\n", "is not a YAML mapping"),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\nnum_gpus: 2\n", "unknown key(s): num_gpus"),
    ("distributed_type: MULTI_GPU\nnum_processes: 0\n", "asks for num_processes: 0"),
])
def test_bad_config_file(tmp_path, content, message):
    path = tmp_path / "config.yaml"
    if content is not None:
        path.write_text(content)
    result = invoke(["compare", "--config-file", str(path)])
    assert result.exit_code == 2
    line = error_line(result)
    assert line.startswith(f"Error: config file {path} ") and message in line


def test_num_processes_zero():
    result = invoke(["compare", "--num-processes", "0"])
    assert result.exit_code == 2
    assert error_line(result) == "Error: --num-processes must be at least 1, got 0"


def test_output_that_is_a_directory(tmp_path):
    result = invoke(["compare", "--output", str(tmp_path)])
    assert result.exit_code == 2
    assert "Invalid value for '--output'" in error_line(result) and "is a directory" in result.output


def test_unwritable_output_missing_directory(tmp_path):
    result = invoke(["compare", "--output", str(tmp_path / "nope" / "r.json")])
    assert result.exit_code == 2
    assert error_line(result).startswith(f"Error: --output {tmp_path / 'nope' / 'r.json'} cannot be written")


def test_every_command_has_help_and_is_documented():
    readme = (ROOT / "README.md").read_text()
    for name, command in cli.commands.items():
        if command.hidden:  # internal: the rank side of `audit`
            continue
        result = invoke([name, "--help"])
        assert result.exit_code == 0
        assert command.help and "Example:" in command.help, name
        assert f"sharddemo {name}" in readme, f"README does not show `sharddemo {name}`"


def test_config_keys_are_accelerates_own():
    import dataclasses

    from accelerate.commands.config.config_args import ClusterConfig

    from sharddemo.config import known_keys

    assert known_keys() == {f.name for f in dataclasses.fields(ClusterConfig)}


def test_shipped_configs_load():
    from sharddemo.config import load_config

    for name in ("cpu2.yaml", "2gpu.yaml"):
        config = load_config(str(ROOT / "accelerate_configs" / name))
        assert config.num_processes == 2 and config.num_machines == 1
        assert config.distributed_type == "MULTI_GPU"


@pytest.mark.parametrize("args,message", [
    (["--split-batches", "--batch-size", "3"],
     "Error: --split-batches slices each batch of 3 across 2 ranks, so the batch size must "
     "divide by 2; use --batch-size 2 or drop --split-batches"),
    (["--modes", "split"], "Error: mode split uses the source's own split: pass --source hf, "
                           "hf-stream or webdataset"),
    (["--modes", "sampler", "--source", "iterable"],
     "Error: mode sampler needs a map-style dataset (a sampler draws indices), but --source "
     "iterable is iterable; use --source toy or hf, or --modes prepared,replicated"),
    (["--source", "hf-stream"],  # the default modes begin with sampler
     "Error: mode sampler needs a map-style dataset (a sampler draws indices), but --source "
     "hf-stream is iterable; use --source toy or hf, or --modes prepared,replicated,split"),
    (["--shards", "0", "--source", "hf-stream"], "Error: --shards must be at least 1, got 0"),
    (["--modes", "resume", "--epochs", "2"],
     "Error: mode resume always walks epochs 0..2 with 0 and 2 workers and gathers every batch, "
     "so --epochs does not apply; drop it, or audit your own loader: sharddemo audit "
     "FILE.py:make_loader --resume-at EPOCH:STEP --epochs N"),
    (["--modes", "resume", "--num-workers", "0", "--gather", "batch"],
     "Error: mode resume always walks epochs 0..2 with 0 and 2 workers and gathers every batch, "
     "so --num-workers and --gather do not apply; drop them, or audit your own loader: sharddemo "
     "audit FILE.py:make_loader --resume-at EPOCH:STEP --epochs N"),
])
def test_scenario_options_bad_input(args, message):
    result = invoke(["compare", *args])
    assert result.exit_code == 2
    assert error_line(result) == message


def test_unknown_source():
    result = invoke(["run", "--source", "hub"])
    assert result.exit_code == 2
    assert "Invalid value for '--source'" in error_line(result)


def test_trap_needs_two_processes():
    result = invoke(["trap", "--num-processes", "1"])
    assert result.exit_code == 2
    assert error_line(result) == "Error: --num-processes must be at least 2 to show the trap, got 1"


def test_license_is_shipped():
    from support.launch import ROOT

    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert "license_files = LICENSE" in (ROOT / "setup.cfg").read_text()


@pytest.mark.parametrize("command", ["run", "compare"])
def test_run_and_compare_take_the_same_modes_option(command):
    """One spelling, `--modes`, on both; `--mode` is kept as its alias."""
    from click.testing import CliRunner

    from sharddemo.cli import cli

    text = CliRunner().invoke(cli, [command, "--help"]).output
    assert "--modes, --mode" in text
    for spelling in ("--modes", "--mode"):
        result = CliRunner().invoke(cli, [command, spelling, "nope"])
        assert result.exit_code == 2 and "unknown mode 'nope'" in result.output


def test_run_refuses_the_resume_mode():
    from click.testing import CliRunner

    from sharddemo.cli import cli

    result = CliRunner().invoke(cli, ["run", "--modes", "resume"])
    assert result.exit_code == 2 and "only compare can do" in result.output


@pytest.mark.parametrize("args,message", [
    # 10,000,000 samples x 1 byte = 9.5 MiB of counter per rank: more than 5 MB.
    (["--dataset-size", "10000000", "--max-memory", "5MB"],
     "Error: --max-memory 5 MB is less than the count path's counter of 10,000,000 samples "
     "needs, about 10 MB per rank"),
    # From 2^26 samples 2 bits a sample: 10^9 / 4 bytes = 238.4 MiB per rank, more than 200 MB.
    (["--dataset-size", "1000000000", "--max-memory", "200MB"],
     "Error: --max-memory 200 MB is less than the count path's counter of 1,000,000,000 "
     "samples needs, about 238 MB per rank"),
    # --gather epoch ships every id to rank 0: 40 bytes x 10^8 x 2 ranks = 7,629 MiB > 2 GB.
    (["--dataset-size", "100000000", "--gather", "epoch", "--max-memory", "2GB"],
     "Error: --max-memory 2,048 MB is less than every id of an epoch of 100,000,000 samples "
     "(--gather epoch) needs, about 7,629 MB on rank 0"),
    # From 16 ranks on the code reduced is uint16 (2 bytes) beside the 1-byte counter:
    # 3 x 10^7 bytes = 28.6 MiB; above 255 ranks uint32: 5 x 10^7 bytes = 47.7 MiB.
    (["--dataset-size", "10000000", "--num-processes", "16", "--max-memory", "20MB"],
     "Error: --max-memory 20 MB is less than the count path's counter of 10,000,000 samples "
     "needs, about 29 MB per rank"),
    (["--dataset-size", "10000000", "--num-processes", "256", "--max-memory", "40MB"],
     "Error: --max-memory 40 MB is less than the count path's counter of 10,000,000 samples "
     "needs, about 48 MB per rank"),
    (["--max-memory", "lots"], "Error: --max-memory 'lots' is not a size"),
])
def test_max_memory_refuses_before_any_rank_starts(args, message):
    result = invoke(["compare", *args])
    assert result.exit_code == 2
    assert error_line(result).startswith(message)


def test_plot_of_a_counted_run_is_refused_before_it_starts(tmp_path):
    result = invoke(["compare", "--dataset-size", "2000000", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2
    assert "pass --gather epoch to draw it" in error_line(result)


def test_a_rank_process_ends_without_the_interpreter_teardown(monkeypatch):
    """Inside a launched rank (RANK and WORLD_SIZE set) the CLI ends the process with
    os._exit and the command's exit code, after flushing (docs/reliability.md: a native thread
    left behind by transformers or Lightning can abort the teardown); elsewhere sys.exit."""
    import os

    from sharddemo import cli

    ended = []

    def fake_exit(code):
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        cli.cli.main(["configs"])
    assert ended == [0]
    monkeypatch.delenv("RANK")
    with pytest.raises(SystemExit) as exc:
        cli.cli.main(["configs"])
    assert ended == [0] and exc.value.code == 0


# -- the large-report warning, before any rank starts --------------------------------------------

LARGE_RUN = ["--source", "iterable", "--modes", "replicated,prepared", "--num-processes", "3",
         "--dataset-size", "1000003", "--batch-size", "8", "--epochs", "3", "--gather", "batch"]


def stopped_at_the_launch(monkeypatch, module: str) -> list:
    """The command's launch replaced by one that fails at once (no rank starts): what was on
    stderr when it was called is what the command said before its launch."""
    import sharddemo.commands.audit
    import sharddemo.commands.compare
    from sharddemo.errors import RunFailed

    calls = []

    def launch(*args, **kwargs):
        calls.append(args)
        raise RunFailed("stopped by the test at the launch")

    target = {"compare": sharddemo.commands.compare, "audit": sharddemo.commands.audit}[module]
    monkeypatch.setattr(target, "run_launch", launch)
    return calls


@pytest.mark.parametrize("fmt,output", [("json", None), ("table", "r.json"),
                                        ("json", "r.json")])
def test_a_large_report_is_announced_before_the_launch(tmp_path, monkeypatch, fmt, output):
    """A stream of a million samples on 3 ranks, 3 epochs: every id of every batch and its
    gathers, hundreds of MB of JSON. One Warning line before the launch, with the way out that
    applies (the count path; --output where it would all be printed); then the launch (here it
    fails at once)."""
    calls = stopped_at_the_launch(monkeypatch, "compare")
    path = tmp_path / "r.json"
    more = ["--output", str(path)] if output else []
    result = invoke(["compare", *LARGE_RUN, "--format", fmt, *more])
    assert result.exit_code == 1 and len(calls) == 1
    warning, error = result.stderr.splitlines()
    assert error == "Error: stopped by the test at the launch"
    what = (r"\(every id of 3 epoch\(s\) of 1,000,003 samples on 3 ranks, as each rank "
            r"received it, each batch's gather too\)")
    if output:
        expected = rf"Warning: the report written to {re.escape(str(path))} will be about [\d,]+ MB {what}"
    else:
        expected = (rf"Warning: the JSON report will be about [\d,]+ MB {what}, all of it "
                    r"printed: --output FILE writes it to the file and prints a summary")
    assert re.fullmatch(expected + "; --gather count keeps it to a few hundred KB", warning), warning
    # 3 x (the ids of 3 ranks' copies, their gathers, a duplicate entry per sample, the
    # prepared loader's ids, its gathers and gather_for_metrics): well above 10 MB
    assert int(re.search(r"about ([\d,]+) MB", warning).group(1).replace(",", "")) > 100


@pytest.mark.parametrize("args", [
    ["--format", "table"],  # the table prints an excerpt whatever N
    ["--format", "json", "--gather", "count"],  # the count path lists at most 1,000 ids
    ["--format", "json", "--dataset-size", "1000"],
])
def test_no_warning_where_nothing_large_is_printed_or_written(monkeypatch, args):
    stopped_at_the_launch(monkeypatch, "compare")
    given = dict(zip(LARGE_RUN[::2], LARGE_RUN[1::2]))
    given.update(dict(zip(args[::2], args[1::2])))
    result = invoke(["compare", *[w for pair in given.items() for w in pair]])
    assert result.stderr == "Error: stopped by the test at the launch\n"


def test_a_large_audit_report_is_announced_before_the_launch(monkeypatch):
    """audit knows N from --dataset-size: 3 epochs of 5,000,000 ids gathered once per epoch
    on 2 ranks."""
    stopped_at_the_launch(monkeypatch, "audit")
    result = invoke(["audit", "examples/good.py:make_loader", "--dataset-size", "5000000",
                     "--epochs", "3", "--gather", "epoch", "--format", "json"])
    warning = result.stderr.splitlines()[0]
    assert warning.startswith("Warning: the JSON report will be about ") and (
        "3 epoch(s) of 5,000,000 samples on 2 ranks" in warning), warning
    assert warning.endswith("--gather count keeps it to a few hundred KB")
