"""The watch's checks within an epoch, the judgement alone (analysis.entry_window): every
`check_every` steps the ranks meet once and judge the window of steps so far; literals worked
out by hand. On real ranks: tests/ranks/test_watch_windows.py."""

from __future__ import annotations


from hypothesis import given, settings
from hypothesis import strategies as st
from support.reports import entries

from torch.utils.data import DataLoader, IterableDataset

from sharddemo import watch
from sharddemo.analysis.entry_window import judge_window


def failed(entry: dict) -> set[str]:
    return {v["verdict"] for v in entry["verdicts"] if not v["ok"]}


# -- the judgement alone ----------------------------------------------------------------------

def head(steps: int, done: int = 0, n: int = 100) -> dict:
    return {"done": done, "steps": steps, "n": n}


def test_a_window_whose_ranks_share_nothing_holds():
    """2 ranks, 2 steps of 2: rank 0 got 0, 2, 4, 6 and rank 1 got 1, 3, 5, 7."""
    entry = judge_window(epoch=0, name="train", first=1, last=2, at=3,
                         heads=[head(2), head(2)], ids=[[0, 2, 4, 6], [1, 3, 5, 7]], earlier=0,
                         n=100)
    assert entry["ok"] and not failed(entry) and entry["seen"] == entry["unique"] == 8
    assert entry["window"] == {"first_step": 1, "last_step": 2, "checked_at": 3}


def test_the_same_samples_on_every_rank_is_replication():
    entry = judge_window(epoch=1, name="train", first=51, last=100, at=101,
                         heads=[head(100), head(100)], ids=[[5, 6, 7], [5, 6, 7]], earlier=0,
                         n=100)
    assert failed(entry) == {"no-silent-replication"}
    assert entry["duplicated"] == {"count": 3, "ids": [5, 6, 7], "reasons": ["replication"]}
    assert entry["line"].startswith("sharddemo: epoch 1 train steps 51-100 (checked at step "
                                    "101): FAIL no-silent-replication: 3 samples")
    assert "not sharded" in entry["line"]


def test_overlapping_shares_and_an_earlier_window_are_named():
    # rank 0: 1, 2, 3; rank 1: 3, 4, 5 -> sample 3 on both (an overlap, not replication)
    entry = judge_window(epoch=0, name="train", first=1, last=1, at=2,
                         heads=[head(1), head(1)], ids=[[1, 2, 3], [3, 4, 5]], earlier=0, n=9)
    assert entry["duplicated"]["ids"] == [3] and "overlap" in entry["line"]
    # nothing shared in this window, but 2 found at the previous one across windows
    entry = judge_window(epoch=0, name="train", first=2, last=2, at=3,
                         heads=[head(2), head(2)], ids=[[6], [7]], earlier=2, n=9)
    assert failed(entry) == {"no-silent-replication"}
    assert "2 samples of the previous window" in entry["line"]


def test_a_rank_out_of_data_and_ranks_that_disagree_on_the_dataset():
    entry = judge_window(epoch=0, name="train", first=11, last=15, at=16,
                         heads=[head(15, done=1, n=-1), head(15, n=-1)], ids=[[], [9, 11]],
                         earlier=0, n=None)
    assert failed(entry) == {"equal-step-counts"}
    assert "rank 0 ran out of data after 15 steps while rank 1 went on to step 16" in \
        entry["line"]
    entry = judge_window(epoch=0, name="train", first=1, last=5, at=6,
                         heads=[head(5, n=1000), head(5, n=999)], ids=[[0], [1]], earlier=0,
                         n=1000)
    assert failed(entry) == {"ranks-agree-on-dataset"}
    assert "rank 0 has 1,000, rank 1 has 999" in entry["line"]


def test_every_rank_at_its_end_is_no_fault():
    """The last exchange of an epoch: every rank done (1: its loader ran out; 2: closing)."""
    entry = judge_window(epoch=0, name="train", first=1, last=7, at=8,
                         heads=[head(7, done=1), head(5, done=2)], ids=[[], []], earlier=0,
                         n=100)
    assert entry["ok"]


def test_seen_counts_every_id_the_windows_held_not_only_those_sent():
    """Rank 0 held 3,000 ids (50 steps of 60) and sent its first 1,024 (here 3 stand in for
    them); rank 1, at its end, held 7 (its last batch) and sent none: seen is 3,000 + 7, and
    the distinct ones are unknown (null), not the 3 that were sent."""
    entry = judge_window(epoch=0, name="train", first=1, last=50, at=52,
                         heads=[{**head(50), "kept": 3000}, {**head(50, done=1), "kept": 7}],
                         ids=[[0, 1, 2], []], earlier=0, n=10_000)
    assert entry["seen"] == 3007 and entry["unique"] is None
    entry = judge_window(epoch=0, name="train", first=1, last=2, at=3,
                         heads=[{**head(2), "kept": 2}, {**head(2), "kept": 2}],
                         ids=[[0, 2], [1, 3]], earlier=0, n=100)
    assert (entry["seen"], entry["unique"]) == (4, 4)


