"""A rank script for tests/ranks/test_watch_prepare_forms.py: a user's accelerate loop, written the
ways people write `watch()` around `prepare()`, that logs the ids each rank's loop received.

`--form`:
- `two-lines`: `loader = watch(loader, accelerator)`, then `accelerator.prepare(...)` (the
  README's form);
- `inside-prepare`: `model, optimizer, loader = accelerator.prepare(model, optimizer,
  watch(loader, accelerator))` (Python looks `accelerator.prepare` up before watch() runs);
- `inside-prepare-one`: `loader = accelerator.prepare(watch(DataLoader(...), accelerator))`;
- `inside-prepare-data-loader`: `loader = accelerator.prepare_data_loader(watch(loader,
  accelerator))`: a form the watch cannot follow; it must say so, never stay silent.

N = 40 ids, batches of 4, shuffled, 2 epochs. Each rank writes the ids its loop received,
epoch by epoch, to `--ids`/rank<r>.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from sharddemo import watch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--form", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--ids", required=True)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    data = TensorDataset(torch.arange(40), torch.randn(40, 3))
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.form == "two-lines":
        loader = watch(DataLoader(data, batch_size=4, shuffle=True), accelerator,
                       report=args.report)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    elif args.form == "inside-prepare":
        loader = DataLoader(data, batch_size=4, shuffle=True)
        model, optimizer, loader = accelerator.prepare(
            model, optimizer, watch(loader, accelerator, report=args.report))
    elif args.form == "inside-prepare-one":
        loader = accelerator.prepare(watch(DataLoader(data, batch_size=4, shuffle=True),
                                           accelerator, report=args.report))
    elif args.form == "inside-prepare-data-loader":
        loader = accelerator.prepare_data_loader(
            watch(DataLoader(data, batch_size=4, shuffle=True), accelerator,
                  report=args.report))
    else:
        raise SystemExit(f"unknown --form {args.form}")
    seen = []
    for _epoch in range(2):
        ids = []
        for batch_ids, x in loader:
            ids += batch_ids.tolist()
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        seen.append(ids)
    with open(os.path.join(args.ids, f"rank{accelerator.process_index}.json"), "w") as out:
        json.dump(seen, out)
    accelerator.end_training()
    del model, optimizer
    accelerator.free_memory()


if __name__ == "__main__":
    main()
