"""The count path end to end on 2 real ranks: `compare` past 1,000,000 samples (auto) and
`audit --gather count`. Expected values come from torch's and accelerate's own samplers built
here; tests/ranks/test_scenarios.py checks that the count path and the per-id path give the
same report on 26 loaders."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
from accelerate.data_loader import BatchSamplerShard
from support.launch import sharddemo
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())
N, B, W = 1_000_003, 4096, 2


def test_compare_counts_a_million_samples_as_the_libraries_deal_them():
    proc = sharddemo(["compare", "--modes", "sampler,prepared", "--dataset-size", str(N),
                      "--batch-size", str(B), "--epochs", "2", "--format", "json"])
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    sampler = report["modes"]["sampler"]
    for e in sampler["epochs"]:
        assert e["gather"] == "count"
        # torch's DistributedSampler for each rank, seeded as the run (--seed 42, set_epoch).
        parts = []
        for r in range(W):
            ds = DistributedSampler(range(N), num_replicas=W, rank=r, shuffle=True, seed=42)
            ds.set_epoch(e["epoch"])
            parts.append(list(ds))
            rank = e["ranks"][r]
            assert rank["samples"] == len(parts[-1])
            assert rank["steps"] == -(-len(parts[-1]) // B)
            assert rank["first_batches"][0] == parts[-1][:B]
            assert rank["last_batches"][-1] == parts[-1][-(len(parts[-1]) % B or B):]
        every = Counter(i for p in parts for i in p)
        dups = sorted(i for i, k in every.items() if k > 1)
        assert e["seen"] == sum(every.values()) and e["unique"] == len(every)
        assert e["missing_count"] == N - len(every) == 0
        assert [d["id"] for d in e["duplicates"]] == dups
        assert {d["reason"] for d in e["duplicates"]} == {"sampler-padding"}
        assert e["duplicates_explained"]
    assert sampler["epochs"][1]["order_changed"] is True
    prepared = report["modes"]["prepared"]
    for e in prepared["epochs"]:
        # accelerate's own BatchSamplerShard: how many each rank receives does not depend on
        # the order, so a SequentialSampler gives the counts.
        shards = [list(BatchSamplerShard(BatchSampler(SequentialSampler(range(N)), B, False),
                                         num_processes=W, process_index=r, even_batches=True))
                  for r in range(W)]
        sizes = [sum(len(b) for b in s) for s in shards]
        assert [r["samples"] for r in e["ranks"]] == sizes
        assert [r["steps"] for r in e["ranks"]] == [len(s) for s in shards]
        assert e["seen"] == sum(sizes) and e["unique"] == N
        assert e["duplicate_count"] == sum(sizes) - N
        assert {d["reason"] for d in e["duplicates"]} == {"even-batches-fill"}
        assert e["gathered_for_metrics_count"] == N and e["gather_for_metrics_exact"] is True
    assert report["broken_promises"] == []


def test_audit_counts_and_still_catches_a_missing_set_epoch():
    proc = sharddemo(["audit", "examples/no_set_epoch.py:make_loader", "--num-processes", "2",
                      "--gather", "count", "--grad-accum", "3", "--format", "json"],
                     check=False)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    data = report["modes"]["audit"]
    assert all(e["gather"] == "count" for e in data["epochs"])
    failed = {v["verdict"] for v in data["verdicts"] if not v["ok"]}
    assert failed == {"order-changes-each-epoch"}
    # 1000 samples, DistributedSampler on 2 ranks: 500 each, nothing padded or missing.
    e = data["epochs"][1]
    assert [r["samples"] for r in e["ranks"]] == [500, 500]
    assert e["order_changed"] is False and e["missing_count"] == 0 and e["duplicate_count"] == 0
    # Gradient accumulation from the step counts alone: torch's loader takes 32 steps per rank
    # (500 samples in batches of 16); in windows of 3 that is 11 optimizer steps, the last one
    # taking the 2 batches left (32 = 10 x 3 + 2) on each rank.
    steps = [len(DataLoader(range(1000), batch_size=16,
                            sampler=DistributedSampler(range(1000), num_replicas=2, rank=r)))
             for r in range(2)]
    assert steps == [32, 32]
    assert e["grad_accum"] == {"k": 3, "counted": True, "optimizer_steps": 11,
                               "steps_per_rank": steps, "last_batches": [2, 2],
                               "uneven_last": True}


def test_a_replicated_million_keeps_its_lists_capped_and_its_totals_exact():
    """The JSON stays small at any N: id lists stop at 1,000, the totals beside them stay exact.
    Worked by hand: `replicated` is a plain DataLoader(shuffle=True) on each of 2 ranks, so each
    rank walks all 1,000,000 ids once and every id arrives twice: 1,000,000 duplicates, each
    with count 2, listed from id 0 up to the first 1,000. Listed whole they would take about
    50 MB of JSON (some 50 bytes each); capped, the whole report is a few hundred KB. In
    batches of 20,000: 50 steps per rank, few enough that a smaller dataset would be gathered
    batch by batch, every id sent to the main process; from 1,000,000 samples none is."""
    n = 1_000_000
    proc = sharddemo(["compare", "--modes", "replicated", "--dataset-size", str(n),
                      "--batch-size", "20000", "--epochs", "1", "--format", "json"])
    assert len(proc.stdout) < 1_000_000
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    e = report["modes"]["replicated"]["epochs"][0]
    assert e["gather"] == "count"
    assert e["seen"] == 2 * n and e["unique"] == n and e["missing_count"] == 0
    assert e["duplicate_count"] == n
    assert e["duplicates"] == [{"id": i, "count": 2, "reason": "replication"}
                               for i in range(1000)]
    assert [r["samples"] for r in e["ranks"]] == [n, n]
    assert [r["steps"] for r in e["ranks"]] == [50, 50]  # 1,000,000 / 20,000
    # the first and last 3 of those batches, each listed up to its first 4,096 ids
    assert [[len(b) for b in r["first_batches"] + r["last_batches"]] for r in e["ranks"]] \
        == [[4096] * 6] * 2


def test_the_conclusion_counts_every_extra_copy_past_the_listed_ones():
    """The count path lists the first 1,000 duplicated ids; the conclusion's "extra (repeated)
    samples" must be every copy past a sample's first, not the listed ones' (it said 1000).
    `unseeded` on 2 ranks: each rank deals its half of its own permutation, so the halves
    overlap in about N/4 ids, well past the list's cap at N = 6,000. Expected: the batches
    torch and accelerate hand each rank (tests/support/oracle.py), counted here."""
    from support.oracle import Case, all_ranks

    n, b = 6000, 50
    case = Case("unseeded", n, b, 2, seed=42, epochs=1)
    every = Counter(i for rank in all_ranks(case)[0] for batch in rank for i in batch)
    extra = sum(k - 1 for k in every.values())
    duplicated = sum(k > 1 for k in every.values())
    assert duplicated > 1000  # past the cap, or the test shows nothing
    proc = sharddemo(["compare", "--modes", "unseeded", "--dataset-size", str(n), "--batch-size",
                      str(b), "--epochs", "1", "--gather", "count", "--format", "json"])
    data = json.loads(proc.stdout)["modes"]["unseeded"]
    e = data["epochs"][0]
    assert e["gather"] == "count" and len(e["duplicates"]) == 1000
    assert e["duplicate_count"] == duplicated and e["seen"] - e["unique"] == extra
    assert f", {extra} extra (repeated) sample(s) (" in data["conclusion"]


@pytest.mark.parametrize("n,exact", [(900, True), (1500, False)])
def test_the_most_copies_of_a_sample_past_the_listed_duplicates(n, exact):
    """Worked by hand: `--source iterable-unsplit` is a stream that every DataLoader worker
    yields whole, and `replicated` gives it to each of 2 ranks: with 2 workers each id arrives
    2 x 2 = 4 times, twice on each rank. With 1,500 ids the duplicates list stops at 1,000,
    and each rank received 1,500 ids more than once, more than the 1,000 a rank lists: the most
    copies, 4, is then a lower bound and said so ("at least"). With 900 it is exact."""
    proc = sharddemo(["compare", "--source", "iterable-unsplit", "--num-workers", "2",
                      "--modes", "replicated", "--dataset-size", str(n), "--batch-size", "50",
                      "--epochs", "1", "--gather", "count", "--format", "json"])
    report = json.loads(proc.stdout)  # exit 0: compare shows pitfalls; --check would fail it
    data = report["modes"]["replicated"]
    e = data["epochs"][0]
    assert e["seen"] == 4 * n and e["unique"] == n and e["duplicate_count"] == n
    assert len(e["duplicates"]) == min(n, 1000) and {d["count"] for d in e["duplicates"]} == {4}
    assert e["most_copies"] == 4 and e["most_copies_exact"] is exact
    said = "samples arrived up to 4 times" if exact else "samples arrived up to at least 4 times"
    assert f"{said} (" in data["conclusion"]
    assert any(line.endswith(said) for line in report["broken_promises"])


def test_a_stream_past_two_to_the_26_is_counted_at_two_bits_on_real_ranks(tmp_path):
    """examples/huge_stream.py:just_past_bits on 2 ranks (no workers): N = 2^26 + 16,384 ids
    in blocks of 4096, block b to rank b % 2, each id once (by hand): 16,388 blocks, 8,194 a
    rank. The count path keeps 2 bits a sample there (BitCounts) and must report what the
    byte counter would: N seen, N unique, nothing missing or repeated, all verdicts held."""
    n = (1 << 26) + 4 * 4096
    out = tmp_path / "r.json"
    proc = sharddemo(["audit", "examples/huge_stream.py:just_past_bits", "--id-field", ".",
                      "--dataset-size", str(n), "--epochs", "1", "--format", "json",
                      "--output", str(out)], check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    jsonschema.validate(report, SCHEMA)
    e = report["modes"]["audit"]["epochs"][0]
    assert e["gather"] == "count"
    assert (e["seen"], e["unique"], e["missing_count"], e["duplicate_count"]) == (n, n, 0, 0)
    assert [r["steps"] for r in e["ranks"]] == [8194, 8194]
    assert e["ranks"][0]["first_batches"][0] == list(range(4096))  # block 0, rank 0
