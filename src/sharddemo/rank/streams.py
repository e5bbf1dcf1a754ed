"""Streams whose own objects decide what an epoch deals, read without importing their library
(told by their classes and modules): WebDataset(resampled=True) and litdata's cycling
ParallelStreamingDataset draw by design (stream_draws: the loader's `draws`), and litdata's
StreamingDataset knows its whole size while its len() is one rank's share (litdata_length).
Used by rank/describe.py and the watch (watching/recording.py). litdata as measured with 0.2.76:
docs/frameworks.md, "litdata: what it does with data"."""

from __future__ import annotations

from typing import Optional


def stream_draws(dataset) -> Optional[dict]:
    """The draw of a stream that draws by design, as rank/describe.py's index_domain gives a
    loader's `draws`; None for any other dataset.

    WebDataset(resampled=True): every worker draws shards with replacement, as many as its
    epoch takes (with_epoch). litdata's ParallelStreamingDataset with a length: each pass takes
    that many samples a rank from a cycle over its data (litdata_cycle)."""
    if resampled_stream(dataset):
        return {"sampler": "WebDataset(resampled=True)", "replacement": True, "count": None}
    cycle = litdata_cycle(dataset)
    if cycle is not None:
        return {"sampler": cycle, "replacement": True, "count": None, "cycle": True}
    return None


def resampled_stream(dataset) -> bool:
    """Say whether a WebDataset pipeline's shards come from ResampledShards (resampled=True).

    Those are drawn with replacement, by design."""
    stages = getattr(dataset, "pipeline", None)
    return (isinstance(stages, list) and bool(stages)
            and type(stages[0]).__name__ == "ResampledShards")


def is_litdata(dataset) -> bool:
    """A dataset of litdata's (StreamingDataset, CombinedStreamingDataset,
    ParallelStreamingDataset), told by its module: sharddemo does not import litdata."""
    return type(dataset).__module__.split(".")[0] == "litdata"


def litdata_cycle(dataset) -> Optional[str]:
    """litdata's ParallelStreamingDataset built with a `length` (an int, or inf): it cycles its
    datasets, each pass taking `length` samples where the last one stopped (resume=True) or
    from the start again (resume=False), so a pass holds a window of the data, wrapping
    around, by design; its name with those settings. None for anything else."""
    if not is_litdata(dataset) or type(dataset).__name__ != "ParallelStreamingDataset":
        return None
    length = getattr(dataset, "_length", None)
    if length is None:
        return None
    resume = getattr(dataset, "resume", None)
    return (f"litdata ParallelStreamingDataset(length={length}"
            + (f", resume={resume})" if isinstance(resume, bool) else ")"))


def litdata_length(dataset) -> Optional[int]:
    """The samples a litdata StreamingDataset holds, across every rank: its chunks' items (what
    its index lists, or its `subsample`), before its drop_last. Not len(dataset), which is this
    rank's share (litdata splits by rank itself: 20 of 40 on each of 2 ranks; taken as N, every
    id of another rank's share was out of range). None for its wrappers (Combined,
    Parallel: a mixture, or a cycle of `length` draws) and where the index is not read."""
    regions = getattr(dataset, "region_of_interest", None)
    if type(dataset).__name__ != "StreamingDataset" or not isinstance(regions, list):
        return None
    try:
        return int(sum(int(end) - int(start) for start, end in regions)) or None
    except (TypeError, ValueError):
        return None
