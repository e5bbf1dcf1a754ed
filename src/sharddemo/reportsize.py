"""How large the JSON report of a run will be, estimated from its options before any rank starts.

The JSON report lists every id each rank received, batch by batch; with `--gather batch` the
ids `accelerator.gather` and `gather_for_metrics` returned as well; and for a replicated loader
one entry per duplicated sample. At 10^6 samples that is hundreds of MB, which a terminal
takes longer to print than the ranks took to walk. The table and markdown print a bounded
excerpt whatever N; the count path (`--gather count`, `auto` from 1,000,000 samples) lists at
most 1,000 ids per list. So only a JSON report of an id path can be large, and the CLI says so
before the launch (commands.output.large_report_notice).

The model below counts the characters json.dumps writes for the big lists (compact above 10,000
samples, indented below: render.render_json), fitted on real reports of compare (2 and 3 ranks,
N = 5,000 and 20,001, toy and iterable sources, modes all and pitfalls, --gather batch and
epoch): within 3% of the file's size there (tests/ranks/test_launcher.py). What the parent cannot know (an
audited loader's batch size and whether it is prepared, an eval loader's length) is left out:
the estimate is then low.
"""

from __future__ import annotations

import math
from typing import Optional

from sharddemo.options import COUNT_FROM, PER_BATCH_GATHER_LIMIT, AuditOptions, RunOptions
from sharddemo.render import INDENT_LIMIT

# Above this the CLI warns before the launch.
LARGE_REPORT = 10 * 2**20
# The count path keeps at most this many ids in a list (missing, duplicates).
COUNT_LIST = 1_000
# A mode's epoch beside its id lists: its counts, reasons, workers, first batches.
EPOCH_BYTES = 4_000
COUNTED_EPOCH_BYTES = 10_000

# Modes whose loader accelerate prepares: gather_for_metrics is called on them.
PREPARED = {"prepared", "double-split", "unseeded"}


def mean_digits(n: int) -> float:
    """The mean number of decimal digits of the ids 0..n-1."""
    total, low, digits = 0, 0, 1
    while low < n:
        high = min(n, 10 ** digits)
        total += (high - low) * digits
        low, digits = high, digits + 1
    return total / max(n, 1)


class _Costs:
    """Bytes per id in a batch list, in a flat list, and per duplicate entry, as json.dumps
    writes them (compact, or indent=2 where the report is indented)."""

    def __init__(self, n: int, batch: Optional[int]):
        d = mean_digits(n)
        indented = n <= INDENT_LIMIT
        per_batch = 0.0 if batch is None else 1.0 / batch
        # compact: the digits and a comma, "[],"" per batch; indented: a line each, at the
        # depth of ranks[].batches[][] (about 20 spaces) or of gathered[] (about 12)
        self.batched = d + (22 + 36 * per_batch if indented else 1 + 3 * per_batch)
        self.flat = d + (14 if indented else 1)
        self.indented = indented
        self.d = d

    def duplicate(self, reason: str, causes: bool) -> float:
        """{"id", "count", "reason"} (and "causes" beside a stream's reasons)."""
        if self.indented:
            return self.d + 104 + len(reason) + (len(reason) + 60 if causes else 0)
        return self.d + 30 + len(reason) + (len(reason) + 14 if causes else 0)


def _mode_epoch(mode: str, n: int, world: int, batch: Optional[int], gather: str,
                source: str, workers: int, costs: _Costs) -> float:
    """The bytes of one epoch of one mode."""
    stream = source not in ("toy", "hf")
    copies = max(workers, 1) if source == "iterable-unsplit" else 1
    missing = duplicated = received = 0.0  # ids, over every rank
    reason = "replication"
    if mode in ("replicated", "silenced"):
        received = world * n * copies
        duplicated, reason = n, ("stream-replication" if stream else "replication")
    elif mode == "double-split":
        received = n / world
        missing = n - received
    elif mode in ("unseeded", "resampled"):
        # each rank deals its share of its own permutation (or of draws with replacement):
        # a sample is missed with probability (1 - 1/W)^W, and as many come twice
        received = n
        missing = duplicated = n * ((1 - 1 / world) ** world if mode == "unseeded"
                                    else math.exp(-1))
    elif mode == "no-nodesplitter":
        return EPOCH_BYTES  # it raises before its first batch
    else:
        received = n * copies
        if copies > 1:
            duplicated, reason = n, "worker-replication"
    if gather == "auto":
        if n >= COUNT_FROM:
            gather = "count"
        else:
            steps = received / world / batch if batch else math.inf
            gather = "batch" if steps <= PER_BATCH_GATHER_LIMIT else "epoch"
    if gather == "count":
        listed = min(missing, COUNT_LIST) * costs.flat
        return COUNTED_EPOCH_BYTES + listed + min(duplicated, COUNT_LIST) * costs.duplicate(
            reason, stream)
    size = EPOCH_BYTES + received * costs.batched + missing * costs.flat
    size += duplicated * costs.duplicate(reason, stream)
    if gather == "batch":
        size += received * costs.flat  # gathered
        if mode in PREPARED:
            size += received * costs.flat  # gathered_for_metrics
    return size


def compare_report_bytes(opts: RunOptions, world: int) -> int:
    """The JSON report of `compare` (or `run`) with these options on `world` ranks, in bytes;
    0 for the resume demo (its scenarios are fixed and small)."""
    if "resume" in opts.modes:
        return 0
    costs = _Costs(opts.dataset_size, opts.per_rank_batch(world))
    one = sum(_mode_epoch(mode, opts.dataset_size, world, opts.per_rank_batch(world),
                          opts.gather, opts.source, opts.num_workers, costs)
              for mode in opts.modes)
    return int(one * opts.epochs)


def audit_report_bytes(opts: AuditOptions, world: int) -> int:
    """The JSON report of `audit`: its train loader alone, as a sharded (or, with --expect
    replicated, a replicated) loader of --dataset-size samples whose batch size is not known
    here; 0 without --dataset-size (nothing to estimate from)."""
    n = opts.dataset_size
    if n is None:
        return 0
    mode = "replicated" if opts.expect == "replicated" else "sampler"
    # keep_ids (--plot, --resume-at): `auto` keeps every id at any size, gathered batch by
    # batch or once per epoch as the loader's length decides: the smaller here
    gather = "epoch" if opts.keep_ids and opts.gather == "auto" else opts.gather
    costs = _Costs(n, None)
    return int(_mode_epoch(mode, n, world, None, gather, "toy", 0, costs) * opts.epochs)


def what_it_lists(n: int, world: int, epochs: int, gather: str) -> str:
    """`every id of 3 epochs of 1,000,003 samples on 3 ranks, every batch gathered`."""
    how = {"batch": ", each batch's gather too", "epoch": ""}.get(gather, "")
    return (f"every id of {epochs} epoch(s) of {n:,} samples on {world} ranks, as each rank "
            f"received it{how}")


def size_warning(size: int, *, what: str, output: Optional[str], fmt: str,
                 can_count: bool) -> Optional[str]:
    """The line to print before the launch where the JSON report will pass LARGE_REPORT: it
    is printed (`--format json` without --output) or written to --output. None otherwise
    (the table and markdown print an excerpt)."""
    if size <= LARGE_REPORT or (output is None and fmt != "json"):
        return None
    count = "; --gather count keeps it to a few hundred KB" if can_count else ""
    mb = f"{size / 2**20:,.0f} MB"
    if output is None:
        return (f"the JSON report will be about {mb} ({what}), all of it printed: "
                f"--output FILE writes it to the file and prints a summary{count}")
    return f"the report written to {output} will be about {mb} ({what}){count}"
