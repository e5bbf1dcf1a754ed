"""docs/trace.schema.json refuses a record without its fields (the traces of real rank
commands against it: tests/ranks/test_trace_schema.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest


ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "trace.schema.json").read_text())


def test_the_schema_refuses_a_record_without_its_fields():
    record = {"epoch": 0, "gather": "count", "ranks": []}  # a counted record lacks coverage
    trace = {"schema": "sharddemo.trace/1", "world_size": 1, "backend": "none",
             "distributed_type": "NO", "device": "cpu", "dataset_size": 1, "epochs": 1,
             "options": {}, "modes": {"m": {"epochs": [record]}}}
    with pytest.raises(jsonschema.ValidationError, match="coverage"):
        jsonschema.validate(trace, SCHEMA)
