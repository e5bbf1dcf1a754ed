"""Run by tests/ranks/test_scenarios.py under `accelerate launch`: every loader option, pitfall and
source of docs/scenarios.md, in one process group (one launch per world size).

    accelerate launch --config_file accelerate_configs/cpu2.yaml tests/scripts/rank_scenarios.py OUT.json
"""

import json
import sys
from dataclasses import replace

from sharddemo.rank.sources import build_source
from sharddemo.options import RunOptions
from sharddemo.rank.run import trace_mode
from sharddemo.rank.session import validate_not_alone, make_accelerator

# name -> (mode, options). N and B are picked so that each option shows its effect.
SCENARIOS = {
    "drop-last/prepared": ("prepared", dict(dataset_size=10, batch_size=3, drop_last=True)),
    "drop-last/sampler": ("sampler", dict(dataset_size=10, batch_size=3, drop_last=True)),
    "drop-last/replicated": ("replicated", dict(dataset_size=10, batch_size=3, drop_last=True)),
    "no-shuffle/prepared": ("prepared", dict(dataset_size=10, batch_size=3, shuffle=False)),
    "no-shuffle/sampler": ("sampler", dict(dataset_size=10, batch_size=3, shuffle=False)),
    "no-even-batches/prepared": ("prepared", dict(dataset_size=7, batch_size=3, even_batches=False)),
    "split-batches/prepared": ("prepared", dict(dataset_size=10, batch_size=6, split_batches=True)),
    "dispatch/prepared": ("prepared", dict(dataset_size=10, batch_size=3, shuffle=False,
                                           dispatch_batches=True)),
    "workers0/sampler": ("sampler", dict(dataset_size=20, batch_size=4)),
    "workers2/sampler": ("sampler", dict(dataset_size=20, batch_size=4, num_workers=2)),
    "workers0/prepared": ("prepared", dict(dataset_size=20, batch_size=4)),
    "workers2/prepared": ("prepared", dict(dataset_size=20, batch_size=4, num_workers=2)),
    "no-set-epoch/sampler": ("sampler", dict(dataset_size=16, batch_size=4, set_epoch=False)),
    "double-split": ("double-split", dict(dataset_size=10, batch_size=2, shuffle=False)),
    "unseeded": ("unseeded", dict(dataset_size=10, batch_size=2)),
    "toy/prepared": ("prepared", dict(dataset_size=10, batch_size=3)),
    "toy/sampler": ("sampler", dict(dataset_size=10, batch_size=3)),
    "toy/replicated": ("replicated", dict(dataset_size=10, batch_size=3)),
    "hf/prepared": ("prepared", dict(dataset_size=10, batch_size=3, source="hf")),
    "hf/sampler": ("sampler", dict(dataset_size=10, batch_size=3, source="hf")),
    "hf/replicated": ("replicated", dict(dataset_size=10, batch_size=3, source="hf")),
    "hf/split": ("split", dict(dataset_size=10, batch_size=3, source="hf")),
    "iterable/prepared": ("prepared", dict(dataset_size=10, batch_size=3, source="iterable")),
    "iterable/prepared-shard": ("prepared", dict(dataset_size=10, batch_size=3, source="iterable",
                                                 dispatch_batches=False)),
    "iterable/replicated": ("replicated", dict(dataset_size=10, batch_size=3, source="iterable")),
    # IterableDatasetShard in each of 2 DataLoader workers: one fill per worker.
    "iterable/shard-workers2": ("prepared", dict(dataset_size=10, batch_size=3, source="iterable",
                                                 dispatch_batches=False, num_workers=2)),
    "hf-stream/split": ("split", dict(dataset_size=12, batch_size=2, source="hf-stream", shards=4)),
    "hf-stream/prepared": ("prepared", dict(dataset_size=12, batch_size=2, source="hf-stream")),
    "hf-stream/unequal-files": ("split", dict(dataset_size=13, batch_size=2, source="hf-stream",
                                              shards=4)),
    "hf-stream/unequal-files-prepared": ("prepared", dict(dataset_size=13, batch_size=2,
                                                          source="hf-stream", shards=4,
                                                          dispatch_batches=False)),
    "hf-stream/replicated": ("replicated", dict(dataset_size=12, batch_size=2, source="hf-stream")),
    # Longer epochs (more batches than the count path keeps whole), for the count comparison.
    "long/prepared": ("prepared", dict(dataset_size=203, batch_size=4)),
    "long/sampler": ("sampler", dict(dataset_size=203, batch_size=4, num_workers=2)),
    "long/no-even-batches": ("prepared", dict(dataset_size=203, batch_size=4, even_batches=False)),
    "long/drop-last": ("prepared", dict(dataset_size=203, batch_size=4, drop_last=True)),
    "long/split-batches": ("prepared", dict(dataset_size=203, batch_size=6, split_batches=True)),
    "long/replicated": ("replicated", dict(dataset_size=203, batch_size=4)),
    "long/double-split": ("double-split", dict(dataset_size=203, batch_size=4)),
    "long/worker-replication": ("replicated", dict(dataset_size=203, batch_size=4,
                                                   source="iterable-unsplit", num_workers=2)),
    "long/iterable-shard": ("prepared", dict(dataset_size=203, batch_size=4, source="iterable",
                                             dispatch_batches=False)),
    "long/iterable-shard-workers2": ("prepared", dict(dataset_size=203, batch_size=4,
                                                      source="iterable", dispatch_batches=False,
                                                      num_workers=2)),
    "dispatch/unsplit-workers2": ("prepared", dict(dataset_size=11, batch_size=2,
                                                   source="iterable-unsplit", dispatch_batches=True,
                                                   num_workers=2)),
    "long/unsplit-shard-workers2": ("prepared", dict(dataset_size=203, batch_size=4,
                                                     source="iterable-unsplit",
                                                     dispatch_batches=False, num_workers=2)),
}
# Every scenario is walked twice: as the demos walk it (`auto`: every batch gathered) and by
# the count path (counts, order hashes, first and last batches), so tests can check that both
# give the same report.


def main(out_path: str) -> None:
    accelerator = make_accelerator("cpu", timeout=30)
    validate_not_alone(accelerator.num_processes)
    results = {}
    for name, (mode, kwargs) in SCENARIOS.items():
        opts = RunOptions(epochs=2, seed=5, modes=(mode,), **kwargs).validate()
        dataset = build_source(opts.source, opts.dataset_size, opts.shards)
        trace = trace_mode(accelerator, mode, dataset, opts)
        counted = trace_mode(accelerator, mode, build_source(opts.source, opts.dataset_size,
                                                             opts.shards),
                             replace(opts, gather="count"))
        if accelerator.is_main_process:
            results[name] = {"mode": mode, "options": opts.to_dict(), "trace": trace,
                             "counted": counted}
    if accelerator.is_main_process:
        results = {"world": accelerator.num_processes, "scenarios": results}
        with open(out_path, "w") as handle:
            json.dump(results, handle)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
