"""What a lineage costs on disk, beside OLMo's per-step TSV of indices gzipped (docs/benchmarks.md,
"lineage size"; issue 52).

    python benchmarks/lineage_size.py              # the table
    python benchmarks/lineage_size.py --record     # and into benchmarks/results.json

For each N (2 x 10^5 and 10^8) and batch size (1, 4, 64), one rank's loop receives 2 x 10^5 ids
(`--samples`), shuffled: at N = 2 x 10^5 a whole epoch (a permutation of range(N)); at N = 10^8
the first 2 x 10^5 steps' worth of one (2 x 10^5 ids drawn without replacement from range(10^8),
in random order: the ids need the same 27 bits as the whole epoch's). And in order: at
N = 2 x 10^5 the epoch 0, 1, 2, ...; at N = 10^8 its last 2 x 10^5 ids (N - 2 x 10^5 .. N - 1,
so that the ids are as large as N's). Written two ways:

- ours: through the watch's own writer (sharddemo.watching.lineage.LineageWriter: append()
  once a batch, a torch tensor of ids; a chunk every 256 batches, as in training), the file
  header included; its CPU time per batch is printed too;
- OLMo's: one `step<TAB>idx idx ...` line per step (what OLMo keeps per rank), compressed
  with Python's gzip at its default level (9).

Bytes per sample of both, side by side, and the floor: log2(N) bits a sample (the ids' own
information, had they no order to them), and ceil(log2 N) bits, what ids packed to the bits N
needs take.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import tempfile
import time
import types

import numpy as np


def ours(ids: np.ndarray, batch: int) -> tuple[int, float]:
    """The bytes of the rank file the watch's writer makes for these batches, and its CPU
    time per batch (append and the chunks' writes)."""
    import torch

    from sharddemo.watching.lineage import LineageWriter

    os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
    with tempfile.TemporaryDirectory() as folder:
        state = types.SimpleNamespace(accelerator=None, n=None, name="train", epoch=0)
        writer = LineageWriter(folder, state)
        batches = [torch.from_numpy(ids[at:at + batch]) for at in range(0, len(ids), batch)]
        start = time.process_time()
        for tensor in batches:
            writer.append(0, tensor)
        writer.close()
        spent = time.process_time() - start
        return os.path.getsize(os.path.join(folder, "rank0.lineage")), spent / len(batches)


def olmo(ids: np.ndarray, batch: int) -> int:
    """The bytes of OLMo's per-step TSV of indices for these batches, gzipped."""
    lines = [f"{step}\t{' '.join(map(str, ids[at:at + batch].tolist()))}\n"
             for step, at in enumerate(range(0, len(ids), batch))]
    return len(gzip.compress("".join(lines).encode()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for n in (200_000, 10**8):
        shuffled = (rng.permutation(n) if n == args.samples
                    else rng.choice(n, args.samples, replace=False)).astype(np.int64)
        in_order = np.arange(n - args.samples, n, dtype=np.int64)
        for order, ids in (("shuffled", shuffled), ("in order", in_order)):
            for batch in (1, 4, 64):
                size, per_batch = ours(ids, batch)
                rows.append({"n": n, "order": order, "batch": batch, "samples": len(ids),
                             "ours": size / len(ids), "olmo_gzip_tsv": olmo(ids, batch)
                             / len(ids), "floor": math.log2(n) / 8,
                             "packed": math.ceil(math.log2(n)) / 8,
                             "write_us_per_batch": per_batch * 1e6})
                row = rows[-1]
                print(f"N={n:>11,} {order:8} batch {batch:>2}: ours {row['ours']:.3f} B/sample, "
                      f"OLMo gzipped TSV {row['olmo_gzip_tsv']:.3f}, floor log2(N) "
                      f"{row['floor']:.3f} (packed {row['packed']:.3f}); writer "
                      f"{row['write_us_per_batch']:.1f} us a batch", flush=True)
    if args.record:
        import datetime
        import platform

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.json")
        with open(path) as handle:
            results = json.load(handle)
        # (results.json only: docs/benchmarks.md carries hand-written rows that a render from
        # this file would drop; its "lineage size" row is rendered by render_doc.py the same)
        results["lineage_size"] = {
            "rows": rows, "date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}",
            "command": " ".join(["python", "benchmarks/lineage_size.py", *sys.argv[1:]]),
            "target": "below OLMo's gzipped TSV at every batch size, close to log2(N) bits"}
        with open(path, "w") as handle:
            json.dump(results, handle, indent=2)
            handle.write("\n")


if __name__ == "__main__":
    main()
