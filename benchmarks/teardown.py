"""How often a 2-rank accelerate loop aborts as its processes exit (docs/reliability.md, "A
rank that aborts as it exits").

    python benchmarks/teardown.py                          # every variant, the default counts
    python benchmarks/teardown.py --variants none --launches 30 --log runs.jsonl
    python benchmarks/teardown.py --table runs.jsonl         # the table of what a log holds

Each launch is `accelerate launch --config_file accelerate_configs/cpu2.yaml` of this file on 2
gloo ranks: a prepared model (DDP) and a prepared shuffled DataLoader of 80 samples, batch 4,
2 epochs (10 steps an epoch a rank), then one of these ends:

  none          the loop ends and the script ends: the process group is left to the
                interpreter's exit (what the issue's users wrote)
  break         `accelerator.save_state(DIR)` at step 3 of epoch 1, `break`, the script ends
  exit          the same save, then `sys.exit(0)` inside the loop
  end_training  the loop ends, then `accelerator.end_training()` (the README's clean end)
  destroy       the loop ends, then `torch.distributed.destroy_process_group()`
  release       `accelerator.end_training()`, then every reference to what holds the process
                group dropped while the interpreter is whole: the model (DDP keeps the group),
                the optimizer, `accelerator.free_memory()`, `gc.collect()`

each unwatched and watched (`watch(loader, accelerator, report=...)`, its default windows). The
launches run one after another, round by round (each round one launch of each variant,
unwatched and watched, in alternating order). Counted per launch: the exit
code of `accelerate launch`, whether a rank printed "terminate called without an active
exception" (the abort), and, for a watched launch, whether its report was written. Python's
fault handler is on in the ranks (PYTHONFAULTHANDLER=1), so an aborted rank shows its threads'
Python stacks: where the process was when it died.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "accelerate_configs", "cpu2.yaml")
ABORT = "terminate called without an active exception"
VARIANTS = ("none", "break", "exit", "end_training", "destroy", "release")
# launches of each variant, watched and unwatched each (--launches overrides)
DEFAULT_LAUNCHES = {"none": 30, "break": 10, "exit": 10, "end_training": 30, "destroy": 10,
                    "release": 10}


def rank_main(variant: str, watched: bool, out: str) -> None:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    data = TensorDataset(torch.arange(80), torch.randn(80, 8), torch.randn(80, 1))
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    if watched:
        from sharddemo import watch

        loader = watch(loader, accelerator, report=os.path.join(out, "watch.jsonl"))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(2):
        for step, (_, x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if epoch == 1 and step == 3 and variant in ("break", "exit"):
                accelerator.save_state(os.path.join(out, "checkpoint"))
                if variant == "exit":
                    sys.exit(0)
                break
    if variant == "end_training":
        accelerator.end_training()
    elif variant == "destroy":
        torch.distributed.destroy_process_group()
    elif variant == "release":
        import gc

        accelerator.end_training()
        del model, optimizer, loader
        accelerator.free_memory()
        gc.collect()


def launch(variant: str, watched: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG,
               "--num_processes", "2", __file__, "--rank", variant,
               *(["--watched"] if watched else []), "--out", tmp]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        report = os.path.join(tmp, "watch.jsonl")
        entries = 0
        if os.path.exists(report):
            with open(report) as handle:
                entries = sum(1 for line in handle if line.strip())
    aborted = ABORT in proc.stderr
    # where an aborted rank was: the first Python frame of its fault handler's dump
    stack = ""
    if aborted:
        lines = proc.stderr.splitlines()
        for i, line in enumerate(lines):
            if "Fatal Python error: Aborted" in line:
                stack = " | ".join(lines[i:i + 12])
                break
    return {"variant": variant, "watched": watched, "exit": proc.returncode,
            "aborted": aborted, "report_entries": entries, "stack": stack,
            "stderr_tail": proc.stderr[-1500:] if proc.returncode and not aborted else ""}


def table(rows: list[dict]) -> str:
    lines = ["| end of the script | unwatched: aborted / launches | watched: aborted / launches |"
             " other failures |",
             "|---|---|---|---|"]
    for variant in VARIANTS:
        cells = []
        other = 0
        for watched in (False, True):
            got = [r for r in rows if r["variant"] == variant and r["watched"] == watched]
            cells.append(f"{sum(r['aborted'] for r in got)} / {len(got)}" if got else "-")
            other += sum(1 for r in got if r["exit"] != 0 and not r["aborted"])
        if cells != ["-", "-"]:
            lines.append(f"| {variant} | {cells[0]} | {cells[1]} | {other} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--launches", nargs="+", default=[], metavar="K_OR_VARIANT=K",
                        help="launches of each variant (K), or of one (VARIANT=K), watched "
                             f"and unwatched each (default: {DEFAULT_LAUNCHES})")
    parser.add_argument("--log", help="append each launch's result here (JSON lines)")
    parser.add_argument("--table", metavar="LOG",
                        help="print the table of the launches a --log holds, and nothing else")
    parser.add_argument("--rank", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--watched", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.watched, args.out)
        return
    if args.table:
        with open(args.table) as handle:
            print(table([json.loads(line) for line in handle if line.strip()]))
        return
    rows = []
    counts = {v: DEFAULT_LAUNCHES[v] for v in args.variants}
    for item in args.launches:
        variant, _, count = item.rpartition("=")
        for v in ([variant] if variant else args.variants):
            counts[v] = int(count)
    # round by round, every variant in each, so that the machine's drift (and a run cut short)
    # hits them all alike
    for i in range(max(counts.values())):
        for variant in [v for v in args.variants if i < counts[v]]:
            # alternate which goes first, so neither always runs on a warmer machine
            for watched in ((False, True) if i % 2 == 0 else (True, False)):
                row = launch(variant, watched)
                rows.append(row)
                print(f"{variant} {'watched' if watched else 'unwatched'} #{i}: exit "
                      f"{row['exit']}{', ABORT' if row['aborted'] else ''}"
                      f"{', report ' + str(row['report_entries']) if watched else ''}",
                      flush=True)
                if args.log:
                    with open(args.log, "a") as handle:
                        handle.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
