"""The launcher itself, in a subprocess, every rank's stderr shown when it fails."""

from __future__ import annotations

import json
import re
import sys

import pytest

from support.launch import ROOT, accelerate_launch, launch_env, run_cmd, sharddemo


def test_accelerate_launch_run_all_on_cpu2_config():
    proc = accelerate_launch(["-m", "sharddemo", "run", "--mode", "all"])
    out = proc.stdout
    assert "world size 2 (MULTI_CPU, backend gloo, device cpu)" in out
    assert "per-rank batch 4 | global batch 8 | dataset 8" in out
    for mode in ("prepared", "sampler", "replicated"):
        assert f"== mode {mode}:" in out
    totals = re.findall(r"^total (\d+) = (\S+)x the dataset of 8$", out, re.M)
    # 3 modes x 2 epochs: sharded modes 8 = 1x, replicated 16 = 2x.
    assert totals == [("8", "1")] * 4 + [("16", "2")] * 2, out
    # Only the main process prints: each rank's batch lines appear once, labelled.
    rank_lines = re.findall(r"^\[rank (\d)/2\] batch \d+: \[[\d, ]+\]$", out, re.M)
    assert sorted(set(rank_lines)) == ["0", "1"]
    assert len(rank_lines) == 2 * (1 + 1) * 2 + 2 * 2 * 2  # sharded: 1 batch; replicated: 2


def test_run_states_the_batch_of_a_mode_split_batches_does_not_slice():
    """`run --split-batches -B 6`: the header gives the run's arithmetic (accelerate's slice of 3
    per rank); the sampler mode's DataLoader, which accelerate does not prepare, hands each
    rank the whole batch, and `run` says so before its batches. B comes from the DataLoader
    torch builds for that mode (tests/support/oracle.py), the steps from its length."""
    from support.oracle import Case, _dataset, _distributed

    proc = accelerate_launch(["-m", "sharddemo", "run", "--mode", "sampler", "--split-batches",
                              "--batch-size", "6", "--dataset-size", "17", "--epochs", "1"])
    case = Case("sampler", 17, 6, 2, split_batches=True, epochs=1)
    loaders = [_distributed(_dataset(case), case, r)[0] for r in range(2)]
    b = loaders[0].batch_size
    out = proc.stdout
    assert "per-rank batch 3 | global batch 6 | dataset 17" in out  # the run's, as given
    line = f"this loader: per-rank batch {b}, global batch {2 * b} (not prepared"
    assert out.index("== mode sampler:") < out.index(line) < out.index("epoch 0"), out
    for r, loader in enumerate(loaders):
        sizes = [len(x) for x in loader]
        got = re.findall(rf"^\[rank {r}/2\] batch \d+: \[([\d, ]+)\]$", out, re.M)
        assert [len(g.split(", ")) for g in got] == sizes, out


def test_the_silent_one_process_trap_is_refused():
    # `accelerate launch --cpu --num_processes 2` starts ONE process (accelerate issue 2741).
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "sharddemo", "run"]
    proc = run_cmd(cmd, check=False, timeout=120)
    assert proc.returncode != 0
    assert ("Error: launched for several processes but this process is alone (world size 1)"
            in proc.stderr)
    assert "accelerate_configs/cpu2.yaml" in proc.stderr
    assert "== mode" not in proc.stdout, "it must not print a wrong answer first"


