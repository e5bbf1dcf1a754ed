"""sharddemo audit on real gloo ranks: loaders whose own objects deal part of the dataset or
repeat ids by design (a random_split part, a datasets view, a sampler that draws with
replacement). The truth is what those objects deal, and a real loss or a replication still
fails. Expected values from torch's, datasets' and accelerate's objects."""

from __future__ import annotations

import pytest
from support.launch import FACTORIES, audit, verdicts


def _received(e) -> set:
    return {i for r in e["ranks"] for b in r["batches"] for i in b}


def test_a_random_split_part_is_audited_against_its_own_data():
    """On 3 ranks and the count path (the ids path: the train/test split of datasets below,
    and tests/unit/test_report_units.py)."""
    from support.factories import split_parts

    train, held = split_parts()  # torch's random_split, seeded as the factory seeds it
    proc = audit(f"{FACTORIES}:random_split_train", "--epochs", "1", "--gather", "count",
                 nproc=3)
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    e = report["modes"]["audit"]["epochs"][0]
    assert e["missing_count"] == len(held) and e["unique"] == len(train)
    assert e["missing"] == sorted(held.indices)  # the held-out part, and nothing else
    assert e["missing_reason"] == "subset" and e["missing_explained"]
    # accelerate's gather_for_metrics cuts the last step by len(dataset) = len(train)
    assert e["gathered_for_metrics_count"] == len(train) and e["gather_for_metrics_exact"]
    assert report["modes"]["audit"]["loader"]["domain"] == len(set(train.indices))


def test_a_random_split_part_under_a_distributed_sampler_is_its_own_data():
    """The DDP recipe (random_split, then torch's DistributedSampler over the train part) on
    2 ranks, 2 epochs, ids path: each rank receives what DistributedSampler deals it, mapped
    through the Subset; the held-out part is `subset`, the padding DistributedSampler's. It
    failed no-missing-samples before ("NO reason: a sharded loader lost these samples")."""
    from torch.utils.data import DistributedSampler

    from support.factories import split_parts

    train, held = split_parts()
    proc = audit(f"{FACTORIES}:random_split_distributed", "--epochs", "2", "--set-epoch")
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    for e in report["modes"]["audit"]["epochs"]:
        for r in e["ranks"]:
            ref = DistributedSampler(train, num_replicas=2, rank=r["rank"], seed=0)
            ref.set_epoch(e["epoch"])
            ids = [train.indices[i] for i in ref]
            assert r["batches"] == [ids[k:k + 4] for k in range(0, len(ids), 4)]
        assert e["missing"] == sorted(held.indices) and e["missing_reason"] == "subset"
        assert e["duplicate_count"] == 1  # 45 over 2 ranks: one padded
        assert {d["reason"] for d in e["duplicates"]} == {"sampler-padding"}


def _weighted_oracle(world: int, epochs: int, prepared: bool):
    """[epoch][rank] -> batches: the factory's DataLoader over WeightedRandomSampler(seed 5),
    built fresh per rank and, where prepared, through accelerate's prepare_data_loader."""
    import torch
    from accelerate.data_loader import prepare_data_loader
    from support.oracle import ACCELERATOR_RNG_TYPES, ensure_accelerator_state
    from torch.utils.data import DataLoader, WeightedRandomSampler

    from support.factories import N, _dataset

    out = [[None] * world for _ in range(epochs)]
    for rank in range(world):
        sampler = WeightedRandomSampler(torch.ones(N), N,
                                        generator=torch.Generator().manual_seed(5))
        loader = DataLoader(_dataset(), batch_size=4, sampler=sampler)
        if prepared:
            ensure_accelerator_state()
            loader = prepare_data_loader(loader, num_processes=world, process_index=rank,
                                         put_on_device=False,
                                         rng_types=list(ACCELERATOR_RNG_TYPES))
        for epoch in range(epochs):
            out[epoch][rank] = [[int(i) for i in ids] for ids, _ in loader]
    return out


def test_a_sampler_with_replacement_repeats_and_skips_by_design():
    """2 epochs on 3 ranks, the count path (the ids path: tests/unit/test_report_units.py)."""
    nproc, gather = 3, "count"
    expected = _weighted_oracle(nproc, 2, prepared=True)
    proc = audit(f"{FACTORIES}:weighted_draws", "--gather", gather, nproc=nproc)
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    for e, ranks in zip(report["modes"]["audit"]["epochs"], expected):
        drawn = [i for batches in ranks for b in batches for i in b]
        assert e["seen"] == len(drawn) and e["unique"] == len(set(drawn))
        assert e["missing_count"] == 60 - len(set(drawn)) > 0
        assert [r["steps"] for r in e["ranks"]] == [len(batches) for batches in ranks]
        assert e["missing_reason"] == "sampler-draws" and e["duplicates_explained"]
        assert {d["reason"] for d in e["duplicates"]} == {"sampler-draws"}


