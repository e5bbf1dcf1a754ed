"""What the watch's token meter (watching/tokens.py, TokenMeter) costs a step, in one process.

    python benchmarks/token_meter.py                        # the meter of this tree
    git show HEAD~1:src/sharddemo/watching/tokens.py > /tmp/old_tokens.py
    python benchmarks/token_meter.py --against /tmp/old_tokens.py   # and an earlier one
    python benchmarks/token_meter.py --watch --against /tmp/old_tokens.py  # inside watch()

The loop of benchmarks/watch_overhead.py --tokens, one process, one thread: a DataLoader over
a TensorDataset (batches of 64, shuffled, torch's own collate), each sample with a mask of 128
slots (a random length each) and a source index 0..2; between two batches an MLP step
(32-256-256-1, forward, backward, SGD) and an 8 MB write, so that each batch meets caches
that the step has emptied, as in a training loop. Only the meter's own calls are timed
(`TokenMeter.add` on each batch, its sums 64 batches at a time included, and `take` at the
epoch's end), in microseconds of the thread's CPU time a step (a wall clock would count the
time other work on the machine took the core in the middle of a call); `--against FILE` times the TokenMeter of another copy of
tokens.py the same way, the two meters alternating epoch by epoch so that the load of other
work on the machine hits both alike. Every epoch's figures of the two are checked equal.

The cases: the mask as int8, as int64 (a tokenizer's attention_mask) and as bool, each with
the sources (tokens=mask, sources=source: each row's tokens needed for the sources' tokens),
without them (the total alone), and with labels (tokens=(mask, labels), sources=source:
labels of 128 slots, -100 on the padding and on a random prompt).

--watch: the int8 case inside sharddemo.watch (one process, no accelerator, report=None,
`tokens=3, sources=4, weights=[1, 1, 1]`), each meter swapped in for the watch's, the
watch's per-batch call (WatchState.add) timed, against the same watch without tokens: what
the meter adds to the watch's step, the watch's own code on the same emptied caches included."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

BATCH, WIDTH, SLOTS = 64, 256, 128


class NoMeter:
    """A meter that does nothing: the floor of the timing itself (two clock reads a step, on
    cold caches), printed beside the meters."""

    def __init__(self, tokens, sources) -> None:
        pass

    def add(self, batch):
        return None

    def take(self) -> dict:
        return {}


def load_meter(path: str):
    """The TokenMeter class of the tokens.py at `path`."""
    spec = importlib.util.spec_from_file_location("tokens_against", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.TokenMeter


def dataset(steps: int, dtype, labels: bool) -> TensorDataset:
    """ids, x, y, a mask of SLOTS slots (`dtype`), a source index, and labels where asked."""
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH
    lengths = torch.randint(1, SLOTS + 1, (n, 1), generator=g)
    ones = torch.arange(SLOTS) < lengths
    fields = [torch.arange(n), torch.randn(n, 32, generator=g), torch.randn(n, 1, generator=g),
              ones.to(dtype), torch.randint(0, 3, (n,), generator=g)]
    if labels:
        prompt = torch.randint(0, SLOTS, (n, 1), generator=g)
        supervised = ones & (torch.arange(SLOTS) >= prompt)
        fields.append(torch.where(supervised, torch.randint(0, 50_000, (n, SLOTS), generator=g),
                                  torch.full((n, SLOTS), -100)))
    return TensorDataset(*fields)


def epoch(meter_class, tokens, sources, loader, inputs, model, optimizer, scratch) -> tuple:
    """One epoch of the loop with a fresh meter: (us a step inside the meter, its sums)."""
    meter = meter_class(tokens, sources)
    spent = 0.0
    steps = 0
    for batch in loader:
        start = time.thread_time()
        meter.add(batch)
        spent += time.thread_time() - start
        x, y = inputs(batch)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scratch.fill_(steps & 0xFF)  # (8 MB written: the caches emptied, as a bigger step would)
        steps += 1
    start = time.thread_time()
    sums = meter.take()
    spent += time.thread_time() - start
    return spent / steps * 1e6, sums


def watched_epochs(meters: dict, epochs: int, steps: int) -> None:
    """--watch: the int8 case inside sharddemo.watch itself (one process, no accelerator): each
    meter swapped in for the watch's TokenMeter, the watch's per-batch call (WatchState.add)
    timed on each batch, against the same watch without tokens= and sources=."""
    import sharddemo.watching.tokens as tokens_module
    from sharddemo import watch
    from sharddemo.watching.state import WatchState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scratch = torch.empty(8 << 20, dtype=torch.uint8)
    data = dataset(steps, torch.int8, labels=False)
    spent = [0.0]
    original = WatchState.add

    def timed(self, *a, **kw):
        start = time.thread_time()
        try:
            return original(self, *a, **kw)
        finally:
            spent[0] += time.thread_time() - start

    WatchState.add = timed  # type: ignore[method-assign]
    shipped = tokens_module.TokenMeter

    def run(meter_class) -> float:
        measures = ({} if meter_class is NoMeter else
                    dict(tokens=3, sources=4, weights=[1, 1, 1]))
        tokens_module.TokenMeter = shipped if meter_class is NoMeter else meter_class
        loader = watch(DataLoader(data, batch_size=BATCH, shuffle=True), report=None,
                       **measures)
        spent[0], count = 0.0, 0
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for count, batch in enumerate(loader, 1):  # (the watch's lines kept out)
                loss = torch.nn.functional.mse_loss(model(batch[1]), batch[2])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                scratch.fill_(count & 0xFF)
            loader.close()
        return spent[0] / count * 1e6

    names = {"no meter": "watch without tokens", "this tree": "this tree",
             "against": "against"}
    for meter_class in meters.values():
        run(meter_class)  # (a warm-up epoch each)
    times: dict = {name: [] for name in meters}
    for e in range(epochs):
        order = list(meters.items()) if e % 2 == 0 else list(meters.items())[::-1]
        for name, meter_class in order:
            times[name].append(run(meter_class))
    tokens_module.TokenMeter = shipped
    print("the watch's per-batch call (int8 mask, sources), us a step: " + ", ".join(
        f"{names[name]} {statistics.median(t):5.1f} (min {min(t):.1f}, max {max(t):.1f})"
        for name, t in times.items()))
    if "against" in times:
        diffs = [a - b for a, b in zip(times["against"], times["this tree"])]
        print(f"against - this tree: median {statistics.median(diffs):+.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="another tokens.py whose TokenMeter is timed too")
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs a meter and case")
    parser.add_argument("--steps", type=int, default=640, help="steps an epoch")
    parser.add_argument("--cases", default="int8,int64,bool,int8-total,int64-total,labels",
                        help="comma-separated: int8, int64, bool (with sources), int8-total, "
                        "int64-total (no sources), labels (int64 mask and labels, sources)")
    parser.add_argument("--watch", action="store_true",
                        help="time the watch's per-batch call with each meter inside it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from sharddemo.watching.tokens import TokenMeter

    meters = {"no meter": NoMeter, "this tree": TokenMeter}
    if args.against:
        meters["against"] = load_meter(args.against)
    if args.watch:
        watched_epochs(meters, args.epochs, args.steps)
        return
    model = torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scratch = torch.empty(8 << 20, dtype=torch.uint8)
    for case in args.cases.split(","):
        kind = case.split("-")[0]
        dtype = {"int8": torch.int8, "int64": torch.int64, "bool": torch.bool,
                 "labels": torch.int64}[kind]
        data = dataset(args.steps, dtype, labels=kind == "labels")
        tokens, sources = 3, (None if case.endswith("-total") else 4)
        if kind == "labels":  # (a dict batch: the labels field is named)
            names = ["id", "x", "y", "mask", "source", "labels"]
            rows = [dict(zip(names, row)) for row in zip(*data.tensors)]
            loader = DataLoader(rows, batch_size=BATCH, shuffle=True)
            tokens, sources = ("mask", "labels"), "source"

            def inputs(batch):
                return batch["x"], batch["y"]
        else:
            loader = DataLoader(data, batch_size=BATCH, shuffle=True)

            def inputs(batch):
                return batch[1], batch[2]

        def run(meter_class, loader=loader, tokens=tokens, sources=sources, inputs=inputs):
            return epoch(meter_class, tokens, sources, loader, inputs, model, optimizer,
                         scratch)
        for meter_class in meters.values():
            run(meter_class)  # (a warm-up epoch each)
        times: dict = {name: [] for name in meters}
        for e in range(args.epochs):
            seen: list = []
            order = list(meters.items()) if e % 2 == 0 else list(meters.items())[::-1]
            for name, meter_class in order:
                took, sums = run(meter_class)
                times[name].append(took)
                if meter_class is not NoMeter:
                    seen.append(sums)
            assert all(s == seen[0] for s in seen), (case, seen)
        line = ", ".join(f"{name} {statistics.median(t):5.1f} us (min {min(t):.1f}, max "
                         f"{max(t):.1f})" for name, t in times.items())
        if args.against:  # (the pairs of one epoch: the same minutes)
            diffs = [a - b for a, b in zip(times["against"], times["this tree"])]
            line += f"; against - this tree: median {statistics.median(diffs):+.1f} us"
        print(f"{case:12s} {line}", flush=True)
if __name__ == "__main__":
    main()
