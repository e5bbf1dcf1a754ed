"""Reproduce the worker deadlock that `sharddemo.rank.collect.guard_forks` prevents.

On CPython 3.11.7 (this machine and the CI machines), a DataLoader that forks its workers
right after a collective sometimes leaves a worker deadlocked inside `os.fork()` (gdb:
`PyOS_AfterFork_Child` -> `_PyThreadState_DeleteExcept`, waiting on the runtime's HEAD lock,
CPython gh-112275). Its rank waits for that worker forever and the other ranks fail their next
collective when the process-group timeout (30 s here) runs out.

    accelerate launch --config_file accelerate_configs/cpu2.yaml \\
        benchmarks/fork_after_collective.py {gather|object} {plain|guarded} [ITERATIONS]

`gather`: `accelerator.gather` of one int, then a 2-worker DataLoader of 20 samples, walked with
a gather per batch; `object`: the same after accelerate's `gather_object`. `guarded` installs
`guard_forks()` first, as every sharddemo rank does. Exit 0 and one line when every iteration
finished; exit 1 when a rank hung. Measured here, 2 cores, 500 iterations per run
(docs/reliability.md): plain gather hung 2 of 2 runs, plain object 2 of 2 (after 37-69 s);
guarded gather 0 of 3, guarded object 0 of 3 (38-42 s each).
"""

import datetime
import sys
import time

import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from accelerate.utils import gather_object
from torch.utils.data import DataLoader, Dataset

from sharddemo.rank.collect import guard_forks


class Numbers(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return i


def main(how: str, guarded: bool, iterations: int) -> None:
    if guarded:
        guard_forks()
    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(
        backend="gloo", timeout=datetime.timedelta(seconds=30))])
    start = time.monotonic()
    for it in range(iterations):
        if how == "object":
            gather_object([{"iteration": it}])
        else:
            accelerator.gather(torch.tensor([it]))
        for batch in DataLoader(Numbers(), batch_size=4, num_workers=2):
            accelerator.gather(batch)
    if accelerator.is_main_process:
        print(f"{how} {'guarded' if guarded else 'plain'}: {iterations} iterations in "
              f"{time.monotonic() - start:.1f} s, no hang")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "guarded", int(sys.argv[3]) if len(sys.argv) > 3 else 500)