def test_compare_json_on_three_ranks(tmp_path):
    out = tmp_path / "report.json"
    proc = sharddemo(["compare", "--num-processes", "3", "--dataset-size", "10",
                      "--batch-size", "3", "--format", "json"])
    printed = json.loads(proc.stdout)
    proc = sharddemo(["compare", "--num-processes", "3", "--dataset-size", "10",
                      "--batch-size", "3", "--format", "json", "--output", str(out)])
    written = json.loads(out.read_text())
    strip = lambda r: {k: v for k, v in r.items() if k != "timings"}
    assert strip(printed) == strip(written)
    import jsonschema

    schema = json.loads((ROOT / "docs" / "report.schema.json").read_text())
    jsonschema.validate(written, schema)
    # with --output, a summary is printed instead (docs/summary.schema.json)
    summary = json.loads(proc.stdout)
    jsonschema.validate(summary, json.loads((ROOT / "docs" / "summary.schema.json").read_text()))
    assert summary["report"] == str(out) and summary["bytes"] == out.stat().st_size
    assert {m: d["conclusion"] for m, d in summary["modes"].items()} == {
        m: d["conclusion"] for m, d in written["modes"].items()}
    assert written["schema"] == "sharddemo.report/1"
    assert written["world_size"] == 3 and written["backend"] == "gloo"
    prepared = written["modes"]["prepared"]["epochs"][0]
    # K = ceil(10/3) = 4 global batches over 3 ranks: 2 rounds of 3 x 3 = 18 ids.
    assert [r["steps"] for r in prepared["ranks"]] == [2, 2, 2]
    assert len(prepared["gathered"]) == 18 and len(prepared["gathered_for_metrics"]) == 10
    assert prepared["gather_for_metrics_exact"] is True
    sampler = written["modes"]["sampler"]["epochs"][0]
    assert sampler["seen"] == 12 and sum(d["count"] - 1 for d in sampler["duplicates"]) == 2
    assert written["modes"]["replicated"]["epochs"][0]["seen"] == 30
    assert "--num_processes 3" in written["launch_command"]
    assert written["broken_promises"] == []


def test_compare_table_default_shows_the_reference_finding():
    proc = sharddemo(["compare", "--check"])
    out = proc.stdout
    assert "world size 2 (MULTI_CPU, backend gloo)" in out
    assert "rerun by hand: accelerate launch --config_file accelerate_configs/cpu2.yaml" in out
    assert out.count("seen 8 = 1x the dataset") == 4
    assert out.count("seen 16 = 2x the dataset") == 2
    assert "gather_for_metrics 8 (exactly the dataset)" in out


def test_compare_is_reproducible_byte_for_byte(tmp_path):
    """Twice the same seed: once printed (--format json), once written (--output)."""
    out = tmp_path / "b.json"
    printed = sharddemo(["compare", "--format", "json", "--seed", "5"]).stdout
    sharddemo(["compare", "--format", "json", "--output", str(out), "--seed", "5"])
    strip = lambda text: {k: v for k, v in json.loads(text).items() if k != "timings"}
    assert strip(printed) == strip(out.read_text())


# -- --output: the file first, whole; a summary printed in its place

REPORT_SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


