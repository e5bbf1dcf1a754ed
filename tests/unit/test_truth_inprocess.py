"""The truth grid in one process: every option against the libraries' own objects.

For every mode and every combination of N (smaller than, equal to and not divisible by the
global batch), B, W in {2, 3, 4}, shuffle, drop_last, even_batches, split_batches (valid and
invalid B) and workers, hypothesis draws cases and checks, per rank and epoch:

- the batches sharddemo's loader gives rank r equal what the libraries give rank r
  (tests/support/oracle.py: DistributedSampler, prepare_data_loader, never sharddemo code);
- the report's seen / unique / missing / duplicated follow from those batches (counted here
  with collections.Counter), and each duplicate's and missing sample's reason is the mechanism
  the mode is made of.

Real ranks run a sampled subset of the same grid (tests/ranks/test_truth_ranks.py).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.oracle import Case, all_ranks
from support.sim import SimAccelerator, walk

from sharddemo.errors import UsageError
from sharddemo.rank.loaders import build_mode_loader
from sharddemo.options import RunOptions
from sharddemo.analysis import build_report
from sharddemo.rank.sources import build_source
from sharddemo.rank.describe import describe_loader

MODES = ["sampler", "replicated", "prepared", "double-split", "unseeded"]


def sharddemo_side(case: Case) -> tuple[list, dict]:
    """[epoch][rank] -> batches as sharddemo's loaders give them, and the mode's trace."""
    opts = RunOptions(**case.run_options()).validate()
    per_rank, plans = [], []
    for r in range(case.world):
        import torch

        torch.manual_seed(case.seed)  # what set_seed does in trace_mode
        plan = build_mode_loader(case.mode, SimAccelerator(case.world, r),
                            build_source(case.source, case.n), opts)
        per_rank.append(walk(plan, case.epochs))
        plans.append(plan)
    epochs = [[per_rank[r][e] for r in range(case.world)] for e in range(case.epochs)]
    remainder = [getattr(p.loader, "remainder", None) if p.prepared else None for p in plans]
    per_rank_batch = case.b // case.world if case.split_batches else case.b
    trace = {"world_size": case.world, "backend": "none", "dataset_size": case.n,
             "batch_size": case.b, "global_batch": per_rank_batch * case.world,
             "epochs": case.epochs, "seed": case.seed, "source": case.source,
             "options": opts.to_dict(),
             "modes": {case.mode: {
                 "prepared": plans[0].prepared, "hint": plans[0].hint,
                 "loader": describe_loader(plans[0].loader),
                 "epochs": [{"epoch": e, "gather": "epoch", "remainder": remainder,
                             "ranks": [{"rank": r, "batches": b} for r, b in enumerate(ranks)]}
                            for e, ranks in enumerate(epochs)]}}}
    return epochs, trace


def expected_reason(case: Case) -> str:
    """The mechanism each mode is made of, by its definition."""
    return {"sampler": "sampler-padding", "prepared": "even-batches-fill",
            "replicated": "replication", "double-split": "double-split",
            "unseeded": "ranks-disagree"}[case.mode]


def check_case(case: Case) -> None:
    expected = all_ranks(case)
    got, trace = sharddemo_side(case)
    assert got == expected, f"{case}: sharddemo's loaders differ from the libraries'"
    report = build_report(trace)["modes"][case.mode]
    for e, ranks in enumerate(expected):
        rep = report["epochs"][e]
        ids = [i for batches in ranks for batch in batches for i in batch]
        counts = Counter(ids)
        where = f"{case} epoch {e}"
        assert rep["seen"] == len(ids), where
        assert rep["unique"] == len(counts), where
        assert rep["missing"] == sorted(set(range(case.n)) - set(counts)), where
        assert {d["id"]: d["count"] for d in rep["duplicates"]} == \
            {i: c for i, c in counts.items() if c > 1}, where
        assert rep["most_copies"] == max(counts.values(), default=0), where
        steps = [len(b) for b in ranks]
        assert rep["steps_equal"] == (len(set(steps)) == 1), where
        assert rep["hang_at_step"] == (min(steps) if len(set(steps)) > 1 else None), where
        assert [r["steps"] for r in rep["ranks"]] == steps, where
        if rep["duplicates"]:
            assert {d["reason"] for d in rep["duplicates"]} == {expected_reason(case)}, where
            assert rep["duplicates_explained"], where
        if rep["missing"]:
            if case.mode in ("double-split", "unseeded"):
                assert rep["missing_reason"] == expected_reason(case), where
            else:
                # The libraries lose nothing without drop_last; with it, less than a round.
                assert case.drop_last, f"{where}: missing {rep['missing']} without drop_last"
                assert rep["missing_reason"] == "drop-last" and rep["missing_explained"], where
        if case.mode == "prepared" and case.even_batches and not case.drop_last \
                and not case.split_batches:
            # accelerate's promise: gather_for_metrics drops the fill, the dataset exactly once.
            assert rep["gather_for_metrics_exact"] is True, where
    if case.mode in ("sampler", "prepared") and not case.drop_last and \
            (case.mode == "sampler" or case.even_batches):
        assert report["broken_promises"] == [], f"{case}: {report['broken_promises']}"
    if case.mode == "replicated":
        assert report["broken_promises"] == [], f"{case}: {report['broken_promises']}"


sizes = st.one_of(st.integers(1, 64), st.sampled_from([97, 256, 1000]))


@st.composite
def cases(draw, workers=st.just(0)):
    mode = draw(st.sampled_from(MODES))
    world = draw(st.sampled_from([2, 3, 4]))
    b = draw(st.integers(1, 8))
    split = mode == "prepared" and draw(st.booleans())
    if split:
        b = draw(st.sampled_from([world, 2 * world]))
    return Case(mode=mode, n=draw(sizes), b=b, world=world, shuffle=draw(st.booleans()),
                drop_last=draw(st.booleans()),
                even_batches=draw(st.booleans()) if mode == "prepared" else True,
                split_batches=split, num_workers=draw(workers),
                set_epoch=draw(st.booleans()) if mode == "sampler" else True)


# derandomize: CI sees the same 250 cases every run (a wider local search: --hypothesis-seed=N
# and more examples; 3,000 random cases passed when this was written).
@settings(max_examples=250, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
# The edges, worked out by hand: N divisible by W*B; N not divisible; N < W; B > N/W; the
# known failures (split + no even_batches at N = 22, 21, 2; unseeded at N = 11).
@example(Case("prepared", 8, 4, 2))
@example(Case("prepared", 10, 3, 2, shuffle=False))
@example(Case("sampler", 1, 4, 3))
@example(Case("sampler", 10, 3, 4, shuffle=False))
@example(Case("prepared", 22, 4, 2, shuffle=False, even_batches=False, split_batches=True))
@example(Case("prepared", 21, 4, 2, shuffle=False, even_batches=False, split_batches=True))
@example(Case("prepared", 2, 4, 2, shuffle=False, even_batches=False, split_batches=True))
@example(Case("unseeded", 11, 2, 2, even_batches=False))
@example(Case("replicated", 10, 3, 2, drop_last=True))
@example(Case("double-split", 10, 2, 2, shuffle=False))
def test_grid_matches_the_libraries(case):
    check_case(case)


@settings(max_examples=8, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases(workers=st.just(2)))
def test_grid_with_two_workers_matches_the_libraries(case):
    check_case(case)


@pytest.mark.parametrize("b,world", [(3, 2), (4, 3), (5, 4)])
def test_invalid_split_batches_refused_as_the_library_refuses(b, world):
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    with pytest.raises(ValueError):  # accelerate's own refusal
        BatchSamplerShard(BatchSampler(SequentialSampler(range(10)), b, False),
                          num_processes=world, split_batches=True)
    opts = RunOptions(batch_size=b, split_batches=True).validate()
    with pytest.raises(UsageError, match=f"batch size must divide by {world}"):
        opts.validate_split_batches(world)


def test_double_split_literal():
    # Worked out by hand (transformers issue 34365): N=10, B=2, W=2, no shuffle.
    # Rank 0's sampler half [0,2,4,6,8] -> batches [0,2] [4,6] [8]; accelerate keeps batches 0
    # and 2 of them on rank 0 and fills the last: [[0,2],[8,0]]. Rank 1's half [1,3,5,7,9] ->
    # [1,3] [5,7] [9]; it keeps batch 1 and the fill of the missing batch 3: [[5,7],[3,5]].
    # Seen: 0 2 8 5 7 3; never seen: 1 4 6 9.
    case = Case("double-split", 10, 2, 2, shuffle=False, epochs=1)
    got, trace = sharddemo_side(case)
    report = build_report(trace)["modes"]["double-split"]["epochs"][0]
    assert got == all_ranks(case) == [[[[0, 2], [8, 0]], [[5, 7], [3, 5]]]]
    assert report["missing"] == [1, 4, 6, 9]
    assert report["missing_reason"] == "double-split"


class _TaggedStream:
    """ids 0..n-1 as (id, worker) pairs, split by DataLoader worker (every K-th id) or, with
    `whole`, every worker yielding them all; the worker id is torch's get_worker_info()."""

    def __init__(self, n: int, whole: bool) -> None:
        self.n, self.whole = n, whole

    def __iter__(self):
        import torch

        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if self.whole or info is None else (info.id, info.num_workers)
        return iter([(i, info.id if info else -1) for i in range(start, self.n, step)])


