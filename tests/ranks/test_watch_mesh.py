"""The watch on a device mesh: within each data-parallel group every rank must receive the same
batches (its replica peers: tp, cp), and the groups split the epoch, each counted once.

Real ranks: torchrun, gloo, torch's init_device_mesh, 4 and 8 processes (tests/scripts/mesh_loop.py,
a user's loop that logs the ids every step received and each rank's mesh coordinate). The
expected values come from the ids the loop logged, with each rank's place from torch's own
mesh (get_coordinate), from torch's DistributedSampler(num_replicas=the data size, rank=the
data coordinate), and, in one process, from the BatchSamplerShard accelerate's
prepare_data_loader(torch_device_mesh=) builds."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from torch.utils.data import DistributedSampler

from support.launch import sharddemo, torchrun

LOOP = str(Path(__file__).resolve().parents[1] / "scripts" / "mesh_loop.py")
N, BATCH, EPOCHS = 24, 4, 2  # (tests/scripts/mesh_loop.py's)
DATA_NAMES = ("dp", "dp_replicate", "dp_shard")


def launch_mesh(tmp_path, nproc: int, cases: list[str]):
    proc = torchrun([LOOP, tmp_path, *cases], nproc=nproc, timeout=240)
    logs = [json.loads((tmp_path / f"ids{r}.json").read_text()) for r in range(nproc)]
    report = tmp_path / "report.jsonl"
    entries = ([json.loads(line) for line in report.read_text().splitlines()]
               if report.exists() else [])
    schema = json.loads((Path(LOOP).parents[2] / "docs" / "watch.schema.json").read_text())
    for entry in entries:
        jsonschema.validate(entry, schema)
    return proc, logs, entries


def received(logs, case: str, epoch: int) -> dict[int, list[list[int]]]:
    """rank -> the batches its loop logged in `case`, epoch `epoch`."""
    return {log["rank"]: [row["ids"] for row in log["log"]
                          if row.get("case") == case and row["epoch"] == epoch]
            for log in logs}


def places(logs, case: str) -> dict[int, dict[str, int]]:
    """rank -> its coordinate on the case's mesh, as torch's mesh.get_coordinate() said."""
    return {log["rank"]: next(row["coordinate"] for row in log["log"]
                              if row.get("case") == case and "coordinate" in row)
            for log in logs}


def truth(logs, case: str, epoch: int) -> dict:
    """What the loop received, read on the mesh: the groups (ranks sharing their data
    coordinates), each group's first rank (replica coordinates all 0), whether every peer got
    the same batches and, where not, the first step and pair; seen and unique over the
    groups' first ranks."""
    got, where = received(logs, case, epoch), places(logs, case)
    groups: dict[tuple, list[int]] = {}
    for rank in sorted(got):
        key = tuple(v for d, v in where[rank].items() if d in DATA_NAMES)
        groups.setdefault(key, []).append(rank)
    firsts, differ, differing = [], None, 0
    for key in sorted(groups):
        members = groups[key]
        first = next(r for r in members
                     if all(v == 0 for d, v in where[r].items() if d not in DATA_NAMES))
        firsts.append(first)
        apart = False
        for other in members:
            a, b = got[first], got[other]
            step = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y),
                        None if len(a) == len(b) else min(len(a), len(b)))
            apart = apart or step is not None
            if step is not None and (differ is None or step < differ[0]):
                differ = (step, first, other)
        differing += apart
    ids = [i for r in firsts for batch in got[r] for i in batch]
    return {"groups": len(groups), "seen": len(ids), "unique": len(set(ids)), "differ": differ,
            "differing": differing, "firsts": firsts, "got": got, "where": where}


def epoch_entries(entries, case: str) -> list[dict]:
    return [e for e in entries if e["loader"] == case and "window" not in e]


def peer(entry: dict) -> dict:
    return next(v for v in entry["verdicts"] if v["verdict"] == "peers-receive-the-same-batches")


def check_case(logs, entries, case: str) -> list[dict]:
    """Every epoch entry of `case` against what the loop received: the groups' count, seen
    and unique over the groups, the peer verdict and its first differing step and ranks."""
    got = epoch_entries(entries, case)
    assert [e["epoch"] for e in got] == list(range(EPOCHS)), case
    for e in got:
        t = truth(logs, case, e["epoch"])
        assert e["mesh"]["data_groups"] == t["groups"]
        assert (e["seen"], e["unique"]) == (t["seen"], t["unique"]), case
        assert e["world_size"] == len(logs)
        v = peer(e)
        assert v["ok"] == (t["differ"] is None), (case, v)
        if t["differ"] is not None:
            step, first, other = t["differ"]
            # (the sentence counts the epoch's steps from 1, as the window lines do)
            assert f"differ from step {step + 1}: rank {first} (" in v["detail"]
            assert f"and rank {other} (" in v["detail"]
            assert e["mesh"]["peers_differ"]["groups"] == t["differing"]
            more = t["differing"] - 1
            assert (f"(and peers in {more} more data-parallel group" in v["detail"]) == (more > 0)
    return got


