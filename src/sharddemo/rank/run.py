"""The Accelerate script: drive each mode's loader on every rank, record the ids, gather them.

Launch it with accelerate, for example

    accelerate launch --config_file accelerate_configs/cpu2.yaml -m sharddemo run --mode all

Every rank builds one Accelerator, then, for each mode, the DataLoader that mode describes
(see rank/loaders.py) and walks it for the requested epochs. Each batch is moved to the
accelerator's device and gathered with `accelerator.gather`, as the reference's
`all_gather` does (rank/walk.py: lengths exchanged first, padded, trimmed, so ranks with unequal
batches or step counts never meet in a collective of unequal shapes). Only the main process
prints.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from sharddemo.rank.collect import exchange_objects
from sharddemo.rank.sources import batch_values
from sharddemo.errors import LoaderRaised, RunFailed, UsageError, describe_exception
from sharddemo.options import (RunOptions, mode_description)
from sharddemo.rank.describe import agree_on_fingerprint, describe_loader
from sharddemo.rank.tagging import tag_batches
from sharddemo.rank.walk import EpochWalker
from sharddemo.rank.session import peak_rss_mb, placement, rank_label, rank_session


def arithmetic(world: int, opts: RunOptions) -> dict:
    """The numbers to state before the loop, as nanoGPT does (RunOptions.per_rank_batch)."""
    per_rank = opts.per_rank_batch(world)
    return {
        "world_size": world,
        "per_rank_batch": per_rank,
        "global_batch": per_rank * world,
        "dataset_size": opts.dataset_size,
        "sharded_samples_per_epoch": opts.dataset_size,
        "replicated_samples_per_epoch": opts.dataset_size * world,
    }


def trace_mode(accelerator, mode: str, dataset, opts: RunOptions,
               on_epoch: Optional[Callable[[dict], None]] = None,
               say: Optional[Callable[[str], None]] = None, mesh=None) -> dict:
    """Walk one mode's loader for every epoch on this rank, and return the mode's trace.

    The trace on the main process (every rank's batches, what gather_for_metrics returned, what
    the loader is made of) and {} elsewhere. `say`: where to state, before the walk, the mode's
    own batch where it differs from the run's arithmetic. `mesh`: the run's device mesh
    (rank.mesh.RankMesh) with --mesh."""
    from accelerate.utils import set_seed

    from sharddemo.rank.loaders import build_mode_loader

    # Reseed per mode so a mode's result does not depend on which modes ran before it
    # (`unseeded` then reseeds each process differently: that is its point).
    set_seed(opts.seed)
    plan = build_mode_loader(mode, accelerator, dataset, opts, mesh)
    world = accelerator.num_processes
    sizes = None
    if opts.split_batches and not plan.prepared:
        # split_batches is accelerate's: a loader it does not prepare hands every rank the
        # whole --batch-size, not the run's slice of it (the report reads each mode's sizes)
        sizes = {"batch_size": opts.batch_size, "global_batch": opts.batch_size * world}
        if say is not None:
            from sharddemo.sizes import own_sizes_line

            run = {**arithmetic(world, opts), "options": {"split_batches": True}}
            say(own_sizes_line(run, {**sizes, "prepared": False}))
    description = describe_loader(plan.loader)
    if plan.probe:
        raised = probe_loader(accelerator, plan.loader)
        if raised:
            if not accelerator.is_main_process:
                return {}
            return {"description": _described(mode, opts),
                    "prepared": plan.prepared, "loader": description, "fingerprint": None,
                    "hint": plan.hint, "epochs": [], "raised": raised, "raises_by_design": True,
                    "streams": _streams(mode, dataset, accelerator, opts, description)}
    # sharddemo's own modes are built to show what happens, the pitfalls included: a
    # disagreement is reported with the mode rather than stopping the run.
    agreed = agree_on_fingerprint(accelerator, plan.loader, stop=False,
                                  description=description)
    tag_batches(plan.loader, record_indices=False)  # which worker made each batch

    def failure(epoch: int, exc: BaseException) -> str:
        done = ("" if not epoch else "; its epoch 0 completed" if epoch == 1
                else f"; its epochs 0-{epoch - 1} completed")
        return f"mode {mode}, epoch {epoch}: {describe_exception(exc)}{done}"

    walker = EpochWalker(accelerator, plan.loader, _source_ids, strategy=opts.gather,
                         n=opts.dataset_size, label=mode, failure=failure,
                         before_epoch=plan.sampler.set_epoch if plan.sampler is not None
                         else None)
    raised = None
    for epoch in range(opts.epochs):
        try:
            record = walker.walk(epoch)
        except LoaderRaised as exc:
            # the library raised on every rank, and every rank knows it (walk.settle): the
            # mode's result, with the epochs before it; the next mode is walked as usual
            raised = exc.raised
            break
        if record is not None and on_epoch is not None:
            on_epoch(record)
    epochs = walker.records
    if not accelerator.is_main_process:
        return {}
    out = {"description": _described(mode, opts),
           "prepared": plan.prepared, "loader": description, "fingerprint": agreed,
           "hint": plan.hint, "epochs": epochs}
    if raised is not None:
        out["raised"] = raised
    if sizes is not None:
        out["sizes"] = sizes
    streams = _streams(mode, dataset, accelerator, opts, description)
    if streams is not None:
        out["streams"] = streams
    return out


def _described(mode: str, opts: RunOptions) -> str:
    """The mode's words as the run built it (on a mesh with --mesh)."""
    return mode_description(mode, opts.shuffle, opts.source, opts.mesh is not None)


