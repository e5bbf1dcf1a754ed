"""What the count path over keys costs on one rank (rank.keys.KeyIndex): hashing keys, building
the index of the known keys, looking delivered keys up batch by batch, and the index's bytes a
key. One process, no ranks: each rank builds and uses its own index the same way.

    python benchmarks/keys_index.py [--record] [N ...]   (default N: 10^6 and 10^7 keys)

Keys "sample000000000", ...; lookups in batches of 4096, every key once. Prints one JSON line
per N; --record also writes them into benchmarks/results.json ("keys_index") and
docs/benchmarks.md.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

def measure(n: int) -> dict:
    from sharddemo.rank.keys import KeyIndex, key_hashes

    keys = [f"sample{i:09d}" for i in range(n)]
    start = time.perf_counter()
    key_hashes(keys)
    hashed = time.perf_counter() - start
    start = time.perf_counter()
    index = KeyIndex((keys[i:i + 65536] for i in range(0, n, 65536)), "bench")
    built = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, n, 4096):
        index.lookup(keys[i:i + 4096])
    looked = time.perf_counter() - start
    size = index.hashes.nbytes + index.checks.nbytes + index.slots.nbytes
    return {"keys": n, "hash_us_per_key": round(hashed / n * 1e6, 3),
            "build_s": round(built, 3), "lookup_us_per_key": round(looked / n * 1e6, 3),
            "index_bytes_per_key": size / n}


def main() -> None:
    args = sys.argv[1:]
    record = "--record" in args
    sizes = [int(a) for a in args if a != "--record"] or [1_000_000, 10_000_000]
    rows = []
    for n in sizes:
        rows.append(measure(n))
        print(json.dumps(rows[-1]))
    if not record:
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from render_doc import record_result

    record_result("keys_index", {"rows": rows, "date": datetime.date.today().isoformat(),
                                 "machine": f"{os.cpu_count()} cores, {platform.machine()}",
                                 "repeats": 1, "target": "- (no target: what keys cost)"})

if __name__ == "__main__":
    main()
