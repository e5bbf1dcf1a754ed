"""`sharddemo audit FACTORY --resume-at EPOCH:STEP`: stop training, restart it, and compare.

Three real launches of the user's factory, each in fresh processes:

- reference: the plain audit (audit.py), epochs 0 .. EPOCH+1 without stopping;
- stop: walks epochs 0 .. EPOCH-1, then STEP steps of EPOCH, then saves the state the way the
  user's stack would (`accelerator.save_state`, which saves the prepared loaders' and samplers'
  state, plus `state_dict()` of a loader that has one and is not prepared), and exits;
- resume (on `--resume-num-processes` ranks): builds a new Accelerator and loader with the same
  factory, `accelerator.load_state`, then resumes as the strategy says and finishes EPOCH and
  walks EPOCH+1:
    skip      `accelerator.skip_first_batches(loader, STEP)` for the rest of EPOCH
              (accelerate's documented way),
    stateful  `DataLoaderConfiguration(use_stateful_dataloader=True)`: the loader's own state,
              restored by load_state, continues the epoch,
    restart   the epoch from its start (a loop with neither): STEP batches come again.

sharddemo seeds nothing behind the factory's back: a factory that calls `set_seed` resumes
differently from one that does not, and that is what the report shows. Per epoch: the ids the
resume repeated and skipped against the uninterrupted run (as multisets, over all ranks),
whether each rank's order is the uninterrupted order (same world size, deterministic loader),
and the verdict `resume-exact`.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from sharddemo.errors import RunFailed, UsageError

STRATEGIES = ("skip", "stateful", "restart")
PHASES = ("stop", "resume")
# Above this many ids, `repeated` and `skipped` list the first ones and count all.
ID_LIST_CAP = 1000
STATE_FILE = "sharddemo_loader_state_{rank}.pt"


@dataclass(frozen=True)
class ResumePlan:
    epoch: int
    step: int
    strategy: str = "skip"
    num_processes: Optional[int] = None  # launch 2's world size (None: the same)

    @staticmethod
    def parse(text: str, strategy: str, epochs: int,
              num_processes: Optional[int]) -> "ResumePlan":
        epoch_text, sep, step_text = text.partition(":")
        try:
            epoch, step = int(epoch_text), int(step_text)
        except ValueError:
            epoch, step, sep = -1, -1, ""
        if not sep or epoch < 0 or step < 0:
            raise UsageError(f"--resume-at {text!r} is not EPOCH:STEP (0-based, STEP = batches "
                             "per rank completed before the stop), e.g. --resume-at 0:3")
        if epoch >= epochs:
            raise UsageError(f"--resume-at {text} stops in epoch {epoch}, beyond --epochs "
                             f"{epochs} (epochs 0..{epochs - 1}); pass --epochs {epoch + 1} or "
                             "an earlier epoch")
        if strategy not in STRATEGIES:
            raise UsageError(f"--resume-strategy must be one of {', '.join(STRATEGIES)}, "
                             f"got {strategy!r}")
        if num_processes is not None and num_processes < 1:
            raise UsageError(f"--resume-num-processes must be at least 1, got {num_processes}")
        return ResumePlan(epoch, step, strategy, num_processes)


def resume_rank(opts, plan: ResumePlan, phase: str, checkpoint: str, *, device: str = "auto",
                trace_out: Optional[str] = None) -> Optional[dict]:
    """One phase on this rank. Returns the phase's trace on the main process."""
    from sharddemo.audit import build_loader, id_reader, load_factory, set_epoch
    from sharddemo.trace import check_world, make_accelerator, teardown, write_trace
    from sharddemo.rank.describe import agree_on_fingerprint, is_prepared
    from sharddemo.rank.walk import EpochWalker

    factory = load_factory(opts.target)
    accelerator = make_accelerator(device, opts.timeout)
    try:
        check_world(accelerator.num_processes)
        if plan.strategy == "stateful":
            _need_torchdata()
        loader = build_loader(accelerator, factory, opts, stateful=plan.strategy == "stateful")
        agree_on_fingerprint(accelerator, loader)
        read_ids = id_reader(loader, opts.id_field)
        prepared = is_prepared(loader)
        if plan.strategy == "stateful" and not hasattr(loader, "state_dict"):
            raise UsageError(f"--resume-strategy stateful needs a loader that can save its state "
                             f"(state_dict); {opts.target} returns a {type(loader).__name__}: "
                             "prepare it (sharddemo sets use_stateful_dataloader) or return a "
                             "torchdata StatefulDataLoader")
        # (no N: the comparison needs every id, so `auto` never takes the count path)
        walker = EpochWalker(accelerator, loader, read_ids, strategy=opts.gather,
                             before_epoch=(lambda epoch: set_epoch(loader, epoch))
                             if opts.set_epoch else None,
                             failure=lambda epoch, exc: f"{phase} launch, epoch {epoch}: "
                                                        f"{type(exc).__name__}: {exc}")
        walk = walker.walk

        if phase == "stop":
            length = _length(loader)
            if length is not None and plan.step >= length:
                raise UsageError(f"--resume-at {plan.epoch}:{plan.step}: an epoch of this loader "
                                 f"has {length} steps per rank (0..{length - 1}); stop at an "
                                 f"earlier step, or at {plan.epoch + 1}:0 for the next epoch")
            for epoch in range(plan.epoch):
                walk(epoch)
            walk(plan.epoch, max_steps=plan.step)
            _save(accelerator, loader, prepared, checkpoint)
        else:
            _load(accelerator, loader, prepared, checkpoint)
            if plan.strategy == "skip":
                walk(plan.epoch, accelerator.skip_first_batches(loader, plan.step)
                     if plan.step else loader)
            else:  # stateful: the loader continues by itself; restart: from the start
                walk(plan.epoch)
            walk(plan.epoch + 1)
        if not accelerator.is_main_process:
            return None
        trace = {"phase": phase, "world_size": accelerator.num_processes,
                 "epochs": walker.records}
        if trace_out:
            write_trace(trace, trace_out)
        return trace
    finally:
        teardown(accelerator)