def test_on_a_mesh_the_details_name_each_groups_first_rank():
    """A 2x2 mesh (dp, tp): groups [0 1] and [2 3], spoken for by ranks 0 and 2. Group 0 ran
    out after 15 steps while group 1 went on; both received id 9: the details say rank 2 (not
    "rank 1", which is group 1's index) and "data-parallel group", not "rank"."""
    mesh = {"dims": {"dp": 2, "tp": 2}, "data_dims": ["dp"], "world": 4, "data_groups": 2,
            "replicas": 2}
    entry = judge_window(epoch=0, name="train", first=11, last=15, at=16,
                         heads=[head(15, done=1), head(15)], ids=[[], [9, 11]], earlier=0,
                         n=100, mesh=mesh, peers=None, speakers=[0, 2])
    assert "rank 0 ran out of data after 15 steps while rank 2 went on to step 16" in \
        entry["line"]
    entry = judge_window(epoch=0, name="train", first=1, last=1, at=2,
                         heads=[head(1), head(1)], ids=[[9], [9]], earlier=0, n=100,
                         mesh=mesh, peers=None, speakers=[0, 2])
    assert "received by more than one data-parallel group" in entry["line"]
    assert "every data-parallel group received the same samples" in entry["line"]


# -- a sample a rank received twice; the order of the previous epoch --------------------------

def test_a_rank_repeat_is_named_unless_the_sampler_draws_with_replacement():
    """Rank 0's counter says it received ids 3 and 9 twice by step 5; rank 1 nothing."""
    heads = [dict(head(5), repeats=2, examples=[3, 9]), head(5)]
    entry = judge_window(epoch=0, name="train", first=1, last=5, at=6, heads=heads,
                         ids=[[3, 9, 3, 9], [2, 4, 6, 8]], earlier=0, n=100)
    assert failed(entry) == {"no-unexplained-duplicates"}
    assert "rank 0 received 2 samples more than once by step 5 (ids 3, 9)" in entry["line"]
    # a sampler that draws with replacement repeats by design: no window calls it a fault,
    # nor a sample two ranks both drew (RandomSampler(replacement=True) through prepare)
    draws = {"draws": {"sampler": "RandomSampler", "replacement": True, "count": 100}}
    entry = judge_window(epoch=0, name="train", first=1, last=5, at=6, heads=heads,
                         ids=[[3, 9, 3, 9], [3, 4, 6, 8]], earlier=1, n=100, loader=draws)
    assert entry["ok"], entry["line"]
    # ... but the same samples on every rank is replication all the same
    entry = judge_window(epoch=0, name="train", first=1, last=5, at=6,
                         heads=[head(5), head(5)], ids=[[1, 2, 3], [1, 2, 3]], earlier=0,
                         n=100, loader=draws)
    assert failed(entry) == {"no-silent-replication"}


def test_the_previous_epochs_order_fails_only_where_every_running_rank_repeats_it():
    same, other, unknown = (dict(head(5), order=o) for o in (1, 0, -1))
    entry = judge_window(epoch=1, name="train", first=1, last=5, at=6, heads=[same, same],
                         ids=[[0], [1]], earlier=0, n=100)
    assert failed(entry) == {"order-changes-each-epoch"}
    assert "same ids at steps 1-5 as in epoch 0" in entry["line"]
    for heads in ([same, other], [same, unknown], [unknown, unknown]):
        entry = judge_window(epoch=1, name="train", first=1, last=5, at=6, heads=heads,
                             ids=[[0], [1]], earlier=0, n=100)
        assert entry["ok"], heads
    # (a rank at its end does not count: its window is not compared)
    entry = judge_window(epoch=1, name="train", first=1, last=5, at=6,
                         heads=[same, dict(head(5, done=1), order=-1)], ids=[[0], []],
                         earlier=0, n=100)
    assert "order-changes-each-epoch" in failed(entry)


def test_ids_outside_the_dataset_are_one_finding():
    """dataset_size 10: ids -1 and 12 name no sample (10 and 11 too); with no dataset size,
    only the negative one."""
    entry = judge_window(epoch=0, name="train", first=1, last=1, at=2,
                         heads=[head(1, n=10), head(1, n=10)], ids=[[-1, 0], [12, 1]],
                         earlier=0, n=10, id_field="id")
    assert failed(entry) == {"ids-in-range"}
    assert "id_field 'id' gave 2 ids outside 0..9 (-1, 12)" in entry["line"]
    entry = judge_window(epoch=0, name="train", first=1, last=1, at=2,
                         heads=[head(1, n=-1), head(1, n=-1)], ids=[[-1, 0], [12, 1]],
                         earlier=0, n=None, id_field="id")
    assert "id_field 'id' gave 1 id below 0 (-1)" in entry["line"]


@given(st.lists(st.lists(st.integers(0, 60), max_size=30), min_size=2, max_size=3),
       st.integers(1, 200))
