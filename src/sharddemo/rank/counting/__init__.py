"""The count path: walk an epoch of any size with about one byte per sample on each rank (two
bits from options.BITS_FROM = 2^26 samples: BitCounts).

From `options.COUNT_FROM` samples (auto), or with `--gather count`, no rank ships its ids
anywhere. Each rank walks its loader as a training loop does and keeps, for its own batches:

- a counter over the dataset, one uint8 per sample (numpy), raised for every id received;
- a running order hash (xxh3-128 over the ids as int64, batch after batch: 16 bytes; not a
  cryptographic hash, and nothing here needs one): equal hashes, same order; compared across
  ranks and across epochs;
- its batch sizes run-length encoded ([size, how many], usually one or two runs), which
  DataLoader worker made how many batches and samples, and the first and last `KEEP_BATCHES`
  batches themselves (or one per worker, where there are more workers), with the worker that
  made each (what the report prints, and where padding and loop-around leave their repeats);
- the ids it received more than once, with counts, and ids outside the dataset (both few,
  except where a loader really replicates; then capped).

Then each counter becomes a code per sample (0, 1, or 1 + shift when received more than
once; see encode) and ONE reduce (sum, onto the main process) gives, per sample, how many
ranks received it and how many received it more than once. Missing (0 ranks), coverage,
overlap between ranks and the exact copy count of every sample (ranks holding it + the extra
copies each rank listed) follow; the main process keeps a capped list of missing and
duplicated ids and their totals. Memory: the counter (N bytes) on every rank, and from 16
ranks on the wider code beside it (options.counter_bytes), plus what the loader itself holds
(a DistributedSampler keeps its whole index list).

Every rank calls `Counts.finish` together (it is a collective); rank.recorder.Recorder feeds it.

The modules, one noun each:

- counters.py: Counts and BitCounts, the log of an epoch on one rank and its `finish`;
- host.py: Running and BitRunning, the counter (or bitmaps), order hash and checks on the host;
- device.py: DeviceRunning, the same kept on the device the ids live on;
- wire.py: what a rank sends (encode, the code per sample; pack_detail, its detail; CHUNK);
- summary.py: the counted record on the main process (summarise, Tally, for_metrics).

FLUSH_IDS (the ids counted at a time) lives in counters.py and is not exported here: a test
that changes it sets `counters.FLUSH_IDS`, which is what Counts reads.
"""


from sharddemo.rank.counting.counters import (KEEP_BATCHES, MAX_COPIES, BitCounts, Counts,
                                              TooManyCopies)
from sharddemo.rank.counting.device import DeviceRunning
from sharddemo.rank.counting.host import BitRunning, Running
from sharddemo.rank.counting.summary import Tally, for_metrics, summarise
from sharddemo.rank.counting.wire import (CHUNK, code_layout, encode, pack_detail, slot_ints,
                                          unpack_detail)

__all__ = ["BitCounts", "BitRunning", "CHUNK", "Counts", "DeviceRunning", "KEEP_BATCHES",
           "MAX_COPIES", "Running", "Tally", "TooManyCopies", "code_layout", "encode",
           "for_metrics", "pack_detail", "slot_ints", "summarise", "unpack_detail"]
