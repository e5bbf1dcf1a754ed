"""Run by tests/ranks/test_truth_ranks.py under `accelerate launch`: a sampled subset of the truth
grid (fixed seed) and the known failures, through sharddemo's real rank-side path
(trace_mode: walk + collect), each case gathered per batch and once per epoch.

    accelerate launch --config_file accelerate_configs/cpu2.yaml tests/scripts/rank_truth.py OUT.json
"""

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package
from support.oracle import Case  # noqa: E402

from sharddemo.options import RunOptions
from sharddemo.rank.sources import build_source
from sharddemo.rank.run import trace_mode
from sharddemo.rank.session import validate_not_alone, make_accelerator

# The known failures: split_batches without even_batches at N = 22, 21, 2 (a short or
# empty last batch), no even_batches past the per-batch limit (N = 1006), unseeded without
# even_batches, replicated with drop_last.
REPRODUCTIONS = [
    Case("prepared", 22, 4, 0, shuffle=False, even_batches=False, split_batches=True, epochs=1),
    Case("prepared", 21, 4, 0, shuffle=False, even_batches=False, split_batches=True, epochs=1),
    Case("prepared", 2, 4, 0, shuffle=False, even_batches=False, split_batches=True, epochs=1),
    Case("prepared", 1006, 4, 0, even_batches=False, epochs=1),
    Case("unseeded", 11, 2, 0, even_batches=False, epochs=1),
    Case("replicated", 10, 3, 0, drop_last=True),
    # --split-batches with loaders accelerate does not prepare: each rank keeps the whole batch.
    Case("sampler", 17, 6, 0, drop_last=True, split_batches=True, epochs=1),
    Case("replicated", 20, 6, 0, split_batches=True, epochs=1),
    # The reference experiment: 8 samples, batch 4.
    Case("sampler", 8, 4, 0), Case("prepared", 8, 4, 0), Case("replicated", 8, 4, 0),
]


def sampled(world: int, count: int = 24) -> list:
    rng = random.Random(13 + world)
    out = []
    while len(out) < count:
        mode = rng.choice(["sampler", "replicated", "prepared", "double-split", "unseeded"])
        split = mode == "prepared" and rng.random() < 0.3
        b = rng.choice([world, 2 * world]) if split else rng.randint(1, 8)
        out.append(Case(mode, rng.choice([rng.randint(1, 64), 97]), b, world,
                        shuffle=rng.random() < 0.7, drop_last=rng.random() < 0.3,
                        even_batches=rng.random() < 0.6 if mode == "prepared" else True,
                        split_batches=split, num_workers=2 if rng.random() < 0.1 else 0))
    return out


# Per-rank counters (how often each of 5 samples arrived) for the count path's reduce; rank r
# uses row r. tests/ranks/test_truth_ranks.py holds the sums worked out by hand.
COUNTS = [[0, 1, 2, 1, 0], [1, 1, 0, 3, 0], [0, 0, 1, 1, 0]]


def reduced_codes(accelerator) -> dict:
    """The count path's per-sample codes, laid out for 2, 16 and 256 ranks (uint8, uint16,
    uint32), reduced onto the main process over these real ranks."""
    import numpy as np

    from sharddemo.rank.collect import reduce_to_main
    from sharddemo.rank.counting import encode

    out = {}
    for layout in (2, 16, 256):
        counts = np.array(COUNTS[accelerator.process_index], dtype=np.uint8)
        code, _ = encode(counts, layout)
        reduce_to_main(accelerator, code)()  # started, then waited for
        out[str(layout)] = [str(code.dtype), code.tolist()]
    return out


# A reader that mixes the toy sources' values (id + 1, shift 1) and HF-style id columns
# (shift 0) batch by batch: the count path subtracts a shift a flush at a time and must flush
# where it changes. Every rank walks these batches; tests/ranks/test_truth_ranks.py has the ids.
MIXED = [[1, 2], {"id": [2, 3]}, [5, 1], {"id": [1]}, [3], [4]]