def _need_torchdata() -> None:
    try:
        import torchdata  # noqa: F401
    except ImportError:
        raise UsageError("--resume-strategy stateful uses torchdata's StatefulDataLoader, which "
                         "is not installed; pip install 'sharddemo[stateful]'") from None


def _length(loader) -> Optional[int]:
    try:
        return len(loader)
    except TypeError:
        return None


def _save(accelerator, loader, prepared: bool, checkpoint: str) -> None:
    """What the user's stack saves: accelerate's state (prepared loaders and samplers included),
    and a loader's own state_dict when accelerate does not hold the loader."""
    import torch

    try:
        accelerator.save_state(checkpoint)
        if not prepared and hasattr(loader, "state_dict"):
            torch.save(loader.state_dict(),
                       os.path.join(checkpoint, STATE_FILE.format(rank=accelerator.process_index)))
    except OSError as exc:
        raise RunFailed(f"the checkpoint could not be written to {checkpoint}: {exc}") from exc
    accelerator.wait_for_everyone()


def _load(accelerator, loader, prepared: bool, checkpoint: str) -> None:
    import torch

    try:
        accelerator.load_state(checkpoint)
    except Exception as exc:
        raise RunFailed(f"accelerator.load_state({checkpoint}) failed on rank "
                        f"{accelerator.process_index}: {type(exc).__name__}: {exc}") from exc
    path = os.path.join(checkpoint, STATE_FILE.format(rank=accelerator.process_index))
    if not prepared and hasattr(loader, "load_state_dict") and os.path.exists(path):
        loader.load_state_dict(torch.load(path, weights_only=False))


# ---------------------------------------------------------------------------------------------
# The comparison (pure: the three traces in, the `resume` report object out)


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _capped(counter: Counter) -> dict:
    ids = sorted(i for i, c in counter.items() for _ in range(c))
    return {"count": len(ids), "ids": ids[:ID_LIST_CAP], "capped": len(ids) > ID_LIST_CAP}


