"""A rank script for tests/ranks/test_watch.py: a watched accelerate loop that also keeps its own
account of the run, to check the watch against.

`collectives`: every torch.distributed collective is counted (wrapped here, in the test's
process only), step by step and at each epoch's end, for the same loop unwatched and then
watched (a prepared shuffled loader of `--n` ids, N = 40 by default, batches of `--batch`, 4 by
default; other than N, fetched a batch at a time: Ids); the main process prints one line,
COLLECTIVES <json>. With `--tokens index` (or `name`) each batch is a dict that also carries a
mask of 8 slots and a source (an index 0/1, or a name "web"/"code"), watched with tokens= and
sources=.

`torch`: torch.distributed alone (torchrun), no Accelerator: watch(loader) on a
DistributedSampler's loader.

`bad-field`: a prepared loader of dict batches ("x", "y") watched with id_field="nope": each
rank writes the error its loop raised and the batches its loop received before it to
`--ids`/rank<r>.txt, then ends cleanly (no rank is left waiting in a collective). With `--some`, rank 0's batches do have "nope" (only rank 1's
lack it): the ranks learn it together at the next exchange.

`stop`: a loop that stops mid-epoch at `--stop-at` (what every max_steps loop does), over a
prepared map-style loader (`--loader prepared`: N = 1000, batch 8), the same loader not prepared
(`--loader replicated`: every rank reads it whole, unseeded, in an order of its own) or a stream every rank reads
whole (`--loader stream`, with id_field), then ends the watched run as `--end` says: `close`
(loader.close() on every rank), `with` (the loader used as a context manager), `exit` (no close:
the process ends, and the watch's exit handler writes what the main process has) or `raise` (an
exception at the stop, inside the with block, on every rank: the watch cannot know that the
others are still there, and the main process writes what it has alone) or `late` (close()
after end_training(): the same, alone) or `left` (neither close() nor end_training(): the
process group is left to the interpreter's exit, and every torch.distributed call made after
the loop, the watch's exit handler's included, is appended to `--ids`/calls<r>.txt as it is
made). Each rank writes the ids it received to `--ids`/rank<r>.json.

`--check-every`: watch's check_every, "auto" (its default, passed as such) or a number of steps.

`windows`: whole epochs (`--epochs`) with window checks every `--check-every` steps, over
`--loader` prepared (N = 1001, batch 8, shuffled: accelerate's fill at the end), sampler (a
shuffling DistributedSampler over 1001 samples with set_epoch, batch 8: its padding at the end),
stream (every rank reads ids 0..999 whole, batch 8, id_field), hf (a datasets stream of 1001
ids in 4 shards, split_dataset_by_node unless `--no-split`, `--workers`, dataset_size=1001) or
uneven (a stream split by rank
whose lengths differ: rank r reads 30 * (r + 1) ids in batches of 2, so rank 0 runs out of
data after 15 steps while rank 1 goes on) or sized (the same ids, id_field=".", from a stream
whose len() is each rank's own part's: 30 on rank 0, 60 on rank 1). Each rank writes the ids it received, epoch by
epoch, to `--ids`/rank<r>.json; then loader.close() and end_training().

`cases`: several loaders in one launch, each watched under its own name (`--cases`, comma
separated), 2 epochs each, windows every `--check-every` steps: `dup` (a sampler of its own: rank r
takes every W-th of 1001 ids from r, and its 50th id comes again after its 60th, `--dup-at`:
an unexplained repeat), `replacement` (a prepared loader over RandomSampler(replacement=True), 1001 draws: repeats
by design), `shuffle` and `shuffle-no-set-epoch` (a shuffling DistributedSampler over 1001 with and
without set_epoch); batch 8 (`--batch`); `--on-violation`. Each rank writes the ids it received, epoch by epoch, to
`--ids`/<case>_rank<r>.json.

`stateful`: a prepared StatefulDataLoader (use_stateful_dataloader=True) with workers,
shuffled, unseeded (accelerate issue 4204), stopped with save_state after `--save-at` steps
and resumed with load_state; each rank writes the ids it received (the library's own
answer, read from the batches the loop trained on) to `--ids`/launch<k>_rank<r>.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, Sampler, TensorDataset

from sharddemo import watch

N = 40
CALLS: list[str] = []
COLLECTIVES = tuple(name for name in (
    "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "broadcast", "gather", "scatter", "all_gather_object", "broadcast_object_list", "barrier",
    "reduce_scatter_tensor", "all_to_all", "send", "recv") if hasattr(dist, name))
DEPTH = [0]  # (torch 2.13's all_gather_into_tensor calls all_gather_single: counted once)


def count_collectives() -> None:
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            if not DEPTH[0]:
                CALLS.append(_name)
            DEPTH[0] += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                DEPTH[0] -= 1

        setattr(dist, name, counted)


def note_process_group_calls(path: str) -> None:
    """From now on, every collective and every call that ends or makes a process group is
    appended to `path` as it is made (a line each), so that calls made at the interpreter's
    exit are on disk too."""
    open(path, "w").close()
    for name in (*COLLECTIVES, "destroy_process_group", "new_group", "monitored_barrier"):
        fn = getattr(dist, name)

        def noted(*args, _fn=fn, _name=name, **kwargs):
            with open(path, "a") as handle:
                handle.write(_name + "\n")
            return _fn(*args, **kwargs)

        setattr(dist, name, noted)


class Uneven(Sampler):
    """Batches of 4000, 4000, 1000 and 1000 ids for a dataset of 10,000: each rank's first
    and last batches (5000 ids) outgrow the slot the watch sizes for a loader that names no
    batch size (about 3,500 int64s: batches of 64, and the capped lists)."""

    def __iter__(self):
        return iter([list(range(0, 4000)), list(range(4000, 8000)), list(range(8000, 9000)),
                     list(range(9000, 10000))])

    def __len__(self):
        return 4


class Tokened(torch.utils.data.Dataset):
    """Sample i: its id, a mask of 8 slots with i % 8 + 1 ones, and its source (i % 2: the
    index, or its name)."""

    def __init__(self, n: int, named: bool) -> None:
        self.n, self.named = n, named

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        mask = (torch.arange(8) <= i % 8).to(torch.int8)
        return {"id": i, "mask": mask, "source": ("web", "code")[i % 2] if self.named else i % 2}


class Ids(torch.utils.data.Dataset):
    """Ids 0..n-1, a batch fetched at once (torch's fetcher calls __getitems__ with the batch's
    indices): batches of thousands cost the loop little. A batch is (ids,), as a TensorDataset
    of the ids gives it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i

    def __getitems__(self, indices):
        return torch.tensor(indices)

    @staticmethod
    def collate(ids):
        return (ids,)