def mixed_shift_walk(accelerator, strategy: str = "count") -> Optional[dict]:
    import torch

    from sharddemo.rank.sources import batch_values
    from sharddemo.rank.walk import walk_epoch

    batches = [{"id": torch.tensor(b["id"])} if isinstance(b, dict) else torch.tensor(b)
               for b in MIXED]
    return walk_epoch(accelerator, batches, lambda batch, tag: batch_values(batch), epoch=0,
                      strategy=strategy, n=6)


# The id path's payloads (rank.recorder.IdLog): batches of consecutive ids travel as their
# first id, and a rank's payload rides in the settling exchange where it fits its slot, else
# every rank's goes in one ragged gather. Each scenario is a list of batches per rank; the
# record must hold exactly these batches (tests/ranks/test_truth_ranks.py).
PAYLOADS = ("fits", "over", "mixed", "mixed-rev", "big", "empty", "uneven", "wrapped")


def payload_batches(scenario: str, rank: int) -> list:
    import random

    runs = [list(range(rank * 1000 + 100 * k, rank * 1000 + 100 * (k + 1))) for k in range(10)]
    order = list(range(1000))
    random.Random(rank).shuffle(order)
    listed = [order[100 * k:100 * (k + 1)] for k in range(10)]
    big = [[3_000_000_000 + i for i in batch] for batch in listed]  # past int32
    return {"fits": runs, "over": listed,
            "mixed": runs if rank == 0 else listed, "mixed-rev": listed if rank == 0 else runs,
            "big": big if rank == 1 else runs, "empty": [] if rank == 1 else runs,
            "uneven": runs[:rank + 1] + [[5, 3, 1], [], [7], [8, 9]] + listed[:rank],
            # a shard's last batch padded from the start: two runs
            "wrapped": runs[:5] + [list(range(rank * 1000 + 950, rank * 1000 + 1000))
                                   + list(range(50))]}[scenario]


def payload_walks(accelerator) -> dict:
    import torch

    from sharddemo.rank.sources import batch_values
    from sharddemo.rank.walk import walk_epoch

    out, runs = {}, {}
    for scenario in PAYLOADS:
        # the toy sources' values (id + 1: batch_values takes the shift off); twice, the second
        # epoch with the first's run lists at hand
        batches = [torch.tensor(b, dtype=torch.int64) + 1
                   for b in payload_batches(scenario, accelerator.process_index)]
        for epoch in (0, 1):
            rec = walk_epoch(accelerator, batches, lambda batch, tag: batch_values(batch),
                             epoch=epoch, strategy="epoch", n=4000, runs=runs)
            if rec is not None:
                out[f"{scenario}/{epoch}"] = [r["batches"] for r in rec["ranks"]]
    return out


def main(out_path: str) -> None:
    accelerator = make_accelerator("cpu", timeout=30)
    validate_not_alone(accelerator.num_processes)
    world = accelerator.num_processes
    cases = [c for c in REPRODUCTIONS
             if not c.split_batches or c.b % world == 0] + sampled(world)
    results = []
    for case in cases:
        case = dataclasses.replace(case, world=world)
        for gather in ("batch", "epoch"):
            opts = RunOptions(**case.run_options(), gather=gather).validate()
            trace = trace_mode(accelerator, case.mode, build_source(case.source, case.n), opts)
            if accelerator.is_main_process:
                results.append({"case": dataclasses.asdict(case), "gather": gather,
                                "trace": trace})
    codes = reduced_codes(accelerator)
    mixed = mixed_shift_walk(accelerator)
    mixed_ids = mixed_shift_walk(accelerator, "epoch")
    payloads = payload_walks(accelerator)
    if accelerator.is_main_process:
        with open(out_path, "w") as handle:
            json.dump({"world": world, "backend": accelerator.state.backend,
                       "results": results, "codes": codes, "mixed": mixed,
                       "mixed_ids": mixed_ids, "payloads": payloads}, handle)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