@settings(max_examples=20, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 40), b=st.integers(1, 4), world=st.sampled_from([2, 3]),
       workers=st.sampled_from([2, 3]), whole=st.booleans())
@example(n=10, b=3, world=2, workers=2, whole=False)
@example(n=3, b=4, world=3, workers=2, whole=False)  # each worker's share tiles its batch
@example(n=1, b=1, world=2, workers=2, whole=True)
def test_iterable_shard_in_workers_explained_as_the_library_deals(n, b, world, workers, whole):
    """prepare_data_loader (no dispatch) over a stream in a DataLoader with workers: accelerate
    wraps it in IterableDatasetShard, and each worker runs its own copy. The batches and the
    worker that made each come from those library objects; the report must count what they
    dealt (Counter here) and call a split stream's repeats the shard's own fill, and a stream
    every worker reads whole not."""
    import torch
    from accelerate.data_loader import prepare_data_loader
    from support.oracle import ensure_accelerator_state

    from sharddemo.analysis import build_report
    from sharddemo.rank.describe import describe_loader

    class Stream(_TaggedStream, torch.utils.data.IterableDataset):
        pass

    ensure_accelerator_state()
    ranks, made_by, loader = [], [], None
    for r in range(world):
        loader = prepare_data_loader(
            torch.utils.data.DataLoader(Stream(n, whole), batch_size=b, num_workers=workers),
            num_processes=world, process_index=r, put_on_device=False, dispatch_batches=False)
        got = list(loader)
        ranks.append([batch[0].tolist() for batch in got])
        made_by.append([int(batch[1][0]) for batch in got])
    trace = {"world_size": world, "backend": "none", "dataset_size": n, "batch_size": b,
             "global_batch": b * world, "epochs": 1, "seed": 0, "source": "iterable",
             "options": {"num_workers": workers},
             "modes": {"prepared": {"prepared": True, "hint": None,
                                    "loader": describe_loader(loader),
                                    "epochs": [{"epoch": 0, "gather": "epoch",
                                                "remainder": [None] * world,
                                                "ranks": [{"rank": r, "batches": bs,
                                                           "workers": wk}
                                                          for r, (bs, wk) in
                                                          enumerate(zip(ranks, made_by))]}]}}}
    report = build_report(trace)["modes"]["prepared"]
    e = report["epochs"][0]
    counts = Counter(i for batches in ranks for batch in batches for i in batch)
    assert e["seen"] == sum(counts.values()) and e["unique"] == len(counts)
    assert {d["id"]: d["count"] for d in e["duplicates"]} == \
        {i: c for i, c in counts.items() if c > 1}
    if whole:
        assert e["duplicates_explained"] is False and "worker-replication" in e["reasons"]
    else:
        assert e["missing_count"] == 0
        assert e["duplicates_explained"] is True
        assert set(e["reasons"]) <= {"shard-fill"}
        assert not any("padding does not explain" in p for p in report["broken_promises"])