def walk(loader, epochs: int) -> list[dict]:
    out = []
    for _ in range(epochs):
        start, steps = len(CALLS), []
        batches = iter(loader)
        while True:
            before = len(CALLS)
            try:
                next(batches)
            except StopIteration:
                break
            steps.append(len(CALLS) - before)
        out.append({"total": len(CALLS) - start, "steps": steps})
    return out


def collectives(args, accelerator) -> None:
    count_collectives()
    runs = {}
    for watched in (False, True):
        if args.uneven:
            data = TensorDataset(torch.arange(10000))
            loader = DataLoader(data, batch_sampler=Uneven())
        elif args.tokens:
            loader = DataLoader(Tokened(args.n, args.tokens == "name"),
                                batch_size=args.batch or 4, shuffle=True)
        else:
            data = TensorDataset(torch.arange(N)) if args.n == N else Ids(args.n)
            loader = DataLoader(data, batch_size=args.batch or 4, shuffle=True,
                                collate_fn=None if args.n == N else Ids.collate)
        measured = {}
        if args.tokens:
            weights = [0.5, 0.5] if args.tokens == "index" else {"web": 0.5, "code": 0.5}
            measured = dict(tokens="mask", sources="source", weights=weights)
        if watched:
            loader = watch(loader, accelerator, report=None, on_violation=args.on_violation,
                           check_every=args.check_every, **measured)
        loader = accelerator.prepare(loader)
        runs["watched" if watched else "plain"] = walk(loader, 2)
    if accelerator.is_main_process:
        print("COLLECTIVES " + json.dumps(runs), flush=True)
    accelerator.end_training()


