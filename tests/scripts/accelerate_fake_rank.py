"""accelerate's prepared loaders as rank 0 of W ranks sees them, in ONE process
(tests/ranks/test_library_raises.py's sweep): a gloo group of one process, with accelerate's PartialState
told there are W. accelerate's DataLoaderDispatcher decides on rank 0 what every rank gets
(rank 0 reads, then broadcasts what it read), so rank 0's pass is where it raises; its
collectives run on the one-process group. The real ranks' part of the test checks, on a
sample, that every rank raises the same.

    python tests/scripts/accelerate_fake_rank.py W    (then one JSON request a line on stdin:
    {"n", "b", "drop_last", "dispatch", "split"}; one JSON answer a line on stdout; an
    empty line ends it)

Each answer: {"batches": rank 0's ids} or {"type", "message", "line", "facts"}: the exception
accelerate raised, and sharddemo's one line for it (errors.library_error with the facts
rank.walk.loader_facts reads from the loader; None: not a library's exception).
"""

import json
import os
import sys
import tempfile
import types


def main(world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                                rank=0, world_size=1)
        from accelerate.data_loader import prepare_data_loader
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        from sharddemo.errors import library_error
        from sharddemo.rank.walk import loader_facts

        state = PartialState(cpu=True)
        state.distributed_type = DistributedType.MULTI_CPU  # (the one-process group's is NO)
        state.num_processes = world
        accelerator = types.SimpleNamespace(num_processes=world)
        for line in sys.stdin:
            if not line.strip():
                break  # the end (EOF may never come: a DataLoader worker the test forked
                #        holds the pipe's other end open too)
            case = json.loads(line)
            loader = prepare_data_loader(
                DataLoader(list(range(case["n"])), batch_size=case["b"],
                           drop_last=case["drop_last"]),
                device=torch.device("cpu"), num_processes=world, process_index=0,
                split_batches=case["split"], dispatch_batches=case["dispatch"],
                put_on_device=True)
            try:
                answer = {"batches": [batch.tolist() for batch in loader]}
            except Exception as exc:
                said = library_error(exc, loader_facts(accelerator, loader))
                answer = {"type": type(exc).__name__, "message": str(exc),
                          "line": said and said["error"], "frame": said and said["frame"]}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]))
    # Every answer is written: end here, as sharddemo's ranks do (os._exit), rather than in an
    # interpreter teardown that gloo's threads can hold up (docs/reliability.md).
    os._exit(0)
