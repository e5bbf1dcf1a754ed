"""`sharddemo compare --mesh` and `sharddemo audit --mesh`: the modes on a device mesh, on real
ranks (4 processes, gloo, torch's init_device_mesh), peers shown side by side with their mesh
coordinates, coverage counted once per data-parallel group, and the peer verdict per mode.

Expected values come from torch's DistributedSampler(num_replicas=the data size, rank=the data
coordinate), from accelerate's BatchSamplerShard built here, and from hand-worked literals:
torch lays a 2 x 2 mesh out as [[0, 1], [2, 3]], so rank r sits at (first dim = r // 2,
second dim = r % 2)."""

from __future__ import annotations

import json

import jsonschema
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from support.launch import ROOT, SCHEMA, audit, sharddemo
from sharddemo.render import render

MESH_FACTORIES = str(ROOT / "tests" / "support" / "mesh_factories.py")
SUMMARY = json.loads((ROOT / "docs" / "summary.schema.json").read_text())


def batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[k:k + size] for k in range(0, len(indices), size)]


def sampler_batches(n: int, replicas: int, rank: int, epoch: int, batch: int,
                    shuffle: bool = True, seed: int = 42) -> list[list[int]]:
    """What torch's DistributedSampler deals rank `rank` of `replicas` in `epoch`, batched."""
    sampler = DistributedSampler(list(range(n)), num_replicas=replicas, rank=rank,
                                 shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return batches(list(sampler), batch)


def ranks_of(e: dict) -> dict[int, dict]:
    return {r["rank"]: r for r in e["ranks"]}


# -- real ranks -----------------------------------------------------------------------------------

def test_compare_on_a_dp_tp_mesh(tmp_path):
    """(dp, tp) = (2, 2), every mode and the world sampler, N=12, B=2, shuffled: rank r at
    (dp=r // 2, tp=r % 2); groups [0, 1] and [2, 3], counted by ranks 0 and 2."""
    out, png = tmp_path / "report.json", tmp_path / "split.png"
    proc = sharddemo(["compare", "--mesh", "dp=2,tp=2", "--modes", "all,world-sampler",
                      "--dataset-size", "12", "--batch-size", "2", "--format", "json",
                      "--output", str(out), "--plot", str(png)], check=False)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    jsonschema.validate(summary, SUMMARY)
    report = json.loads(out.read_text())
    jsonschema.validate(report, SCHEMA)
    assert png.stat().st_size > 0
    assert report["world_size"] == 4
    assert report["mesh"]["dims"] == {"dp": 2, "tp": 2}
    assert report["mesh"]["data_dims"] == ["dp"] and report["mesh"]["groups"] == [[0, 1], [2, 3]]
    assert summary["mesh"] == report["mesh"]
    modes = report["modes"]
    for mode, data in modes.items():
        for e in data["epochs"]:
            ranks = ranks_of(e)
            assert {r: ranks[r]["mesh"] for r in ranks} == {
                0: "dp=0, tp=0", 1: "dp=0, tp=1", 2: "dp=1, tp=0", 3: "dp=1, tp=1"}
            assert [r for r in ranks if ranks[r]["counted"]] == [0, 2], mode
            got = {r: ranks[r]["batches"] for r in ranks}
            k = e["epoch"]
            if mode == "sampler":  # over the dp groups: rank = the dp coordinate
                assert got == {r: sampler_batches(12, 2, r // 2, k, 2) for r in range(4)}
            elif mode == "world-sampler":  # the bug: over all 4 ranks
                assert got == {r: sampler_batches(12, 4, r, k, 2) for r in range(4)}
            else:
                # prepared: accelerate splits only dims named dp_replicate/dp_shard, so with
                # `dp` its data world is 1 and every rank walks the whole shuffled epoch, as
                # replicated does
                assert all(got[r] == got[0] for r in range(4)), mode
                assert sorted(i for b in got[0] for i in b) == list(range(12))
            # coverage once per group: the groups' first ranks, 0 and 2
            counted = [i for r in (0, 2) for b in got[r] for i in b]
            assert e["seen"] == len(counted) and e["unique"] == len(set(counted))
            assert e["gathered_count"] == sum(len(b) for r in got for b in got[r])
    assert [e["seen"] for e in modes["sampler"]["epochs"]] == [12, 12]
    assert [e["seen"] for e in modes["world-sampler"]["epochs"]] == [6, 6]
    assert [e["seen"] for e in modes["prepared"]["epochs"]] == [24, 24]
    for mode in ("prepared", "sampler", "replicated"):
        assert all(v["ok"] for v in modes[mode]["peers"]), mode
        assert summary["modes"][mode]["verdicts"][0]["ok"]
    failed = modes["world-sampler"]["peers"]
    assert [v["ok"] for v in failed] == [False, False]
    assert failed[0]["detail"].startswith(
        "tp peers (dp=0) differ from step 1: rank 0 (dp=0, tp=0) and rank 1 (dp=0, tp=1)")
    assert "splits over all 4 ranks" in failed[0]["detail"]
    assert any("world-sampler epoch 0: peers-receive-the-same-batches" in p
               for p in report["broken_promises"])
    assert "this mesh's dp is not split" in modes["prepared"]["note"]
    assert "data-parallel groups" in modes["sampler"]["conclusion"]
    # every format carries the mesh and the peers (rendered from the report written above)
    for fmt in ("table", "markdown", "json"):
        text = render(report, fmt)
        assert "dp=0, tp=1" in text and "peers-receive-the-same-batches" in text, fmt
    assert "mesh dp=2 x tp=2: data dims dp" in render(report, "table")
    # a step's samples: per-rank batch 2 x 2 data-parallel groups = 4 (tp peers share theirs;
    # not 2 x 4 ranks = 8)
    assert report["global_batch"] == 4
    assert "per-rank batch 2 | global batch 4 |" in render(report, "table")
    assert any("prepared epoch 0: the data-parallel groups did not split the data" in p
               for p in report["broken_promises"])
    assert modes["replicated"]["conclusion"].startswith(
        "Every data-parallel group walked the whole dataset in the same order, so the "
        "data-parallel groups train on identical batches")


def test_compare_on_a_cp_first_mesh_with_workers():
    """(cp, dp_shard) = (2, 2), cp listed first, 2 workers, no shuffle, N=8, B=2: rank r at
    (cp=r // 2, dp_shard=r % 2), so the groups are [0, 2] and [1, 3]. accelerate takes the
    data rank as rank // cp, which pairs ranks 0 and 1 instead: its peers differ."""
    proc = sharddemo(["compare", "--mesh", "cp=2,dp_shard=2", "--modes", "prepared,sampler",
                      "--no-shuffle", "--num-workers", "2", "--dataset-size", "8",
                      "--batch-size", "2", "--format", "json"], check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    assert report["mesh"]["groups"] == [[0, 2], [1, 3]]
    sampler, prepared = report["modes"]["sampler"], report["modes"]["prepared"]
    for e in sampler["epochs"]:
        got = {r: x["batches"] for r, x in ranks_of(e).items()}
        assert got == {r: sampler_batches(8, 2, r % 2, e["epoch"], 2, shuffle=False)
                       for r in range(4)}
        assert e["seen"] == 8 and e["unique"] == 8
        assert {w["rank"] for w in e["workers"]} == {0, 1, 2, 3}
    assert all(v["ok"] for v in sampler["peers"])
    for e in prepared["epochs"]:
        got = {r: x["batches"] for r, x in ranks_of(e).items()}
        from accelerate.data_loader import BatchSamplerShard

        plain = BatchSampler(SequentialSampler(range(8)), 2, False)
        assert got == {r: list(BatchSamplerShard(plain, num_processes=2, process_index=r // 2))
                       for r in range(4)}
        # counted by ranks 0 and 1 (the groups' first), which accelerate gave the same half
        assert e["seen"] == 8 and e["unique"] == 4 and e["missing"] == [2, 3, 6, 7]
    assert prepared["peers"][0]["detail"].startswith(
        "cp peers (dp_shard=0) differ from step 1: rank 0 (cp=0, dp_shard=0) and rank 2 "
        "(cp=1, dp_shard=0)")
    assert "rank // (cp)" in prepared["note"] and "ordered (cp, dp_shard)" in prepared["note"]


def test_audit_on_a_mesh_gives_the_factory_the_mesh(tmp_path, monkeypatch):
    """A factory that splits over the world on a (dp_shard, tp) = (2, 2) mesh: it gets the
    mesh (as `mesh=` and as accelerator.torch_device_mesh), and the peer verdict fails."""
    monkeypatch.setenv("MESH_FACTORY_OUT", str(tmp_path))  # (the ranks inherit it)
    proc = audit(f"{MESH_FACTORIES}:world_sampler", "--mesh", "dp_shard=2,tp=2", nproc=4)
    assert proc.returncode == 1, proc.stderr
    given = [json.loads((tmp_path / f"given{r}.json").read_text()) for r in range(4)]
    assert given == [{"dims": ["dp_shard", "tp"], "coordinate": [r // 2, r % 2]}
                     for r in range(4)]
    report = json.loads(proc.stdout)
    verdicts = {v["verdict"]: v for v in report["modes"]["audit"]["verdicts"] if v["epoch"] == 0}
    peers = verdicts["peers-receive-the-same-batches"]
    assert not peers["ok"] and peers["detail"].startswith(
        "tp peers (dp_shard=0) differ from step 1: rank 0 (dp_shard=0, tp=0) and rank 1 "
        "(dp_shard=0, tp=1)")
    # counted by ranks 0 and 2: DistributedSampler(12, 4 replicas) gives them 0 4 8 and 2 6 10
    e = report["modes"]["audit"]["epochs"][0]
    assert e["seen"] == 6 and e["missing"] == [1, 3, 5, 7, 9, 11]
    assert ranks_of(e)[1]["batches"] == batches(list(DistributedSampler(
        list(range(12)), num_replicas=4, rank=1, shuffle=False)), 2)
    assert "verdict(s) failed" in proc.stderr and "peers-receive-the-same-batches" in proc.stderr
