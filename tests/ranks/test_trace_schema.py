"""The trace (what the ranks hand the parent) holds to docs/trace.schema.json, for every rank
command that writes one, on real ranks: `run` with ids and counted, `audit-rank`, and a
`resume-rank` phase. The schema is the contract docs/architecture.md describes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
from support.launch import CPU_CONFIG, accelerate_launch

from sharddemo.commands.launches import audit_launch
from sharddemo.launch import LaunchSettings, run_launch
from sharddemo.options import AuditOptions, ResumePlan

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "trace.schema.json").read_text())
FACTORIES = str(ROOT / "tests" / "support" / "factories.py")


@pytest.mark.parametrize("gather", ["batch", "count"])
def test_the_run_trace_holds_to_the_schema(tmp_path, gather):
    out = tmp_path / "trace.json"
    accelerate_launch(["-m", "sharddemo", "run", "--modes", "prepared,replicated", "--quiet",
                       "--dataset-size", "10", "--batch-size", "3", "--gather", gather,
                       "--trace-out", str(out)])
    trace = json.loads(out.read_text())
    jsonschema.validate(trace, SCHEMA)
    # the header says what ran: 2 gloo ranks on CPU (cpu2.yaml), not what a default guessed
    assert (trace["world_size"], trace["backend"], trace["device"]) == (2, "gloo", "cpu")
    assert {e["gather"] for m in trace["modes"].values() for e in m["epochs"]} == {gather}


def test_the_audit_and_resume_traces_hold_to_the_schema(tmp_path):
    settings = LaunchSettings(config_file=CPU_CONFIG, num_processes=2)
    opts = AuditOptions(target=f"{FACTORIES}:plain_40", keep_ids=True).validate()
    audit = run_launch(audit_launch(settings, opts), timeout=60, max_time=300)
    jsonschema.validate(audit, SCHEMA)
    plan = ResumePlan.at(0, 2)
    stop = run_launch(audit_launch(settings, opts, "resume-rank", plan=dataclasses.asdict(plan),
                                   phase="stop", checkpoint=str(tmp_path / "ckpt")),
                      timeout=60, max_time=300)
    jsonschema.validate(stop, SCHEMA)
    assert stop["phase"] == "stop" and len(stop["epochs"]) == 1