def stateful(args, accelerator) -> None:
    loader = DataLoader(TensorDataset(torch.arange(N)), batch_size=4, shuffle=True,
                        num_workers=2)
    loader = watch(loader, accelerator, report=args.report)
    loader = accelerator.prepare(loader)
    launch = 2 if args.resume_from else 1
    if args.resume_from:
        accelerator.load_state(args.resume_from)
    seen: list[list[int]] = []
    for _ in range(2):  # launch 2: the rest of epoch 0 (the loader resumes itself), epoch 1
        mine: list[int] = []
        seen.append(mine)
        for step, (ids,) in enumerate(loader):
            mine += ids.tolist()
            if launch == 1 and step + 1 == args.save_at:
                accelerator.save_state(args.checkpoint)
                break
        if launch == 1:
            break
    path = os.path.join(args.ids, f"launch{launch}_rank{accelerator.process_index}.json")
    with open(path, "w") as handle:
        json.dump(seen, handle)
    loader.close()
    accelerator.end_training()


class Stream(torch.utils.data.IterableDataset):
    """Ids 0..999, the whole stream on every rank that reads it (not split: the bug)."""

    def __iter__(self):
        return iter({"id": i, "x": float(i)} for i in range(1000))


def stop(args, accelerator) -> None:
    if args.loader == "stream":
        loader = watch(DataLoader(Stream(), batch_size=8), accelerator, report=args.report,
                       id_field="id")
    elif args.loader == "replicated":  # every rank reads the 1,000 whole, in its own order
        loader = watch(DataLoader(TensorDataset(torch.arange(1000)), batch_size=8,
                                  shuffle=True), accelerator, report=args.report)
    else:
        loader = watch(DataLoader(TensorDataset(torch.arange(1000)), batch_size=8,
                                  shuffle=True), accelerator, report=args.report)
        loader = accelerator.prepare(loader)
    mine: list[int] = []
    by_epoch: list[list[int]] = []

    def train() -> None:
        for _ in range(args.epochs):  # (--epochs 3: every epoch capped at --stop-at steps)
            by_epoch.append([])
            for step, batch in enumerate(loader):
                got = (batch["id"] if isinstance(batch, dict) else batch[0]).tolist()
                mine.extend(got)
                by_epoch[-1].extend(got)
                if step + 1 == args.stop_at:
                    if args.end == "raise":
                        raise RuntimeError("the loop's own error mid-epoch")
                    break

    def write_ids() -> None:
        path = os.path.join(args.ids, f"rank{accelerator.process_index}.json")
        with open(path, "w") as handle:
            json.dump(mine, handle)
        with open(path.replace(".json", ".epochs.json"), "w") as handle:
            json.dump(by_epoch, handle)

    if args.end in ("with", "raise"):
        try:
            with loader:
                train()
        except RuntimeError as error:
            assert args.end == "raise", error
    elif args.end == "left":  # the process group is left to the interpreter's exit
        train()
        write_ids()
        note_process_group_calls(os.path.join(args.ids, f"calls{accelerator.process_index}.txt"))
        return
    elif args.end == "late":  # the process group ended first: close() cannot meet the others
        train()
        write_ids()
        accelerator.end_training()
        loader.close()
        return
    else:
        train()
        if args.end == "close":
            loader.close()
    write_ids()
    accelerator.end_training()


class UnevenStream(torch.utils.data.IterableDataset):
    """Rank r's part of a stream: ids r, r + W, ..., 30 * (r + 1) of them."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def __iter__(self):
        return iter({"id": self.rank + self.world * k} for k in range(30 * (self.rank + 1)))


class SizedStream(torch.utils.data.IterableDataset):
    """Rank r's part of a stream whose len() is its own part's: ids r, r + W, ..., 30 * (r + 1)
    of them, and len() says so (it differs by rank)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def __iter__(self):
        return iter(self.rank + self.world * k for k in range(len(self)))

    def __len__(self):
        return 30 * (self.rank + 1)