def test_four_ranks_on_2x2_meshes_every_verdict_is_what_the_loop_received(tmp_path):
    """4 processes, one launch, a mesh per loader: (dp, tp) and (tp, dp) with a DistributedSampler
    over the data dim (workers 0 and 2), (dp_replicate, tp) and (dp_shard, cp) through
    accelerate's prepare_data_loader(torch_device_mesh=), and the planted faults: a sampler over
    the whole world, one tp peer with batches of 2; and accelerate's two misreadings of a mesh
    (a data dim named dp, not split; tp listed first)."""
    cases = ["ok:dp,tp:2,2:sampler:0", "okt:tp,dp:2,2:sampler:2",
             "prep:dp_replicate,tp:2,2:prepared:0", "prepcp:dp_shard,cp:2,2:prepared:2",
             "world:dp,tp:2,2:world:0", "batch:dp,tp:2,2:batch:0",
             "prepdp:dp,tp:2,2:prepared:0", "preptp:tp,dp_replicate:2,2:prepared:0",
             "submesh:dp,tp:2,2:submesh", "nodims:dp,tp:2,2:nodims", "flat:dp:4:flat-batch:0"]
    proc, logs, entries = launch_mesh(tmp_path, 4, cases)
    for case in ("ok", "okt"):
        # torch's own DistributedSampler over the data dim gives each rank what it received
        for epoch in range(EPOCHS):
            t = truth(logs, case, epoch)
            for rank, batches in t["got"].items():
                sampler = DistributedSampler(range(N), num_replicas=2,
                                             rank=t["where"][rank]["dp"], shuffle=True, seed=0)
                sampler.set_epoch(epoch)
                order = list(sampler)
                assert batches == [order[k:k + BATCH] for k in range(0, len(order), BATCH)]
        assert all(e["ok"] for e in check_case(logs, entries, case))
    for case in ("prep", "prepcp"):  # accelerate's split on a mesh it reads right: sound
        got = check_case(logs, entries, case)
        assert all(e["ok"] and e["unique"] == N for e in got), got
    world = check_case(logs, entries, "world")
    assert all("splits over all 4 ranks" in peer(e)["detail"] for e in world)
    assert "tp peers (dp=0) differ from step 1" in peer(world[0])["detail"]
    batch = check_case(logs, entries, "batch")
    assert not any(peer(e)["ok"] for e in batch)
    # accelerate's prepare_data_loader splits over dims named dp_replicate/dp_shard only: a
    # mesh's "dp" is not split, and every group receives the whole dataset (t["unique"] == N,
    # seen 2N, from the ids logged); peers agree, so the fault is the groups' replication
    prepdp = check_case(logs, entries, "prepdp")
    for e in prepdp:
        assert truth(logs, "prepdp", e["epoch"])["seen"] == 2 * N
        failed = {v["verdict"]: v["detail"] for v in e["verdicts"] if not v["ok"]}
        assert "no-silent-replication" in failed and peer(e)["ok"]
        assert "this mesh's dp is not split" in " ".join(failed.values())
    # rank // tp, with tp listed first: the ranks accelerate puts together are no tp peers
    preptp = check_case(logs, entries, "preptp")
    assert all("this mesh is ordered (tp, dp_replicate)" in peer(e)["detail"] for e in preptp)
    # windows: a fault among peers is named within the epoch, at the first window
    windows = [e for e in entries if e["loader"] == "world" and "window" in e]
    assert windows and windows[0]["window"]["first_step"] == 1 and not peer(windows[0])["ok"]
    # refused at watch(), on every rank, in one line
    for case, words in (("submesh", "the mesh holds 2 ranks"), ("nodims", "which the mesh lacks")):
        errors = [row["error"] for log in logs for row in log["log"] if row.get("case") == case]
        assert len(errors) == 4 and all(words in e and "\n" not in e for e in errors), errors
    # a flat world (no mesh) whose ranks' batch sizes differ: named, never a crash of the
    # watch's own collectives (their sizes once followed each rank's batch size: gloo aborted)
    flat = [e for e in entries if e["loader"] == "flat" and "window" not in e]
    t = received(logs, "flat", 0)
    assert [e["steps"] for e in flat] == [[len(t[r]) for r in range(4)]] * EPOCHS
    assert len(set(flat[0]["steps"])) == 2 and not flat[0]["ok"]
    # only the main process talks: each epoch line once
    assert proc.stdout.count("sharddemo: epoch 0 ok:") == 1
    # the lineage: each rank's batch at a step with its mesh coordinate, and its peers
    for case, step in (("ok", 4), ("batch", 0), ("okt", 1)):
        t = truth(logs, case, step // 3)  # (3 steps an epoch on the groups' first ranks)
        shown = json.loads(sharddemo(["lineage", str(tmp_path / f"lineage-{case}"), "--step",
                                      str(step), "--format", "json"]).stdout)
        for b in shown["batches"]:
            assert b["coordinate"] == t["where"][b["rank"]]
            assert b["ids"] == t["got"][b["rank"]][step % 3]
        for g in shown["mesh"]["peers"]:
            assert g["same"] == (len({str(t["got"][r][step % 3]) for r in g["ranks"]}) == 1)
            # which peers received alike: the group's ranks by the batch each loop logged
            by_batch: dict = {}
            for r in g["ranks"]:
                by_batch.setdefault(str(t["got"][r][step % 3]), []).append(r)
            assert g["alike"] == list(by_batch.values())
        # (the planted fault: the tp=1 peers' batches of 2 differ from the first step)
        assert all(g["same"] for g in shown["mesh"]["peers"]) == (case != "batch")
        text = sharddemo(["lineage", str(tmp_path / f"lineage-{case}"), "--step",
                          str(step)]).stdout
        assert "rank 1 (" in text and "peers (" in text


def test_eight_ranks_on_a_2x2x2_mesh_cp_peers_shuffled_apart_are_named(tmp_path):
    """8 processes, (dp, cp, tp) = (2, 2, 2): a sampler over dp is sound; the cp peers
    shuffling with their own seeds are named (cp, in data group dp=0, from step 0)."""
    _, logs, entries = launch_mesh(tmp_path, 8, ["ok:dp,cp,tp:2,2,2:sampler:0",
                                              "seeds:dp,cp,tp:2,2,2:seeds:0"])
    assert all(e["ok"] for e in check_case(logs, entries, "ok"))
    seeds = check_case(logs, entries, "seeds")
    assert all(peer(e)["detail"].startswith("cp peers (dp=0) differ from step 1") for e in seeds)
    assert all(e["mesh"]["dims"] == {"dp": 2, "cp": 2, "tp": 2} for e in seeds)




def test_a_resume_on_a_mesh_laid_out_anew_counts_each_group_once(tmp_path):
    """4 processes on (dp, tp) = (2, 2) save after 2 steps of epoch 0 (accelerate's save_state
    carries the watch's state); a new launch on (tp, dp) loads it, skips the 2 batches and goes
    on. The mesh lists its dims in another order, so rank 1 is in group dp=0 before and dp=1
    after: each rank's place is read from the mesh, and the resumed epoch is judged over the
    groups. Expected from the ids the two launches' loops logged."""
    launch_mesh(tmp_path, 4, ["res:dp,tp:2,2:save", "flat:dp,tp:2,2:save"])
    before = [json.loads((tmp_path / f"ids{r}.json").read_text()) for r in range(4)]
    proc, after, entries = launch_mesh(tmp_path, 4, ["res:tp,dp:2,2:load",
                                                  "flat:dp,tp:2,2:load-flat"])

    def group_ids(logs, epoch):
        t = truth(logs, "res", epoch)  # (each group once: its first rank)
        return [i for r in t["firsts"] for batch in t["got"][r] for i in batch]

    got = [e for e in epoch_entries(entries, "res") if not e.get("partial")]
    assert [e["epoch"] for e in got] == [0, 1]
    saved, rest = group_ids(before, 0), group_ids(after, 0)
    resume = got[0]["resume"]
    assert resume["seen_before"] == len(saved) == 2 * 2 * BATCH  # (2 groups, 2 steps of 4)
    assert resume["repeated"]["count"] == len(set(saved) & set(rest))
    assert resume["skipped"]["count"] == N - len(set(saved) | set(rest))
    assert got[0]["ok"] == (not set(saved) & set(rest) and len(set(saved) | set(rest)) == N)
    assert got[0]["mesh"]["dims"] == {"tp": 2, "dp": 2} and peer(got[0])["ok"]
    # the topology each state was saved on, named beside the one it resumed on: the mesh laid
    # out anew, and (case flat) a mesh dropped: the same checkpoint loaded with no mesh
    assert resume["restarts"][-1]["changed"] == {
        "mesh": ["dp=2,tp=2 (data: dp)", "tp=2,dp=2 (data: dp)"]}
    [flat] = [e for e in epoch_entries(entries, "flat")
              if e["epoch"] == 0 and not e.get("partial")]
    assert flat["resume"]["restarts"][-1]["changed"] == {"mesh": ["dp=2,tp=2 (data: dp)", None]}
    assert "mesh dp=2,tp=2 (data: dp) -> none (a flat world)" in proc.stdout
    assert (got[1]["seen"], got[1]["unique"]) == (len(group_ids(after, 1)),
                                                  len(set(group_ids(after, 1))))