def _streams(mode: str, dataset, accelerator, opts: RunOptions, description: dict):
    """Return the shard arithmetic of a streamed source, as its library computes it.

    None for the other sources."""
    if opts.source == "hf-stream":
        from sharddemo.rank.sources import stream_arithmetic

        return stream_arithmetic(dataset, accelerator.num_processes, opts.num_workers,
                                 split=mode == "split",
                                 dispatch=bool(description.get("dispatcher")))
    if opts.source == "webdataset":
        from sharddemo.rank.loaders import uneven_count
        from sharddemo.rank.sources import wds_arithmetic

        world = accelerator.num_processes
        urls = dataset.urls(uneven_count(world, opts.num_workers)
                            if mode == "uneven-shards" else None)
        return wds_arithmetic(urls, world, opts.num_workers, mode)
    return None


def probe_loader(accelerator, loader) -> list[dict]:
    """Ask every rank's loader for its first batch, and say which ranks raised.

    As a training loop's first step does: [{"rank", "error"}] on every rank (one line each,
    errors.describe_exception), [] where none did. A collective: every rank learns whether any
    raised, so either all walk the loader or none does, and none waits on a rank that stopped.
    The batch taken is dropped with its iterator: the walk starts a new one."""
    error = ""
    try:
        iterator = iter(loader)
        next(iterator, None)
        del iterator
    except Exception as exc:  # the loader's own refusal is the result
        error = describe_exception(exc)
    return [{"rank": r, "error": e}
            for r, e in enumerate(exchange_objects(accelerator, error)) if e]


def _source_ids(batch, tag) -> tuple[torch.Tensor, int]:
    """Read a built-in source's batch: its (values, shift), see rank.ids.ReadIds.

    The built-in sources carry their ids in the batch itself."""
    return batch_values(batch)



