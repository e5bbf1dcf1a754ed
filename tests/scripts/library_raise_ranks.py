"""Run by tests/ranks/test_library_raises.py under `accelerate launch` on 2 or 3 ranks: for each case
of a small grid over N, B, drop_last, dispatch_batches and split_batches, every rank walks
accelerate's own prepared loader (accelerate.data_loader.prepare_data_loader, as a training
loop does) and says what happened (its batches' sizes, or the exception's type and message),
then sharddemo's real rank-side path walks the same mode (run.trace_mode, `prepared`).

    accelerate launch --config_file accelerate_configs/cpu2.yaml tests/scripts/library_raise_ranks.py OUT.json
"""

import json
import sys

from sharddemo.options import RunOptions
from sharddemo.rank.collect import exchange_objects
from sharddemo.rank.run import trace_mode
from sharddemo.rank.session import validate_not_alone, make_accelerator
from sharddemo.rank.sources import build_source

SIZES = (1, 5, 8, 13)
BATCHES = (2, 4, 6)


def cases(world: int) -> list[dict]:
    out = []
    for n in SIZES:
        for b in BATCHES:
            for drop_last in (True, False):
                for dispatch in (True, False):
                    for split in (False, True):
                        if split and b % world:
                            continue  # accelerate refuses it when it prepares the loader
                        out.append({"n": n, "b": b, "drop_last": drop_last,
                                    "dispatch": dispatch, "split": split})
    return out


def library_outcome(accelerator, case: dict):
    """What accelerate's own prepared loader does on this rank, walked to its end."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    loader = prepare_data_loader(
        DataLoader(list(range(case["n"])), batch_size=case["b"], drop_last=case["drop_last"]),
        device=accelerator.device, num_processes=accelerator.num_processes,
        process_index=accelerator.process_index, split_batches=case["split"],
        dispatch_batches=case["dispatch"], put_on_device=True)
    try:
        return {"sizes": [len(batch) for batch in loader]}
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}


def main(out_path: str) -> None:
    accelerator = make_accelerator("cpu", timeout=30)
    validate_not_alone(accelerator.num_processes)
    world = accelerator.num_processes
    results = []
    for k, case in enumerate(cases(world)):
        library = exchange_objects(accelerator, library_outcome(accelerator, case))
        opts = RunOptions(dataset_size=case["n"], batch_size=case["b"], epochs=2,
                          modes=("prepared",), shuffle=False, drop_last=case["drop_last"],
                          split_batches=case["split"], dispatch_batches=case["dispatch"],
                          gather="batch" if k % 2 == 0 else "epoch").validate()
        trace = trace_mode(accelerator, "prepared", build_source("toy", case["n"]), opts)
        if accelerator.is_main_process:
            results.append({"case": case, "library": library, "trace": trace,
                            "gather": opts.gather})
    if accelerator.is_main_process:
        with open(out_path, "w") as handle:
            json.dump({"world": world, "backend": accelerator.state.backend,
                       "results": results}, handle)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
