"""What sharddemo reads from and sets in the environment is written down in one table
(docs/reliability.md, "Switches in the environment"), and nothing else changes behind the
user's back: no HF_DATASETS_OFFLINE, no config file picked from the working directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "sharddemo"


def _table() -> str:
    text = (ROOT / "docs" / "reliability.md").read_text()
    start = text.index("## Switches in the environment")
    return text[start:text.index("\n## ", start + 1)]


def test_every_variable_the_code_names_or_sets_is_in_the_table():
    table = _table()
    named: set[str] = set()
    for path in SRC.rglob("*.py"):
        code = path.read_text()
        named |= set(re.findall(r"\b(SHARDDEMO_[A-Z_]+)\b", code))
        # env["X"] = ..., env.setdefault("X", ...), os.environ["X"] = ...
        named |= set(re.findall(r"env(?:iron)?\[\"([A-Z_]+)\"\]\s*=", code))
        named |= set(re.findall(r"env(?:iron)?\.setdefault\(\"([A-Z_]+)\"", code))
    assert {"SHARDDEMO_PROGRESS", "SHARDDEMO_STATUS_DIR", "OMP_NUM_THREADS"} <= named
    missing = sorted(v for v in named if f"`{v}" not in table)
    assert not missing, f"named in src/ but not in docs/reliability.md's table: {missing}"


def test_the_hf_stream_source_leaves_hf_datasets_offline_alone(monkeypatch):
    from sharddemo.rank.sources import hf_stream

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    stream = hf_stream(6, 2)
    assert sorted(int(row["id"]) for row in stream) == [0, 1, 2, 3, 4, 5]
    assert "HF_DATASETS_OFFLINE" not in os.environ


def test_a_config_in_the_working_directory_is_used_only_where_it_is_the_shipped_file(
        tmp_path, monkeypatch):
    from sharddemo.config import default_config_path, shipped_config_path

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # cpu2.yaml, whatever the machine has
    shipped = shipped_config_path("cpu2.yaml")
    monkeypatch.chdir(tmp_path)
    assert default_config_path() == shipped  # no folder: the installed file
    (tmp_path / "accelerate_configs").mkdir()
    mine = tmp_path / "accelerate_configs" / "cpu2.yaml"
    mine.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\n")  # the user's own
    assert default_config_path() == shipped
    mine.write_bytes(Path(shipped).read_bytes())  # a checkout: the very same file
    assert default_config_path() == os.path.join("accelerate_configs", "cpu2.yaml")
