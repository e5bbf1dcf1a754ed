"""The warm launcher's snapshot (tests/support/warm.py's Snapshot): a launch the straggler rule
ended runs again on the real launcher on the folders it found, not on what its first run left."""

from __future__ import annotations

import tempfile
from pathlib import Path

from support.warm import Snapshot, launch_folders


def test_a_launchs_test_folder_is_what_its_paths_under_the_temp_dir_name(tmp_path):
    temp = Path(tempfile.gettempdir()).resolve()
    # tmp_path is pytest's own folder for this test (pytest-of-USER/pytest-N[/popen-gwK]/NAME)
    folder = tmp_path.resolve()
    assert launch_folders(str(folder / "run" / "lineage")) == [folder]
    assert launch_folders(f"--lineage={folder / 'lineage'}") == [folder]
    # a folder of tempfile's own: the first folder below the temp dir
    assert launch_folders(str(temp / "tmpabc" / "out.json")) == [temp / "tmpabc"]
    # the checkout, relative words and options name no test folder
    assert launch_folders("examples/watch_accelerate.py") == []
    assert launch_folders("--epochs") == []
    assert launch_folders("/usr/lib/python3") == []


def test_a_restored_launch_finds_its_folders_as_they_were_before_it(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step3.pt").write_bytes(b"before")
    (run / "ids.jsonl").write_text("launch 0\n")
    saved = Snapshot(["examples/loop.py", "--root", str(run), "--launch", "1"], None)
    # what a hung first run leaves: a changed file, a new file, a new folder, a file removed
    (run / "ids.jsonl").write_text("launch 0\nlaunch 1\n")
    (run / "checkpoints" / "step6.pt").write_bytes(b"after")
    (run / "lineage").mkdir()
    (run / "lineage" / "rank0.bin").write_bytes(b"x")
    (run / "checkpoints" / "step3.pt").unlink()
    assert saved.restore() is None
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "run", "run/checkpoints", "run/checkpoints/step3.pt", "run/ids.jsonl"]
    assert (run / "ids.jsonl").read_text() == "launch 0\n"
    assert (run / "checkpoints" / "step3.pt").read_bytes() == b"before"
    assert not saved.aside.exists()


def test_a_folder_the_launch_made_is_gone_after_the_restore(tmp_path):
    other = Path(tempfile.mkdtemp())  # (a folder below the temp dir named by the environment)
    target = other / "made"
    other.rmdir()
    saved = Snapshot(["loop.py"], {"SHARDDEMO_STATUS_DIR": str(target)})
    target.mkdir(parents=True)
    (target / "status").write_text("rank 0")
    assert saved.restore() is None
    assert not other.exists()


def test_folders_too_large_to_copy_are_said_not_safe(tmp_path, monkeypatch):
    import support.warm as warm

    monkeypatch.setattr(warm, "SNAPSHOT_MAX_BYTES", 10)
    (tmp_path / "big.bin").write_bytes(b"0" * 11)
    saved = Snapshot([str(tmp_path / "big.bin")], None)
    assert saved.restore() == "its folders hold over 0 MB"
    saved.drop()