def run_trace(opts: RunOptions, *, device: str = "auto", say: Optional[Callable[[str], None]] = None,
              trace_out: Optional[str] = None, allow_alone: bool = False) -> Optional[dict]:
    """The whole script on one rank. Returns the trace on the main process, None elsewhere.

    `allow_alone` skips the check that the launcher really started every process asked
    for: `sharddemo trap` uses it to show what that silent failure looks like."""
    from sharddemo.rank.sources import build_source

    with rank_session(device, opts.timeout, allow_alone=allow_alone) as session:
        accelerator = session.accelerator
        opts.validate_split_batches(accelerator.num_processes)
        world = accelerator.num_processes
        state = accelerator.state
        backend = getattr(state, "backend", None) or "none"
        main = accelerator.is_main_process
        talk = (say if (say is not None and main) else (lambda line: None))

        sums = arithmetic(world, opts)
        talk(
            f"world size {world} ({state.distributed_type.value}, backend {backend}, "
            f"device {accelerator.device.type}) | per-rank batch {sums['per_rank_batch']} | "
            f"global batch {sums['global_batch']} | dataset {opts.dataset_size} | "
            f"samples per epoch: {opts.dataset_size} if sharded, "
            f"{sums['replicated_samples_per_epoch']} if every rank walks it all"
        )
        mesh = None
        if opts.mesh is not None:
            from sharddemo.rank.mesh import form_mesh

            mesh = form_mesh(opts.mesh, accelerator)
            layout = mesh.layout
            talk(f"mesh {layout.shape()}: data dims {', '.join(layout.data_dims) or 'none'} "
                 f"({layout.data_size} data-parallel group(s) of {layout.replica_size} replica "
                 "peer(s), which must receive the same batches)")
        dataset = build_source(opts.source, opts.dataset_size, opts.shards)
        modes: dict[str, Any] = {}
        timings: dict[str, float] = {}
        for mode in opts.modes:
            talk(f"== mode {mode}: {_described(mode, opts)}")
            start = time.perf_counter()
            try:
                modes[mode] = trace_mode(
                    accelerator, mode, dataset, opts,
                    on_epoch=lambda rec: _print_epoch(talk, rec, world, opts.dataset_size),
                    say=talk, mesh=mesh)
            except UsageError:
                raise
            except Exception as exc:  # name the mode; the rank is named by the caller
                message = str(exc) if isinstance(exc, RunFailed) else (
                    f"mode {mode}: {describe_exception(exc)}")
                done = f" (modes completed before it: {', '.join(modes)})" if modes else ""
                raise RunFailed(message + done) from exc
            for r in modes[mode].get("raised", []):
                where = (f"at epoch {r['epoch']}, step {r['step']}" if "epoch" in r
                         else "before its first batch")
                talk(f"{rank_label(r['rank'], world)} raised {where}: {r['error']}")
            timings[mode] = round(time.perf_counter() - start, 6)
        peak = peak_rss_mb(accelerator)
        where = placement(accelerator)
        body = {} if mesh is None else {"mesh": mesh.trace()}
        return session.finish({
            **body,
            "source": opts.source,
            "dataset_size": opts.dataset_size,
            "batch_size": opts.batch_size,
            "global_batch": sums["global_batch"],
            "epochs": opts.epochs,
            "seed": opts.seed,
            "options": opts.to_dict(),
            "arithmetic": sums,
            "placement": where,
            "modes": modes,
            # Not reproducible, so kept apart from the rest of the trace.
            "timings": {"mode_s": timings, "peak_rss_mb": peak},
        }, trace_out)



# Above this dataset size `run` prints counts instead of every value.
PRINT_LIMIT = 64


def _print_epoch(talk: Callable[[str], None], record: dict, world: int, n: int) -> None:
    """Reference-style output: each rank's batches as sample values (id + 1), then the merge."""
    talk(f"epoch {record['epoch']}")
    if record["gather"] == "count":
        for rank in record["ranks"]:
            talk(f"{rank_label(rank['rank'], world)} {rank['steps']} batches, "
                 f"{rank['samples']} samples")
        cov = record["coverage"]
        talk(f"counted on the ranks and summed with one reduce: {cov['seen']} received, "
             f"{cov['unique']} distinct, {cov['missing_count']} never seen")
        talk(f"total {cov['seen']} = {cov['seen'] / max(n, 1):g}x the dataset of {n}")
        steps = [r["steps"] for r in record["ranks"]]
        if len(set(steps)) > 1:
            talk(f"steps per rank {steps}: a training loop would hang at step {min(steps)} "
                 "(sharddemo kept every rank answering, so it did not)")
        return
    small = n <= PRINT_LIMIT
    for rank in record["ranks"]:
        label = rank_label(rank["rank"], world)
        if small:
            for step, ids in enumerate(rank["batches"]):
                talk(f"{label} batch {step}: {[i + 1 for i in ids]}")
        else:
            count = sum(len(b) for b in rank["batches"])
            talk(f"{label} {len(rank['batches'])} batches, {count} samples")
    from sharddemo.record import interleave_steps

    # What accelerator.gather returned: step by step, each rank's batch in rank order (per
    # batch), or each rank's whole epoch in rank order (once per epoch).
    if record["gather"] == "batch":
        merged, how = interleave_steps([r["batches"] for r in record["ranks"]]), "every batch"
    else:
        merged = [i for r in record["ranks"] for b in r["batches"] for i in b]
        how = "each rank's epoch"
    total = len(merged)
    if small:
        talk(f"merged by accelerator.gather of {how}: {[i + 1 for i in merged]}")
    else:
        talk(f"merged by accelerator.gather of {how}: {total} values")
    talk(f"total {total} = {total / max(n, 1):g}x the dataset of {n}")
    if record.get("gathered_for_metrics") is not None:
        talk(f"accelerator.gather_for_metrics returned {len(record['gathered_for_metrics'])}")
    steps = [len(r["batches"]) for r in record["ranks"]]
    if len(set(steps)) > 1:
        talk(f"steps per rank {steps}: a training loop would hang at step {min(steps)} "
             "(sharddemo kept every rank answering, so it did not)")
