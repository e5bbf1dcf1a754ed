"""Ray Data's equal split in the analysis (pure: no torch, no ray): the rows
streaming_split(equal=True) drops are explained up to world_size - 1 (and a worker's short
last batch each where iter_torch_batches(drop_last=True)), named in words; a dataset Ray hands
whole to every worker is replication in Ray's words, and padding is named only where the
loader pads (Ray Data's batches pad nothing). The loader descriptions are those
watching.raydata.describe_batches (and rank.describe.describe_loader) write, as literals."""

from __future__ import annotations

from sharddemo.analysis.reasons import explain_missing, missing_ok, reason_sentence


def ray(split: str, world: int = 2, drop_last: bool = False) -> dict:
    return {"drop_last": drop_last, "ray_data": {"iterator": "StreamSplitDataIterator",
                                                 "split": split, "world_size": world}}


def test_the_rows_an_equal_split_drops_are_explained_up_to_world_size_minus_one():
    # 2 workers, batches of 4 (global 8): 1 row dropped is Ray's equal split; 2 are more
    # than it drops (at most 2 - 1 = 1)
    assert explain_missing(1, ray("equal"), None, 8) == ("ray-equal-split", True)
    assert explain_missing(2, ray("equal"), None, 8) == ("ray-equal-split", False)
    # 3 workers: up to 2
    assert explain_missing(2, ray("equal", 3), None, 12) == ("ray-equal-split", True)
    # drop_last=True in iter_torch_batches: up to 1 + 2 x 3 = 7 with batches of 4 on 2
    assert explain_missing(7, ray("equal", drop_last=True), None, 8) == ("ray-equal-split", True)
    assert explain_missing(8, ray("equal", drop_last=True), None, 8)[1] is False
    # an unequal split drops nothing by design: no reason
    assert explain_missing(1, ray("unequal"), None, 8) == (None, False)
    assert missing_ok({"missing_count": 1, "missing_reason": "ray-equal-split",
                       "missing_explained": True})


def test_the_reasons_say_it_in_ray_s_words():
    assert reason_sentence("ray-equal-split", ray("equal"), 11, 1).startswith(
        "ray's streaming_split(equal=True) drops up to world_size - 1 rows so that every "
        "worker gets the same number (2 workers: up to 1)")
    assert "NOT explained" in reason_sentence("ray-equal-split", ray("equal"), 11, 2, False)
    unsplit = {"ray_data": {"iterator": "DataIteratorImpl", "split": "none", "world_size": None}}
    assert "datasets_to_split" in reason_sentence("replication", unsplit, 11)
    assert "datasets_to_split" not in reason_sentence("replication", {}, 11)


def test_padding_is_named_only_where_the_loader_pads():
    """No padding in Ray Data's batches, nor in a DistributedSampler whose own order adds no id
    (sampler_padding 0: its total_size is N); a DistributedSampler that adds one, one that does
    not say, and accelerate's fill may pad."""
    from sharddemo.analysis.reasons import loader_pads

    assert not loader_pads(ray("none"))
    assert not loader_pads({"distributed_sampler": True, "sampler_padding": 0})
    assert loader_pads({"distributed_sampler": True, "sampler_padding": 1})
    assert loader_pads({"distributed_sampler": True})
    assert loader_pads({"batch_sampler_shard": True, "even_batches": True})
    assert "padding" not in reason_sentence("unexplained", ray("none"), 11)