def compare_resume(plan: ResumePlan, reference: dict, stop: dict, resumed: dict) -> dict:
    """The `resume` object of the report: per epoch EPOCH and EPOCH+1, the ids repeated and
    skipped against the uninterrupted run, whether each rank's order is unchanged, and the
    verdict."""
    before = [r["batches"] for r in stop["epochs"][plan.epoch]["ranks"]]
    same_world = stop["world_size"] == resumed["world_size"]
    # Deterministic across launches: the stop launch saw exactly what the reference saw
    # before the stop (earlier epochs, and this epoch's first steps).
    deterministic = all(
        [r["batches"] for r in stop["epochs"][k]["ranks"]]
        == [r["batches"][:len(s["batches"])] for r, s in zip(reference["epochs"][k]["ranks"],
                                                               stop["epochs"][k]["ranks"])]
        for k in range(plan.epoch + 1))
    epochs = []
    for offset, epoch in enumerate((plan.epoch, plan.epoch + 1)):
        ref_ranks = [r["batches"] for r in reference["epochs"][epoch]["ranks"]]
        got_ranks = [r["batches"] for r in resumed["epochs"][offset]["ranks"]]
        if offset == 0:  # the stopped launch's part of the epoch, then the resumed part
            if same_world:
                got_ranks = [b + g for b, g in zip(before, got_ranks)]
            else:
                got_ranks = before + got_ranks
        ref_ids = Counter(i for batches in ref_ranks for i in _flat(batches))
        got_ids = Counter(i for batches in got_ranks for i in _flat(batches))
        repeated, skipped = got_ids - ref_ids, ref_ids - got_ids
        order = (None if not (same_world and deterministic)
                 else [_flat(b) for b in got_ranks] == [_flat(b) for b in ref_ranks])
        exact = not repeated and not skipped and order is not False
        small = sum(got_ids.values()) <= 10 * ID_LIST_CAP
        epochs.append({"epoch": epoch, "repeated": _capped(repeated), "skipped": _capped(skipped),
                       "order_equal": order, "resume_exact": exact,
                       "seen": sum(got_ids.values()), "reference_seen": sum(ref_ids.values()),
                       # what the resumed run's ranks received (stopped part first), small runs
                       "ranks": [{"rank": r, "batches": b} for r, b in enumerate(got_ranks)]
                       if small and same_world else None})
    return {"at": {"epoch": plan.epoch, "step": plan.step}, "strategy": plan.strategy,
            "world_sizes": [stop["world_size"], resumed["world_size"]],
            "deterministic": deterministic, "epochs": epochs,
            "resume_exact": all(e["resume_exact"] for e in epochs),
            "stopped": {"steps_per_rank": [len(b) for b in before]}}


def explain(resume: dict) -> str:
    """One paragraph in plain words."""
    at, strategy = resume["at"], resume["strategy"]
    w0, w1 = resume["world_sizes"]
    head = (f"Stopped after {at['step']} step(s) of epoch {at['epoch']} on {w0} rank(s), resumed "
            f"on {w1} with --resume-strategy {strategy}")
    parts = []
    for e in resume["epochs"]:
        rep, skip = e["repeated"]["count"], e["skipped"]["count"]
        if e["resume_exact"]:
            parts.append(f"epoch {e['epoch']}: exactly the uninterrupted run's samples"
                         + (" in its order" if e["order_equal"] else ""))
        else:
            text = f"epoch {e['epoch']}: {rep} sample(s) repeated, {skip} skipped"
            if e["order_equal"] is False:
                text += ", and the order differs from the uninterrupted run"
            parts.append(text)
    tail = ""
    if not resume["deterministic"]:
        tail = (" The loader gave a different order in each launch (no common seed), so orders "
                "are not compared and a resumed epoch is a new permutation.")
    elif w0 != w1:
        tail = (f" The world size changed ({w0} -> {w1}): the checkpoint's loader position is "
                "per rank, so the resumed ranks deal the epoch anew from a different split, and "
                "the loader's own padding differs too; per-rank orders are not compared.")
    if resume["deterministic"] and w0 == w1 and at["step"] == 0 and any(
            e["order_equal"] is False and not e["repeated"]["count"] for e in resume["epochs"]):
        tail += (" The resumed epochs hold the right samples in another order: a fresh loader "
                 "counts its epochs from 0 again, so it replays an earlier epoch's order (call "
                 "set_epoch with the real epoch, or resume the loader's state).")
    verdict = "resume-exact: yes" if resume["resume_exact"] else "resume-exact: NO"
    return f"{head}. " + "; ".join(parts) + f".{tail} {verdict}."


# ---------------------------------------------------------------------------------------------
# `compare --modes resume`: every strategy, two stop points, 0 and 2 workers, on the demo data,
# in three launches (stop, reference, resume) instead of three per scenario. Each scenario gets
# its own Accelerator instance (so save_state holds only its loader) and its own checkpoint.

DEMO_WORKERS = (0, 2)


