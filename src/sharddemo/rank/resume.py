"""The rank side of `sharddemo audit FACTORY --resume-at ...` and `compare --modes resume`.

`--resume-at EPOCH:STEP[,EPOCH:STEP...]`: stop training, restart it, and compare
(commands/resume.py launches, analysis/resume.py compares).

Real launches of the user's factory, each in fresh processes:

- reference: the plain audit (rank/audit.py), without stopping;
- launch 0 (`stop`): walks from epoch 0 to the first stop, then saves the state the way the
  user's stack would (`accelerator.save_state`, which saves the prepared loaders' and samplers'
  state, plus `state_dict()` of a loader that has one and is not prepared), and exits;
- launch j (`resume`, on its own world size): builds a new Accelerator and loader with the same
  factory, `accelerator.load_state` from stop j-1, then resumes as the strategy says and walks
  to stop j (and saves) or, the last launch, finishes its epoch and walks one more:
    skip      `accelerator.skip_first_batches(loader, STEP)` for the rest of the epoch
              (accelerate's documented way),
    stateful  `DataLoaderConfiguration(use_stateful_dataloader=True)`: the loader's own state,
              restored by load_state, continues the epoch,
    restart   the epoch from its start (a loop with neither): STEP batches come again.
  A stop after an epoch's last step (`E:last`) resumes at the next epoch's step 0, as
  accelerate's examples do.

sharddemo seeds nothing behind the factory's back: a factory that calls `set_seed` resumes
differently from one that does not, and that is what the report shows. Per epoch: the ids the
resume repeated and skipped against the uninterrupted run (as multisets, over all ranks and
launches), per restart what it repeated and lost, whether each rank's order is the uninterrupted
order (one world size walked the epoch, deterministic loader), and the verdict `resume-exact`.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from sharddemo.errors import RunFailed, UsageError, describe_exception
from sharddemo.options import DEMO_WORKERS, LAST, ResumePlan, demo_scenarios

PHASES = ("stop", "resume")
STATE_FILE = "sharddemo_loader_state_{rank}.pt"


def resume_rank(opts, plan: ResumePlan, phase: str, checkpoint: str, *, index: int = 0,
                resume_from: Optional[dict] = None, final_epoch: Optional[int] = None,
                device: str = "auto", trace_out: Optional[str] = None) -> Optional[dict]:
    """Run launch `index` of the chain on this rank; return its trace on the main process.

    Launch 0 (`stop`) walks from the start to the plan's first stop; launch j (`resume`) loads
    the state launch j-1 saved at `resume_from` (its resolved stop) and walks to stop j, or, the
    last launch, through `final_epoch`. The trace holds the launch's records and its resolved
    stop."""
    from sharddemo.rank.audit import build_factory_loader, id_reader, load_factory, set_epoch
    from sharddemo.rank.describe import agree_on_fingerprint, is_prepared
    from sharddemo.rank.session import rank_session
    from sharddemo.rank.walk import EpochWalker

    factory = load_factory(opts.target)
    with rank_session(device, opts.timeout) as session:
        accelerator = session.accelerator
        if plan.strategy == "stateful":  # (the parent checked too, before the launch)
            from sharddemo.extras import require

            require("torchdata", "--resume-strategy stateful")
        loader = build_factory_loader(accelerator, factory, opts,
                                      stateful=plan.strategy == "stateful")
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
                             failure=lambda epoch, exc: f"{phase} launch {index}, epoch {epoch}: "
                                                        f"{describe_exception(exc)}")
        stop = plan.stops[index] if index < len(plan.stops) else None
        resolved = chain_launch(
            walker, accelerator, loader, prepared, strategy=plan.strategy,
            load_from=os.path.join(checkpoint, f"stop-{index - 1}") if index else None,
            resume_from=resume_from, stop=stop,
            save_to=os.path.join(checkpoint, f"stop-{index}") if stop else None,
            final_epoch=final_epoch, chain=plan.text())
        return session.finish({"phase": phase, "launch": index, "stop": resolved,
                               "epochs": walker.records}, trace_out)


def chain_launch(walker, accelerator, loader, prepared: bool, *, strategy: str,
                 load_from: Optional[str], resume_from: Optional[dict], stop,
                 save_to: Optional[str], final_epoch: Optional[int],
                 chain: str) -> Optional[dict]:
    """Run one launch of a chain of stops and restarts, as a loop that counts its steps.

    Without `resume_from`: from epoch 0. Else the state in `load_from` loaded and the loop
    resumed where `resume_from` says: after an epoch's last step (`last`), at the next epoch's
    step 0 (accelerate's examples: `skip_first_batches(loader, 0)`); mid-epoch, past its first
    `step` batches (skip: accelerator.skip_first_batches; stateful: the loader goes on by
    itself; restart: from the epoch's start, the loop's step count going on from `step`). Then
    to `stop` (`step` batches of its epoch as the loop counts them, or after the last one; the
    state saved to `save_to`), or through `final_epoch`. Returns the stop where this launch
    saved, resolved: {epoch, step, last, steps (the epoch's steps as this launch counts them,
    None without a length)}; None for the last launch."""
    epoch, step, source = 0, 0, loader
    if resume_from is not None:
        _load(accelerator, loader, prepared, load_from)
        epoch, step = resume_from["epoch"], resume_from["step"]
        if resume_from["last"]:
            epoch, step = epoch + 1, 0
        if strategy == "skip" and step:
            source = accelerator.skip_first_batches(loader, step)
    while True:
        length = _length(loader)
        # skip and stateful go on past the first `step` batches (none left where the epoch is
        # shorter at a new world size: len() of such a skipping loader raises); restart walks
        # the whole epoch again, its steps counted on from `step`
        remaining = None if length is None else (
            length if strategy == "restart" else max(0, length - step))
        total = None if remaining is None else step + remaining
        # skipped past the epoch's end at a new size: nothing is left (and len() raises)
        over = source is not loader and remaining == 0
        if stop is not None and stop.epoch == epoch:
            if stop.step == LAST and total is None:
                raise UsageError(f"--resume-at {chain}: {stop.text()} needs the epoch's length, "
                                 "and this loader has none (len() raises); give the step count")
            at = total if stop.step == LAST else stop.step
            if total is not None and at > total:
                raise UsageError(f"--resume-at {chain}: {stop.text()}: an epoch of this loader "
                                 f"has {total} steps per rank on {accelerator.num_processes} "
                                 f"rank(s) (stop at 0..{total}, or {epoch}:last after its last "
                                 "step); stop at an earlier step")
            walker.walk(epoch, source=None if source is loader or over else source,
                        max_steps=0 if over else at - step)
            _save(accelerator, loader, prepared, save_to)
            return {"epoch": epoch, "step": at, "last": at == total, "steps": total}
        walker.walk(epoch, source=None if source is loader or over else source,
                    max_steps=0 if over else None)
        if stop is None and epoch >= final_epoch:
            return None
        epoch, step, source = epoch + 1, 0, loader


def stop_and_save(walker, accelerator, loader, prepared: bool, checkpoint: str, epoch: int,
                  step: int) -> None:
    """Run the resume demo's stopping launch, then save the state.

    Epochs 0..epoch-1 whole, `step` batches of `epoch`, then the state saved (accelerate's
    save_state for a prepared loader, the loader's own else)."""
    for earlier in range(epoch):
        walker.walk(earlier)
    walker.walk(epoch, max_steps=step)
    _save(accelerator, loader, prepared, checkpoint)


def load_and_resume(walker, accelerator, loader, prepared: bool, checkpoint: str, epoch: int,
                    step: int, *, skip: bool) -> None:
    """Run the resume demo's resuming launch: load the state, finish the epoch, walk the next.

    The rest of `epoch` (`skip`: past the first `step` batches with
    accelerator.skip_first_batches; else the loader continues by itself, stateful, or from the
    epoch's start, restart), then the next epoch whole."""
    _load(accelerator, loader, prepared, checkpoint)
    if skip and step:
        walker.walk(epoch, source=accelerator.skip_first_batches(loader, step))
    else:
        walker.walk(epoch)
    walker.walk(epoch + 1)


def _length(loader) -> Optional[int]:
    try:
        return len(loader)
    except TypeError:
        return None


def _save(accelerator, loader, prepared: bool, checkpoint: str) -> None:
    """Save what the user's stack saves.

    accelerate's state (prepared loaders and samplers included), and a loader's own state_dict
    when accelerate does not hold the loader."""
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
# `compare --modes resume`: every strategy, two stop points, 0 and 2 workers, on the demo data,
# in three launches (stop, reference, resume) instead of three per scenario. Each scenario gets
# its own Accelerator instance (so save_state holds only its loader) and its own checkpoint.

def _demo_loader(accelerator, opts, workers: int, stateful: bool):
    """The demo's `prepared` loader, built as compare builds it (seeded with --seed first)."""
    import dataclasses

    from accelerate.utils import set_seed

    from sharddemo.rank.loaders import build_mode_loader, dataloader_config
    from sharddemo.rank.sources import build_source

    set_seed(opts.seed)
    run = dataclasses.replace(opts, num_workers=workers, modes=("prepared",))
    with dataloader_config(accelerator, use_stateful_dataloader=stateful):
        return build_mode_loader("prepared", accelerator,
                                 build_source(opts.source, opts.dataset_size), run).loader


def demo_rank(opts, phase: str, checkpoint: str, *, device: str = "auto",
              trace_out: Optional[str] = None, stateful: bool = True) -> Optional[dict]:
    """Run one phase of the demo on this rank; return {key: epochs} on the main process.

    `reference` (per workers x stateful, three epochs), `stop` or `resume` (per scenario;
    without `stateful`, torchdata not installed, the scenarios that need no StatefulDataLoader).
    """
    from accelerate import Accelerator

    from sharddemo.rank.sources import batch_ids
    from sharddemo.rank.session import rank_session
    from sharddemo.rank.walk import EpochWalker

    out: dict[str, Any] = {}

    def read(batch, tag):
        return batch_ids(batch)

    def walker(acc, loader) -> EpochWalker:
        return EpochWalker(acc, loader, read, strategy="batch")

    with rank_session(device, opts.timeout) as session:
        first = session.accelerator

        def fresh():
            # Another Accelerator on the same process group: its own list of prepared loaders.
            return Accelerator(cpu=first.device.type == "cpu")

        steps = None
        if phase == "reference":
            for workers in DEMO_WORKERS:
                for kind in (False, True) if stateful else (False,):
                    acc = fresh()
                    loader = _demo_loader(acc, opts, workers, kind)
                    steps = len(loader)
                    walk = walker(acc, loader)
                    for epoch in range(3):
                        walk.walk(epoch)
                    out[f"w{workers}-{'stateful' if kind else 'plain'}"] = walk.records
        else:
            acc0 = fresh()
            steps = len(_demo_loader(acc0, opts, 0, False))
            if steps < 2:
                raise UsageError(f"--modes resume stops in the middle of an epoch, but an epoch "
                                 f"here has {steps} step per rank; pass a larger --dataset-size "
                                 "(e.g. --dataset-size 40 --batch-size 4)")
            for k, sc in enumerate(demo_scenarios(steps, stateful)):
                acc = fresh()
                loader = _demo_loader(acc, opts, sc["workers"], sc["strategy"] == "stateful")
                folder = os.path.join(checkpoint, f"scenario-{k}")
                walk = walker(acc, loader)
                if phase == "stop":
                    stop_and_save(walk, acc, loader, True, folder, sc["epoch"], sc["step"])
                else:
                    load_and_resume(walk, acc, loader, True, folder, sc["epoch"], sc["step"],
                                    skip=sc["strategy"] == "skip")
                out[str(k)] = walk.records
        return session.finish({"phase": phase, "steps": steps, "results": out}, trace_out)
