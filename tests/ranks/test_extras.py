"""Optional packages as users install them: every command that can use one is run with that
package absent (tests/support/hideplugin hides an installed module from every process of the
command). Each run either works, or refuses in one `Error:` line that names the extra, before
any rank starts (no rank command of sharddemo ever starts: the plugin would leave a mark)."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from support.launch import FACTORIES, ROOT, SCHEMA, launch_env, sharddemo

PLUGIN = str(ROOT / "tests" / "support" / "hideplugin")
LIGHTNING_EXAMPLE = "examples/lightning_example.py:make_datamodule"
LITDATA_FACTORY = str(ROOT / "tests" / "support" / "litdata_factories.py")


def run_without(hidden: list[str], args: list[str], tmp_path):
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PLUGIN, env.get("PYTHONPATH")]))
    env["SHARDDEMO_TEST_HIDE"] = ",".join(hidden)
    marks = tmp_path / "ranks"
    marks.mkdir()
    env["SHARDDEMO_TEST_RANKS_DIR"] = str(marks)
    proc = sharddemo(args, check=False, env=env, timeout=240)
    return proc, sorted(os.listdir(marks))


@pytest.mark.parametrize("hidden,args,extra", [
    (["torchdata"], ["audit", f"{FACTORIES}:seeded_40", "--resume-at", "0:1",
                     "--resume-strategy", "stateful"], "stateful"),
    (["transformers"], ["audit", "--trainer", "examples/trainer_example.py:make_trainer"], "hf"),
    (["lightning", "pytorch_lightning"], ["audit", "--lightning", LIGHTNING_EXAMPLE],
     "lightning"),
    (["matplotlib"], ["compare", "--plot", "{png}"], "plot"),
    (["matplotlib"], ["audit", "examples/good.py:make_loader", "--plot", "{png}"], "plot"),
    (["webdataset"], ["audit", "examples/webdataset_loaders.py:split", "--id-field",
                      "__key__"], "webdataset"),
    (["webdataset"], ["compare", "--source", "webdataset"], "webdataset"),
    (["litdata"], ["audit", f"{LITDATA_FACTORY}:split", "--id-field", "id"], "litdata"),
])
def test_a_command_that_needs_an_absent_package_says_which_extra_before_any_rank(
        tmp_path, hidden, args, extra):
    png = tmp_path / "x.png"
    proc, started = run_without(hidden, [a.replace("{png}", str(png)) for a in args], tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    assert f"pip install 'sharddemo[{extra}]'" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr and not proc.stdout.strip()
    assert started == [], "a rank started before the refusal"
    assert not png.exists()


def test_the_resume_demo_runs_without_torchdata_and_says_what_it_left_out(tmp_path):
    proc, started = run_without(["torchdata"], ["compare", "--modes", "resume", "--dataset-size",
                                               "16", "--format", "json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    strategies = {r["strategy"] for r in report["resume"]}
    # options.demo_scenarios without the stateful strategy: 2 workers x 2 stops x 2 strategies
    assert strategies == {"skip", "restart"} and len(report["resume"]) == 8
    assert "torchdata" in report["resume_left_out"]
    assert "pip install 'sharddemo[stateful]'" in report["resume_left_out"]
    assert started  # this one did run its ranks


@pytest.mark.parametrize("hidden", [["lightning"], ["pytorch_lightning"]],
                         ids=["pytorch_lightning-only", "lightning-only"])
def test_lightning_audits_with_either_package(tmp_path, hidden):
    """The example's datamodule comes from whichever package is there; the audit of its val
    loader (8 samples on 2 ranks, no padding) passes either way."""
    proc, _ = run_without(hidden, ["audit", "--lightning", LIGHTNING_EXAMPLE, "--format", "json",
                                   "--epochs", "1"], tmp_path)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    assert set(report["modes"]) == {"lightning:train", "lightning:val"}
    val = report["modes"]["lightning:val"]["epochs"][0]
    # Lightning's DistributedSampler over the 8 val samples, 2 ranks: 4 each, nothing padded
    assert (val["seen"], val["unique"], val["missing_count"]) == (8, 8, 0)