@settings(max_examples=200, deadline=None)
def test_a_window_fails_replication_exactly_when_two_ranks_share_a_sample(ids, step):
    """Any ids on 2-3 running ranks, no repeats reported, N = 61: no-silent-replication fails
    exactly when some sample is in two ranks' windows (worked out here with sets), and
    ids-in-range never (every id lies in 0..60)."""
    heads = [head(step, n=61) for _ in ids]
    entry = judge_window(epoch=0, name="train", first=1, last=step, at=step + 1, heads=heads,
                         ids=ids, earlier=0, n=61)
    shared = {i for a in range(len(ids)) for b in range(a) for i in set(ids[a]) & set(ids[b])}
    assert failed(entry) == ({"no-silent-replication"} if shared else set())
    assert entry["duplicated"]["count"] == len(shared)


class Outside(IterableDataset):
    """Ids -2..11 in batches of 2: for dataset_size=10, -2, -1, 10 and 11 name no sample."""

    def __iter__(self):
        return iter({"id": i} for i in range(-2, 12))


def test_ids_outside_the_dataset_are_one_finding_at_the_epochs_end(tmp_path, capsys):
    """In one process (no windows there): the epoch's entry fails ids-in-range, naming the
    field and the range, where it read "14 of 10 samples once ... ok"; with N inferred (the
    largest id + 1 = 12) only -2 and -1 are outside."""
    report = tmp_path / "w.jsonl"
    for size in (10, None):
        loader = watch(DataLoader(Outside(), batch_size=2), report=str(report),
                       id_field="id", dataset_size=size, name=f"n{size}")
        for _ in loader:
            pass
    told, inferred = entries(report)
    assert failed(told) == failed(inferred) == {"ids-in-range"}
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sharddemo:")]
    assert "FAIL ids-in-range: id_field 'id' gave 4 ids outside 0..9 (-2, -1, 10, 11)" in \
        lines[0]
    assert "FAIL ids-in-range: id_field 'id' gave 2 ids below 0 (-2, -1)" in lines[1]


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(-1, 1)),
                min_size=2, max_size=4), st.booleans())
@settings(max_examples=200, deadline=None)
def test_repeat_and_order_verdicts_follow_the_running_ranks(ranks, replacement):
    """Any ranks (done 0 running or 1-2 at an end; repeats; order 1/0/-1), disjoint ids:
    no-unexplained-duplicates fails exactly when a running rank reports a repeat and the
    sampler does not draw with replacement; order-changes-each-epoch is judged only where every
    running rank compared, and fails exactly when every running rank repeats the order."""
    heads = [{"done": done, "steps": 10, "n": 100, "repeats": repeats,
              "examples": list(range(repeats)), "order": order}
             for done, repeats, order in ranks]
    ids = [[] if done else [r] for r, (done, _, _) in enumerate(ranks)]
    loader = {"draws": {"sampler": "RandomSampler", "replacement": True, "count": 100}}
    entry = judge_window(epoch=1, name="train", first=6, last=10, at=11, heads=heads, ids=ids,
                         earlier=0, n=100, loader=loader if replacement else None)
    running = [(repeats, order) for done, repeats, order in ranks if not done]
    verdicts = {v["verdict"]: v["ok"] for v in entry["verdicts"]}
    assert verdicts["no-unexplained-duplicates"] == (
        replacement or not any(repeats for repeats, _ in running))
    compared = bool(running) and all(order >= 0 for _, order in running)
    assert ("order-changes-each-epoch" in verdicts) == compared
    if compared:
        assert verdicts["order-changes-each-epoch"] == (not all(o == 1 for _, o in running))


# -- a rank's token part in the drain's row (step_windows.part_ints) ---------------------------

counts = st.integers(min_value=0, max_value=2**53)


@settings(max_examples=200, deadline=None)
@given(tokens=counts, slots=st.none() | counts, supervised=st.none() | counts,
       sources=st.none() | st.dictionaries(st.integers(0, 10**6).map(str),
                                           st.tuples(counts, counts).map(list), max_size=40))
def test_a_token_part_comes_back_from_the_row_as_it_went(tokens, slots, supervised, sources):
    """The epoch's part a rank sends in its last window row: the same dict on the other side,
    its sources in their order (the entry lists them so)."""
    from sharddemo.watching.step_windows import part_from_ints, part_ints

    part = {"tokens": tokens, "slots": slots, "supervised": supervised, "sources": sources}
    back = part_from_ints(part_ints(part))
    assert back == part and list(back["sources"] or []) == list(sources or [])


def test_named_sources_go_by_the_epochs_own_exchange():
    """A name that is no index (or an index written otherwise, '07') has no ints: None."""
    from sharddemo.watching.step_windows import part_ints

    for name in ("web", "07", "-1", "1.0"):
        assert part_ints({"tokens": 3, "slots": None, "supervised": None,
                          "sources": {"0": [1, 3], name: [2, 0]}}) is None