def windows(args, accelerator) -> None:
    from torch.utils.data import DistributedSampler

    common = dict(report=args.report, check_every=args.check_every,
                  on_violation=args.on_violation)
    sampler = None
    if args.loader == "stream":
        loader = watch(DataLoader(Stream(), batch_size=8), accelerator, id_field="id", **common)
    elif args.loader == "uneven":
        data = UnevenStream(accelerator.process_index, accelerator.num_processes)
        loader = watch(DataLoader(data, batch_size=2), accelerator, id_field="id", **common)
    elif args.loader == "sized":
        data = SizedStream(accelerator.process_index, accelerator.num_processes)
        loader = watch(DataLoader(data, batch_size=2), accelerator, id_field=".", **common)
    elif args.loader == "hf":
        import datasets
        from datasets.distributed import split_dataset_by_node

        stream = datasets.Dataset.from_dict({"id": list(range(1001))}).to_iterable_dataset(
            num_shards=4)
        mine = stream if args.no_split else split_dataset_by_node(
            stream, rank=accelerator.process_index, world_size=accelerator.num_processes)
        loader = watch(DataLoader(mine, batch_size=8, num_workers=args.workers), accelerator,
                       id_field="id", dataset_size=1001, **common)
    elif args.loader == "sampler":
        data = TensorDataset(torch.arange(1001))
        sampler = DistributedSampler(data, shuffle=True, seed=0)
        loader = watch(DataLoader(data, batch_size=8, sampler=sampler), accelerator, **common)
    else:
        loader = watch(DataLoader(TensorDataset(torch.arange(1001)), batch_size=8,
                                  shuffle=True), accelerator, **common)
        loader = accelerator.prepare(loader)
    seen: list[list[int]] = []
    path = os.path.join(args.ids, f"rank{accelerator.process_index}.json")
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        mine: list[int] = []
        seen.append(mine)
        for batch in loader:
            mine.extend((batch["id"] if isinstance(batch, dict) else
                         batch if torch.is_tensor(batch) else batch[0]).tolist())
            with open(path, "w") as handle:  # (what came, even where the watch raises)
                json.dump(seen, handle)
    loader.close()
    accelerator.end_training()


class Repeating(Sampler):
    """Rank r's every W-th id of 1001 from r, with its 50th id dealt again after its 60th (after
    its `at`-th)."""

    def __init__(self, rank: int, world: int, at: int = 60) -> None:
        self.mine = list(range(rank, 1001, world))
        self.mine.insert(at, self.mine[49])

    def __iter__(self):
        return iter(self.mine)

    def __len__(self):
        return len(self.mine)


def cases(args, accelerator) -> None:
    from torch.utils.data import DistributedSampler, RandomSampler

    rank, world = accelerator.process_index, accelerator.num_processes
    data = TensorDataset(torch.arange(1001))
    for case in args.cases.split(","):
        common = dict(name=case, report=args.report, check_every=args.check_every,
                      on_violation=args.on_violation)
        sampler = None
        if case == "dup":
            loader = watch(DataLoader(data, batch_size=args.batch or 8,
                                      sampler=Repeating(rank, world, args.dup_at)),
                           accelerator, **common)
        elif case == "replacement":
            loader = watch(DataLoader(data, batch_size=8,
                                      sampler=RandomSampler(data, replacement=True)),
                           accelerator, **common)
            loader = accelerator.prepare(loader)
        else:
            sampler = DistributedSampler(data, shuffle=True, seed=0)
            loader = watch(DataLoader(data, batch_size=8, sampler=sampler), accelerator,
                           **common)
        seen: list[list[int]] = []
        for epoch in range(2):
            if case == "shuffle":
                sampler.set_epoch(epoch)
            mine: list[int] = []
            seen.append(mine)
            for (ids,) in loader:
                mine.extend(ids.tolist())
                if args.on_violation == "raise":  # (what came, even where the watch raises)
                    with open(os.path.join(args.ids, f"{case}_rank{rank}.json"), "w") as out:
                        json.dump(seen, out)
        with open(os.path.join(args.ids, f"{case}_rank{rank}.json"), "w") as handle:
            json.dump(seen, handle)
        loader.close()
    accelerator.end_training()


