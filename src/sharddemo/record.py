"""The record that crosses from the ranks to the parent: what both sides agree on.

The ranks (sharddemo.rank: the recorder and the per-batch walk) write one record per loader
and epoch; the parent's analysis (sharddemo.analysis) reads it. Two shapes, told apart by
`gather`:

- `"batch"` / `"epoch"` (ids): `{"epoch", "gather", "ranks": [{"rank", "batches": [[id, ...],
  ...], "workers": [worker per batch]}], "gathered_for_metrics", "remainder"}`: every id each
  rank received, batch by batch (rank.recorder.epoch_record).
- `"count"` (counts): `{"epoch", "gather": "count", "ranks": [{"rank", "steps", "samples",
  "head", "tail", "head_workers", "tail_workers", "sizes", "workers", "order_hash",
  "ascending", "repeats", "repeats_total", "out_of_range", "remainder"}], "coverage": {...}}`:
  per-sample counts reduced on the main rank, each rank's first and last batches and its
  order hash (rank.recorder.Recorder with how="count").

docs/architecture.md describes both field by field. This module imports nothing of
sharddemo's, so that the rank side (torch, sharddemo.rank) and the analysis (pure Python) both
read it without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Most ids any list in a counted record holds (missing, duplicated, out of range, ragged steps,
# a rank's repeats); the totals are always exact.
LIST_CAP = 1000
# Most ids of one kept batch the report lists (its first ones; `batch_sizes` has its size), so
# that the report stays small for any batch size too. The analysis reads the batches whole.
KEPT_BATCH_CAP = 4096


def loader_share(loader: Mapping[str, Any], n: int) -> int:
    """Return how many distinct ids a loader deals in an epoch, from its description.

    From rank.describe.index_domain: the ids a Subset or SubsetRandomSampler leaves it
    (`domain`), at most its sampler's draw without replacement; n where nothing narrows it."""
    draws, domain = loader.get("draws"), loader.get("domain")
    share = n if domain is None else domain
    if draws and not draws["replacement"]:
        share = min(share, draws["count"])
    return share


def interleave_steps(ranks: list[list[list[int]]]) -> list[int]:
    """What a per-batch all_gather returns: step by step, rank 0's batch, then rank 1's ..."""
    out: list[int] = []
    for step in range(max((len(b) for b in ranks), default=0)):
        for batches in ranks:
            if step < len(batches):
                out.extend(batches[step])
    return out


def largest_id(record: dict) -> int:
    """The largest id any rank received in an epoch's record of ids; -1 for none."""
    top = -1
    for rank in record["ranks"]:
        for batch in rank.get("batches", ()):
            if batch:
                top = max(top, max(batch))
    return top