def demo_scenarios(steps: int) -> list[dict]:
    """The 12 scenarios for an epoch of `steps` steps per rank: stop in the middle of epoch 0
    and at the start of epoch 1; skip, stateful, restart; 0 and 2 workers."""
    stops = [(0, steps // 2), (1, 0)]
    return [{"workers": w, "epoch": e, "step": s, "strategy": strategy}
            for w in DEMO_WORKERS for e, s in stops for strategy in STRATEGIES]


def _demo_loader(accelerator, opts, workers: int, stateful: bool):
    """The demo's `prepared` loader, built as compare builds it (seeded with --seed first)."""
    import dataclasses

    from accelerate.utils import set_seed

    from sharddemo.loaders import build_loader, dataloader_config
    from sharddemo.sources import build_source

    set_seed(opts.seed)
    run = dataclasses.replace(opts, num_workers=workers, modes=("prepared",))
    with dataloader_config(accelerator, use_stateful_dataloader=stateful):
        return build_loader("prepared", accelerator, build_source(opts.source, opts.dataset_size),
                            run).loader


def demo_rank(opts, phase: str, checkpoint: str, *, device: str = "auto",
              trace_out: Optional[str] = None) -> Optional[dict]:
    """One phase of the demo on this rank: `reference` (per workers x stateful, three epochs),
    `stop` or `resume` (per scenario). Returns {key: epochs} on the main process."""
    from accelerate import Accelerator

    from sharddemo.sources import batch_ids
    from sharddemo.trace import check_world, make_accelerator, teardown, write_trace
    from sharddemo.rank.walk import EpochWalker

    first = make_accelerator(device, opts.timeout)
    out: dict[str, Any] = {}

    def read(batch, tag):
        return batch_ids(batch)

    def walker(acc, loader) -> EpochWalker:
        return EpochWalker(acc, loader, read, strategy="batch")

    def fresh():
        # Another Accelerator on the same process group: its own list of prepared loaders.
        return Accelerator(cpu=first.device.type == "cpu")

    try:
        check_world(first.num_processes)
        steps = None
        if phase == "reference":
            for workers in DEMO_WORKERS:
                for stateful in (False, True):
                    acc = fresh()
                    loader = _demo_loader(acc, opts, workers, stateful)
                    steps = len(loader)
                    walk = walker(acc, loader)
                    for epoch in range(3):
                        walk.walk(epoch)
                    out[f"w{workers}-{'stateful' if stateful else 'plain'}"] = walk.records
        else:
            acc0 = fresh()
            steps = len(_demo_loader(acc0, opts, 0, False))
            if steps < 2:
                raise UsageError(f"--modes resume stops in the middle of an epoch, but an epoch "
                                 f"here has {steps} step per rank; pass a larger --dataset-size "
                                 "(e.g. --dataset-size 40 --batch-size 4)")
            for k, sc in enumerate(demo_scenarios(steps)):
                acc = fresh()
                stateful = sc["strategy"] == "stateful"
                loader = _demo_loader(acc, opts, sc["workers"], stateful)
                folder = os.path.join(checkpoint, f"scenario-{k}")
                walk = walker(acc, loader)
                if phase == "stop":
                    for epoch in range(sc["epoch"]):
                        walk.walk(epoch)
                    walk.walk(sc["epoch"], max_steps=sc["step"])
                    _save(acc, loader, True, folder)
                else:
                    _load(acc, loader, True, folder)
                    if sc["strategy"] == "skip" and sc["step"]:
                        walk.walk(sc["epoch"], source=acc.skip_first_batches(loader, sc["step"]))
                    else:
                        walk.walk(sc["epoch"])
                    walk.walk(sc["epoch"] + 1)
                out[str(k)] = walk.records
        if not first.is_main_process:
            return None
        trace = {"phase": phase, "world_size": first.num_processes, "steps": steps,
                 "backend": getattr(first.state, "backend", None) or "none",
                 "distributed_type": first.state.distributed_type.value,
                 "device": first.device.type,
                 "results": out}
        if trace_out:
            write_trace(trace, trace_out)
        return trace
    finally:
        teardown(first)


def demo_report(reference: dict, stop: dict, resumed: dict) -> list[dict]:
    """Every scenario's `resume` object, with its workers."""
    rows = []
    for k, sc in enumerate(demo_scenarios(stop["steps"])):
        plan = ResumePlan(sc["epoch"], sc["step"], sc["strategy"])
        key = f"w{sc['workers']}-{'stateful' if sc['strategy'] == 'stateful' else 'plain'}"
        result = compare_resume(
            plan, {"world_size": reference["world_size"], "epochs": reference["results"][key]},
            {"world_size": stop["world_size"], "epochs": stop["results"][str(k)]},
            {"world_size": resumed["world_size"], "epochs": resumed["results"][str(k)]})
        result["workers"] = sc["workers"]
        result["explanation"] = explain(result)
        rows.append(result)
    return rows