class Rows(torch.utils.data.Dataset):
    def __init__(self, with_field: bool = False) -> None:
        self.with_field = with_field

    def __len__(self):
        return N

    def __getitem__(self, i):
        row = {"x": torch.tensor([float(i)]), "y": torch.tensor(i)}
        if self.with_field:
            row["nope"] = torch.tensor(i)
        return row


def bad_field(args, accelerator) -> None:
    rows = Rows(with_field=args.some and accelerator.process_index == 0)
    loader = watch(DataLoader(rows, batch_size=4, shuffle=True), accelerator,
                   report=args.report, id_field="nope", check_every=args.check_every)
    loader = accelerator.prepare(loader)
    said, received = "no error", 0
    try:
        for _ in loader:
            received += 1
    except ValueError as error:
        said = str(error)
    with open(os.path.join(args.ids, f"rank{accelerator.process_index}.txt"), "w") as handle:
        handle.write(f"{said}\n{received}")
    accelerator.end_training()


def plain_torch(args) -> None:
    """torch.distributed alone (torchrun, SLURM srun): no Accelerator, a DistributedSampler,
    watch(loader) with no accelerator; --no-set-epoch leaves set_epoch uncalled."""
    from torch.utils.data import DistributedSampler

    dist.init_process_group("gloo")
    data = TensorDataset(torch.arange(N))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = watch(DataLoader(data, batch_size=4, sampler=sampler), report=args.report)
    for epoch in range(2):
        if not args.no_set_epoch:
            sampler.set_epoch(epoch)
        for _ in loader:
            pass
    dist.destroy_process_group()


def check_every(value: str):
    """--check-every: "auto" (watch's default) or a number of steps."""
    return value if value == "auto" else int(value)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["collectives", "stateful", "torch", "stop", "windows",
                                         "bad-field", "cases"])
    parser.add_argument("--cases", default="dup,replacement,shuffle,shuffle-no-set-epoch")
    parser.add_argument("--some", action="store_true")
    parser.add_argument("--loader", choices=["prepared", "stream", "sampler", "uneven", "hf",
                                             "replicated", "sized"],
                        default="prepared")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--check-every", type=check_every, default="auto")
    parser.add_argument("--n", type=int, default=N)
    parser.add_argument("--batch", type=int)  # (collectives: 4, cases: 8)
    parser.add_argument("--dup-at", type=int, default=60)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--no-split", action="store_true")
    parser.add_argument("--end", choices=["close", "with", "exit", "raise", "late", "left"],
                        default="close")
    parser.add_argument("--stop-at", type=int, default=20)
    parser.add_argument("--no-set-epoch", action="store_true")
    parser.add_argument("--on-violation", default="warn")
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--tokens", choices=["index", "name"])
    parser.add_argument("--report")
    parser.add_argument("--ids")
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--checkpoint")
    parser.add_argument("--resume-from")
    args = parser.parse_args()
    if args.mode == "torch":
        plain_torch(args)
    elif args.mode == "collectives":
        collectives(args, Accelerator(cpu=True))
    elif args.mode == "bad-field":
        bad_field(args, Accelerator(cpu=True))
    elif args.mode == "stop":
        stop(args, Accelerator(cpu=True))
    elif args.mode == "windows":
        windows(args, Accelerator(cpu=True))
    elif args.mode == "cases":
        cases(args, Accelerator(cpu=True))
    else:
        config = DataLoaderConfiguration(use_stateful_dataloader=True)
        stateful(args, Accelerator(cpu=True, dataloader_config=config))


if __name__ == "__main__":
    main()