def test_the_same_draw_on_every_rank_is_replication():
    """On 3 ranks and the count path, which knows the ranks walked one sequence from their
    equal order hashes (the ids path: tests/unit/test_report_units.py)."""
    expected = _weighted_oracle(3, 1, prepared=False)
    assert expected[0][0] == expected[0][1] == expected[0][2]  # torch: the same sampler, the same draw
    proc = audit(f"{FACTORIES}:weighted_draws_unprepared", "--epochs", "1", "--gather", "count",
                 nproc=3)
    report, got = verdicts(proc)
    assert proc.returncode == 1 and not got["no-silent-replication"], got
    e = report["modes"]["audit"]["epochs"][0]
    for r, batches in zip(e["ranks"], expected[0]):
        assert r["steps"] == len(batches) and r["first_batches"][0] == batches[0]
    assert e["seen"] == 3 * sum(map(len, expected[0][0]))
    assert {d["reason"] for d in e["duplicates"]} == {"replication"}


def test_a_datasets_view_is_audited_by_its_table_rows():
    """train_test_split's train part: the positions the DataLoader asks for are mapped to the
    table's rows (its indices mapping), so the ids are the samples' own (sample_id = row) and
    the held-out quarter is the view's, not a loss. Expected from datasets' own split."""
    from support.factories import hf_ids

    parts = hf_ids().train_test_split(test_size=0.25, seed=0)
    proc = audit(f"{FACTORIES}:hf_train_test_split", "--epochs", "1")
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    e = report["modes"]["audit"]["epochs"][0]
    assert _received(e) == {int(i) for i in parts["train"]["sample_id"]}
    assert e["missing"] == sorted(int(i) for i in parts["test"]["sample_id"])
    assert e["missing_reason"] == "subset" and report["dataset_size"] == 60
    # accelerate's gather_for_metrics cuts the last step by len(dataset): the train part's
    assert e["gathered_for_metrics_count"] == len(parts["train"]) and e["gather_for_metrics_exact"]


def _hf_part(rank: int) -> list[int]:
    """rank's part of hf_ids() (60 ids) from datasets' own split_dataset_by_node, 2 ranks."""
    from datasets.distributed import split_dataset_by_node
    from support.factories import hf_ids

    return sorted(int(i) for i in split_dataset_by_node(hf_ids(), rank=rank,
                                                        world_size=2)["sample_id"])


@pytest.mark.parametrize("factory,kind,id_field,part,n", [
    # split_dataset_by_node on a map-style datasets.Dataset: each rank its contiguous rows
    ("hf_split_by_node", "datasets.Dataset", "sample_id", _hf_part, 60),
    # TensorDataset(ids[rank::2]): rank r holds r, r + 2, ..., 38 + r (by hand)
    ("tensor_sliced_by_rank", "TensorDataset", "0", lambda rank: list(range(rank, 40, 2)), 40),
])
def test_data_split_by_rank_needs_ids_and_is_right_with_them(factory, kind, id_field, part, n):
    """Data split by rank before the loader: by position every rank's rows would look like the
    same samples (replication); the ranks compare their rows as stored, the audit refuses,
    and with --id-field each rank received its own part."""
    proc = audit(f"{FACTORIES}:{factory}", "--epochs", "1", check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"read different rows of a {kind} " in lines[0] and "--id-field" in lines[0]
    proc = audit(f"{FACTORIES}:{factory}", "--epochs", "1", "--id-field", id_field)
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    e = report["modes"]["audit"]["epochs"][0]
    for r in e["ranks"]:
        assert sorted(i for b in r["batches"] for i in b) == part(r["rank"])
    assert report["dataset_size"] == n and e["times_dataset"] == 1


def test_a_sharded_loader_over_different_data_on_each_rank_says_the_ids_are_positions():
    """Unseeded torch.randn on each rank under a prepared loader: accelerate shards positions
    that hold different samples on each rank. The split of positions is what accelerate dealt
    (from its own BatchSamplerShard), and the report says that it is not a split of samples."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    proc = audit(f"{FACTORIES}:tensor_unseeded_prepared", "--epochs", "1")
    report, got = verdicts(proc)
    assert proc.returncode == 0 and all(got.values()), got
    mode = report["modes"]["audit"]
    assert mode["fingerprint"]["rows_differ"] is True
    assert "the split below is of positions, not of samples" in mode["fingerprint"]["rows_note"]
    e = mode["epochs"][0]
    whole = BatchSampler(SequentialSampler(range(40)), 4, False)
    for r in e["ranks"]:
        shard = BatchSamplerShard(whole, num_processes=2, process_index=r["rank"])
        assert len(r["batches"]) == len(list(shard)) and all(len(b) == 4 for b in r["batches"])
    assert report["dataset_size"] == 40 and e["times_dataset"] == 1