@pytest.mark.parametrize("fmt,args", [
    ("table", ["compare", "--modes", "pitfalls", "--dataset-size", "10", "--batch-size", "2",
               "--no-shuffle", "--check"]),
    ("markdown", ["audit", "examples/no_set_epoch.py:make_loader"]),
])
def test_output_writes_the_report_and_prints_a_summary_in_its_place(tmp_path, fmt, args):
    """With --output the whole report goes to the file and stdout gets a few lines: the
    header, each mode's conclusion, its verdicts and broken promises, and where the file is;
    no rank's batches (--format json: test_compare_json_on_three_ranks)."""
    import jsonschema

    out = tmp_path / "report.json"
    proc = sharddemo([*args, "--format", fmt, "--output", str(out)], check=False)
    assert proc.returncode == 1, proc.stderr  # broken promises; a failed verdict
    report = json.loads(out.read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    lines = proc.stdout.splitlines()
    for data in report["modes"].values():
        assert any(data["conclusion"] in line for line in lines)
        for problem in data["broken_promises"]:
            assert any(problem in line for line in lines)
        for v in data.get("verdicts", []):
            assert any(v["verdict"] in line and line.strip("- ").startswith(
                "PASS" if all(w["ok"] for w in data["verdicts"] if w["verdict"] == v["verdict"])
                else "FAIL") for line in lines)
    assert str(out) in lines[-1] and f"{out.stat().st_size / 1024:,.0f} KB" in lines[-1]
    # the header (markdown: and its title), a line per mode, verdict and broken promise, and
    # where the file is: nothing per rank or epoch
    expected = (2 if fmt == "table" else 3) + sum(
        1 + len({v["verdict"] for v in data.get("verdicts", [])}) + len(data["broken_promises"])
        for data in report["modes"].values())
    assert len([line for line in lines if line.strip()]) == expected, proc.stdout
    # no rank's batches: the table's `rank 0  2 step(s): [...]`, the markdown's table of them
    assert "step(s): [" not in proc.stdout and "| epoch | rank |" not in proc.stdout


def test_output_is_written_whole_before_anything_is_printed(tmp_path):
    """stdout a pipe nobody reads (closed): printing fails, the file is there all the same.
    (The report used to be printed first and the file never written.)"""
    import os
    import subprocess

    import jsonschema

    out = tmp_path / "report.json"
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "sharddemo", "compare", "--dataset-size",
                               "10", "--batch-size", "3", "--output", str(out)], cwd=ROOT,
                              env=launch_env(), stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=180)
    finally:
        os.close(write)
    assert proc.returncode == 1  # click's answer to a broken pipe: exit 1, nothing said
    report = json.loads(out.read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    assert list(report["modes"]) == ["prepared", "sampler", "replicated"]
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left


@pytest.mark.parametrize("args", [
    # indented JSON (N <= 10,000), every batch gathered, the reference's three modes
    ["--dataset-size", "3001", "--gather", "batch"],
    # compact JSON, once per epoch; a replicated stream and a prepared one on 3 ranks
    ["--dataset-size", "12001", "--gather", "epoch", "--source", "iterable", "--modes",
     "replicated,prepared", "--num-processes", "3"],
])
def test_the_report_size_estimated_before_the_launch_is_the_files(tmp_path, args):
    """The estimate the large-report warning is made from (reportsize), against the size of
    the report the run really writes: within 10%."""
    from sharddemo.options import RunOptions
    from sharddemo.reportsize import compare_report_bytes

    out = tmp_path / "report.json"
    sharddemo(["compare", "--batch-size", "8", "--epochs", "1", *args, "--output", str(out)])
    report = json.loads(out.read_text())
    given = dict(zip(args[::2], args[1::2]))
    opts = RunOptions(dataset_size=int(given["--dataset-size"]), batch_size=8, epochs=1,
                      gather=given["--gather"], source=given.get("--source", "toy"),
                      modes=tuple(given.get("--modes", "prepared,sampler,replicated")
                                  .split(",")))
    estimate = compare_report_bytes(opts, report["world_size"])
    assert abs(estimate - out.stat().st_size) < 0.1 * out.stat().st_size, (
        estimate, out.stat().st_size)


def test_compare_pitfalls_fail_the_check():
    proc = sharddemo(["compare", "--modes", "pitfalls", "--dataset-size", "10", "--batch-size",
                      "2", "--no-shuffle", "--check"], check=False)
    assert proc.returncode == 1, proc.stderr
    assert "double-split epoch 0: 4 sample(s) never seen: [1, 4, 6, 9]" in proc.stdout
    assert "why missing: double split" in proc.stdout
    error = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1 and error[0].startswith("Error: broken promise(s): double-split")


def test_compare_hf_stream_split_on_three_ranks(tmp_path):
    env = {**launch_env(), "TMPDIR": str(tmp_path)}
    proc = sharddemo(["compare", "--source", "hf-stream", "--modes", "split,prepared,replicated",
                      "--num-processes", "3", "--dataset-size", "10", "--batch-size", "3",
                      "--format", "json", "--epochs", "1"], env=env)
    # Nothing left in the temporary folder: not the launch's own, not torchrun's log folder,
    # not the JSON-lines files each of the 3 ranks wrote for its stream.
    assert list(tmp_path.iterdir()) == []
    report = json.loads(proc.stdout)
    split = report["modes"]["split"]["epochs"][0]
    assert [sum(r["batches"], []) for r in split["ranks"]] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert split["steps_equal"] is False  # 4 samples vs 3: 2 steps vs 1, a DDP hang
    assert report["modes"]["replicated"]["epochs"][0]["seen"] == 30
    assert report["source"] == "hf-stream"


def test_trap_shows_one_process_seeing_everything():
    proc = sharddemo(["trap"])
    assert "What really ran: 1 process(es), DistributedType NO" in proc.stdout
    assert "It saw 8 of 8 samples per epoch" in proc.stdout
    assert "accelerate_configs/cpu2.yaml" in proc.stdout
