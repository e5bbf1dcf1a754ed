"""The Accelerate script: drive each mode's loader on every rank, record the ids, gather them.

Launch it with accelerate, for example

    accelerate launch --config_file accelerate_configs/cpu2.yaml -m sharddemo run --mode all

Every rank builds one Accelerator, then, for each mode, the DataLoader that mode describes
(see loaders.py) and walks it for the requested epochs. Each batch is moved to the
accelerator's device and gathered with `accelerator.gather`, as the reference's
`all_gather` does; at the end of each epoch the main process also collects what every rank
saw, batch by batch, so the report can compare the two. Only the main process prints.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from sharddemo.datasets import batch_values
from sharddemo.errors import RunFailed, UsageError
from sharddemo.options import EXPECT_ENV, MODE_HELP, NODE_ENV, PROGRESS_ENV, RunOptions

TRACE_SCHEMA = "sharddemo.trace/1"


def rank_label(rank: Optional[int] = None, world: Optional[int] = None) -> str:
    """`[rank r/W]` from the arguments, or from the launcher's environment."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return f"[rank {rank}/{world}]"


def make_accelerator(device: str, timeout: float):
    """One Accelerator for the whole run, with a short process-group timeout.

    On a machine without CUDA the script asks for `cpu=True`: under torchrun (which is what
    `accelerate launch` with a MULTI_GPU config runs) that gives MULTI_CPU on gloo with the
    launcher's real ranks. Without it, each process would set itself up alone.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but CUDA is not available; use --device cpu")
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=timeout))]
    return Accelerator(cpu=(device == "cpu"), kwargs_handlers=handlers)


def check_world(num_processes: int, env: Optional[dict] = None) -> None:
    """Stop when the launcher asked for several processes but this one finds itself alone.

    That is the silent trap of `accelerate launch --cpu --num_processes 2` and of a
    MULTI_CPU config without MPI: one process runs, prints, and sees the whole dataset.
    """
    env = os.environ if env is None else env
    asked = 0
    for key in ("WORLD_SIZE", EXPECT_ENV):
        try:
            asked = max(asked, int(env.get(key, "0") or 0))
        except ValueError:
            pass
    if num_processes >= asked and not (
        # The plain (non-torchrun) launcher sets MASTER_PORT only when it was asked for
        # more than one process, and never sets WORLD_SIZE.
        num_processes == 1 and "MASTER_PORT" in env and "WORLD_SIZE" not in env
    ):
        return
    wanted = f"{asked} processes" if asked > 1 else "several processes"
    raise UsageError(
        f"launched for {wanted} but this process is alone (world size {num_processes}); "
        "accelerate launch --cpu and MULTI_CPU configs without MPI start one process. "
        "Fix: accelerate launch --config_file accelerate_configs/cpu2.yaml (MULTI_GPU launcher, "
        "which sharddemo runs on CPU with gloo)"
    )


def arithmetic(world: int, opts: RunOptions) -> dict:
    """The numbers to state before the loop, as nanoGPT does."""
    return {
        "world_size": world,
        "per_rank_batch": opts.batch_size,
        "global_batch": opts.batch_size * world,
        "dataset_size": opts.dataset_size,
        "sharded_samples_per_epoch": opts.dataset_size,
        "replicated_samples_per_epoch": opts.dataset_size * world,
    }


# Up to this many steps per rank and epoch, every batch is gathered as it comes (the
# reference's way, and what a training loop would do). Beyond it, ids are kept on the rank and
# gathered once at the end of the epoch: a small gather costs 0.5-1.5 ms on gloo here, more than a whole
# step of a toy loader, so per-batch gathers would dominate a large run (docs/benchmarks.md).
PER_BATCH_GATHER_LIMIT = 100


def trace_mode(accelerator, mode: str, dataset, opts: RunOptions,
               on_epoch: Optional[Callable[[dict], None]] = None) -> dict:
    """Walk one mode's loader for every epoch on this rank. Returns the mode's trace on the
    main process (every rank's batches and what the gathers returned) and {} elsewhere."""
    from accelerate.utils import set_seed

    from sharddemo.loaders import build_loader

    # Reseed per mode so a mode's result does not depend on which modes ran before it
    # (`unseeded` then reseeds each process differently: that is its point).
    set_seed(opts.seed)
    plan = build_loader(mode, accelerator, dataset, opts)
    raw = []
    for epoch in range(opts.epochs):
        if plan.sampler is not None:
            plan.sampler.set_epoch(epoch)
        try:
            _inject_fault(accelerator.process_index, mode, epoch)
            raw.append(trace_epoch(accelerator, plan, epoch, opts.gather,
                                   progress=progress_reporter(accelerator, f"{mode}:epoch{epoch}")))
        except (UsageError, RunFailed):
            raise
        except Exception as exc:
            done = ("" if not epoch else "; its epoch 0 completed" if epoch == 1
                    else f"; its epochs 0-{epoch - 1} completed")
            raise RunFailed(f"mode {mode}, epoch {epoch}: {type(exc).__name__}: {exc}{done}") from exc
    if not accelerator.is_main_process:
        return {}
    # Tensors -> plain lists only now, after the loop, so the epochs are timed as trained.
    epochs = [finalize_epoch(r, accelerator.num_processes, opts.dataset_size) for r in raw]
    if on_epoch is not None:
        for record in epochs:
            on_epoch(record)
    return {"description": MODE_HELP[mode], "prepared": plan.prepared, "epochs": epochs}


def progress_reporter(accelerator, label: str) -> Optional[Callable[[int, Optional[int]], None]]:
    """On the main rank, when `compare` asked for it: a line on stdout at most twice a
    second, `sharddemo-progress LABEL STEP TOTAL`, which compare turns into one bar."""
    if not accelerator.is_main_process or os.environ.get(PROGRESS_ENV) != "1":
        return None
    last = [0.0]

    def report(step: int, total: Optional[int]) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5:
            last[0] = now
            sys.stdout.write(f"sharddemo-progress {label} {step} {total or '?'}\n")
            sys.stdout.flush()

    return report


def trace_epoch(accelerator, plan, epoch: int, strategy: str,
                values_of: Callable[[Any], torch.Tensor] = batch_values,
                progress: Optional[Callable[[int, Optional[int]], None]] = None) -> dict:
    """One epoch of one loader on this rank, exactly as a training loop walks it.

    What it adds to the loop: a reference to each batch kept on the rank and, per batch or
    once at the end, tensor gathers. The result holds tensors; `finalize_epoch` turns them
    into lists on the main process. `values_of` reads a batch's sample values (id + 1).
    """
    device = accelerator.device
    # Step counts first: a per-batch gather with unequal counts would hang or abort. A plan
    # that is even by construction (every rank the same steps and batch shapes: sampler,
    # replicated, prepared with even_batches) needs no gather to know it.
    steps = _safe_len(plan.loader)
    if plan.even_shapes and steps is not None:
        counts = [steps] * accelerator.num_processes
    else:
        counts = _gather_ints(accelerator, [steps if steps is not None else -1])
    equal = len(set(counts)) == 1 and counts[0] >= 0
    per_batch = equal and (strategy == "batch" or
                           (strategy == "auto" and counts[0] <= PER_BATCH_GATHER_LIMIT))
    local: list = []
    gathered: list = []
    for_metrics: list = []
    metrics_cut = 0
    remainder = None
    for batch in plan.loader:
        batch = values_of(batch)
        if batch.device != device:
            batch = batch.to(device)
        local.append(batch)
        if progress is not None:
            progress(len(local), steps)
        if per_batch:
            # Equal step counts do not mean equal batch sizes (without even_batches the last
            # batches differ): pad to the longest with 0, which no sample value uses, so the
            # gather never sees unequal shapes; the padding is dropped below.
            if not plan.even_shapes:
                batch = accelerator.pad_across_processes(batch, dim=0, pad_index=0)
            gathered.append(accelerator.gather(batch))
            if plan.prepared:
                for_metrics.append(accelerator.gather_for_metrics(batch))
        elif plan.prepared and accelerator.gradient_state.end_of_dataloader:
            if equal:
                # Only the last batch of a prepared loader differs between the two gathers:
                # gather it both ways for real to learn how many fill samples accelerate drops.
                whole = accelerator.gather(batch)
                metrics_cut = len(whole) - len(accelerator.gather_for_metrics(batch))
            else:
                # No length to agree on beforehand (a stream): no collective here. Keep what
                # gather_for_metrics reads to cut the last batch: the samples still owed
                # (-1: unknown, so it cuts nothing).
                remainder = accelerator.gradient_state.remainder
    packed, shape = _gather_batches(accelerator, local, even=plan.even_shapes and equal,
                                    max_value=plan.max_value)
    return {"epoch": epoch, "gather": "batch" if per_batch else "epoch", "equal": equal,
            "prepared": plan.prepared, "packed": packed, "shape": shape,
            "gathered": torch.cat(gathered) if gathered else None,
            "for_metrics": torch.cat(for_metrics) if for_metrics else None,
            "metrics_cut": metrics_cut, "remainder": remainder}


def finalize_epoch(raw: dict, world: int, dataset_size: int) -> dict:
    """A raw epoch (tensors, on the main process) -> the trace's plain-data record.

    Per-batch gathers are kept as lists. A once-per-epoch gather returns each rank's ids in
    rank order, which `ranks` already holds, so only its count is kept: that keeps a
    10-million-sample trace to one copy of the ids.
    """
    shape = raw["shape"]
    rows = _rank_rows(raw["packed"], shape, world)  # unpacked once, used below
    ranks = _split_batches(rows)
    record: dict[str, Any] = {"epoch": raw["epoch"], "gather": raw["gather"],
                              "ranks": [{"rank": r, "batches": b} for r, b in enumerate(ranks)]}
    if raw["gather"] == "batch":
        gathered = _values(raw["gathered"])
        record["gathered"] = (gathered - 1).tolist()
        record["gathered_count"] = len(gathered)
        if raw["prepared"]:
            metrics = _values(raw["for_metrics"])
            record["gathered_for_metrics"] = (metrics - 1).tolist()
            record["gathered_for_metrics_count"] = len(metrics)
            record["gather_for_metrics_exact"] = _exactly_once(metrics - 1, dataset_size)
        return record
    record["gathered"] = None
    record["gathered_count"] = sum(shape[0::3])
    if not raw["prepared"]:
        return record
    exact, count = None, None
    equal, cut = raw["equal"], raw["metrics_cut"]
    if not equal and raw["remainder"] is not None:
        # gather_for_metrics keeps the first `remainder` ids of the last step when it is
        # positive, and everything otherwise (-1: the loader had no length).
        last = sum(int(sizes[-1]) for sizes, _ in rows if len(sizes))
        cut = last - raw["remainder"] if raw["remainder"] > 0 else 0
        equal = len(set(shape[1::3])) == 1
    if equal:
        # Per batch, gather_for_metrics returns every batch whole except the last, whose
        # tail it cuts by the count measured on the ranks: the last step's batches in rank
        # order, minus their last `cut` ids.
        last_step = [ids[len(ids) - int(sizes[-1]):] for sizes, ids in rows if len(sizes)]
        dropped = torch.cat(last_step)[-cut:] if cut else torch.empty(0, dtype=torch.int64)
        counts = torch.bincount(torch.cat([ids for _, ids in rows]), minlength=dataset_size)
        counts -= torch.bincount(dropped, minlength=dataset_size)
        count = record["gathered_count"] - cut
        exact = len(counts) == dataset_size and bool((counts == 1).all())
    record["gathered_for_metrics"] = None
    record["gathered_for_metrics_count"] = count
    record["gather_for_metrics_exact"] = exact
    return record


def _values(tensor: Optional[torch.Tensor]) -> torch.Tensor:
    """Gathered sample values, with the 0 padding (no sample has value 0) dropped."""
    if tensor is None:
        return torch.empty(0, dtype=torch.int64)
    values = tensor.reshape(-1).to("cpu", torch.int64)
    return values[values != 0]


def _exactly_once(ids: torch.Tensor, n: int) -> bool:
    if len(ids) != n or (len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n)):
        return False
    return bool((torch.bincount(ids, minlength=n) == 1).all())


def _gather_ints(accelerator, values: list[int]) -> list[int]:
    tensor = torch.tensor(values, dtype=torch.int64, device=accelerator.device)
    return accelerator.gather(tensor).tolist()


def _gather_batches(accelerator, local: list, even: bool = False,
                    max_value: Optional[int] = None):
    """Every rank's batches, gathered as one tensor per rank: a header (number of ids and
    of batches), the batch sizes, then the values.

    Ranks may hold different numbers of batches and samples (no even_batches, split by
    node, ...), so a small gather of the shapes comes first and the tensor is padded to the
    longest: gather needs equal shapes, and gloo cannot gather an empty tensor (torch issue
    85234). A plan that is even by construction skips that gather: every rank's shape is this
    rank's, which the headers confirm after the gather. Values travel as int32 when they fit,
    which makes the gather of a large epoch about four times cheaper on gloo.
    """
    device = accelerator.device
    ids = torch.cat(local) if local else torch.empty(0, dtype=torch.int64, device=device)
    n_ids, n_batches = ids.numel(), len(local)
    if even:
        top = max_value if max_value is not None else (int(ids.abs().max()) if n_ids else 0)
        shape = [n_ids, n_batches, top] * accelerator.num_processes
    else:
        top = int(ids.abs().max()) if n_ids else 0
        shape = _gather_ints(accelerator, [n_ids, n_batches, top])
    width = 2 + max(1, max(shape[0::3][r] + shape[1::3][r] for r in range(len(shape) // 3)))
    dtype = torch.int32 if max(shape[2::3]) < 2**31 - 1 else torch.int64
    packed = torch.zeros(width, dtype=dtype, device=device)
    packed[0], packed[1] = n_ids, n_batches
    if n_batches:
        packed[2:2 + n_batches] = torch.tensor([len(b) for b in local], dtype=dtype)
    packed[2 + n_batches:2 + n_batches + n_ids] = ids
    gathered = accelerator.gather(packed).to("cpu")
    if even:
        heads = gathered.view(accelerator.num_processes, width)[:, :2].tolist()
        if any(head != [n_ids, n_batches] for head in heads):
            raise RunFailed(f"ranks held different numbers of ids and batches {heads} in a loader "
                            "that should be even; rerun with --gather batch to see them")
    return gathered, shape


def _rank_rows(packed: torch.Tensor, shape: list[int], world: int) -> list:
    """Undo the packing: for each rank, (batch sizes, ids) as int64 tensors."""
    width = len(packed) // world
    rows = []
    for r in range(world):
        n_ids, n_batches = shape[3 * r], shape[3 * r + 1]
        row = packed[r * width + 2:(r + 1) * width].to(torch.int64)  # past the header
        rows.append((row[:n_batches], row[n_batches:n_batches + n_ids] - 1))
    return rows


def _split_batches(rows: list) -> list[list[list[int]]]:
    """Each rank's (sizes, ids) row -> its batches of ids, as lists."""
    out = []
    for sizes, ids in rows:
        flat, batches, start = ids.tolist(), [], 0
        for size in sizes.tolist():
            batches.append(flat[start:start + size])
            start += size
        out.append(batches)
    return out


# For testing sharddemo's own fault handling: "HOW:RANK:MODE:EPOCH" makes that rank raise
# (HOW=raise), die by SIGKILL (kill) or hang outside any collective (stall) when that mode's
# epoch starts. Unset in normal use.
FAULT_ENV = "SHARDDEMO_INJECT_FAULT"


def _inject_fault(rank: int, mode: str, epoch: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    how, want_rank, want_mode, want_epoch = spec.split(":")
    if (int(want_rank), want_mode, int(want_epoch)) != (rank, mode, epoch):
        return
    if how == "raise":
        raise ValueError(f"injected fault ({FAULT_ENV}={spec})")
    if how == "kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if how == "stall":
        time.sleep(3600)


def placement(accelerator) -> list[dict]:
    """Where every rank runs: global rank, local rank, node (machine rank) and host, as the
    main process sees them after one gather. The reference takes `local_rank` from
    `get_rank()`, which is only right on the first machine; here both are recorded."""
    import socket

    from accelerate.utils import gather_object

    node = os.environ.get(NODE_ENV) or os.environ.get("GROUP_RANK") or "0"
    mine = {"rank": accelerator.process_index, "local_rank": accelerator.local_process_index,
            "node": int(node), "host": socket.gethostname()}
    if accelerator.num_processes == 1:
        return [mine]
    return sorted(gather_object([mine]), key=lambda p: p["rank"])


def _peak_rss_kb() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux


def _safe_len(loader) -> Optional[int]:
    try:
        return len(loader)
    except TypeError:
        return None


def run_trace(opts: RunOptions, *, device: str = "auto", say: Optional[Callable[[str], None]] = None,
              trace_out: Optional[str] = None, allow_alone: bool = False) -> Optional[dict]:
    """The whole script on one rank. Returns the trace on the main process, None elsewhere.

    `allow_alone` skips the check that the launcher really started every process asked
    for: `sharddemo trap` uses it to show what that silent failure looks like."""
    from sharddemo.datasets import build_source

    accelerator = make_accelerator(device, opts.timeout)
    try:
        if not allow_alone:
            check_world(accelerator.num_processes)
        opts.check_world(accelerator.num_processes)
        world = accelerator.num_processes
        state = accelerator.state
        backend = getattr(state, "backend", None) or "none"
        main = accelerator.is_main_process
        talk = (say if (say is not None and main) else (lambda line: None))

        sums = arithmetic(world, opts)
        talk(
            f"world size {world} ({state.distributed_type.value}, backend {backend}, "
            f"device {accelerator.device.type}) | per-rank batch {opts.batch_size} | "
            f"global batch {sums['global_batch']} | dataset {opts.dataset_size} | "
            f"samples per epoch: {opts.dataset_size} if sharded, "
            f"{sums['replicated_samples_per_epoch']} if every rank walks it all"
        )
        dataset = build_source(opts.source, opts.dataset_size, opts.shards)
        modes: dict[str, Any] = {}
        timings: dict[str, float] = {}
        for mode in opts.modes:
            talk(f"== mode {mode}: {MODE_HELP[mode]}")
            start = time.perf_counter()
            try:
                modes[mode] = trace_mode(
                    accelerator, mode, dataset, opts,
                    on_epoch=lambda rec: _print_epoch(talk, rec, world, opts.dataset_size),
                )
            except UsageError:
                raise
            except Exception as exc:  # name the mode; the rank is named by the caller
                message = str(exc) if isinstance(exc, RunFailed) else (
                    f"mode {mode}: {type(exc).__name__}: {exc}")
                done = f" (modes completed before it: {', '.join(modes)})" if modes else ""
                raise RunFailed(message + done) from exc
            timings[mode] = round(time.perf_counter() - start, 6)
        peak = _gather_ints(accelerator, [_peak_rss_kb()])
        where = placement(accelerator)
        if not main:
            return None
        trace = {
            "schema": TRACE_SCHEMA,
            "world_size": world,
            "backend": backend,
            "distributed_type": state.distributed_type.value,
            "device": accelerator.device.type,
            "source": opts.source,
            "dataset_size": opts.dataset_size,
            "batch_size": opts.batch_size,
            "epochs": opts.epochs,
            "seed": opts.seed,
            "options": opts.to_dict(),
            "arithmetic": sums,
            "placement": where,
            "modes": modes,
            # Not reproducible, so kept apart from the rest of the trace.
            "timings": {"mode_s": timings, "peak_rss_mb": [round(kb / 1024, 1) for kb in peak]},
        }
        if trace_out:
            write_trace(trace, trace_out)
        return trace
    finally:
        teardown(accelerator)


def write_trace(trace: dict, path: str) -> None:
    """The main rank's trace, whole or not at all (compact: it can hold 10^7 ids)."""
    import json

    from sharddemo.fileio import write_atomic

    write_atomic(path, json.dumps(trace, separators=(",", ":")))


def teardown(accelerator) -> None:
    """End the run and leave the process group, as the DDP tutorial's destroy does."""
    accelerator.end_training()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# Above this dataset size `run` prints counts instead of every value.
PRINT_LIMIT = 64


def _print_epoch(talk: Callable[[str], None], record: dict, world: int, n: int) -> None:
    """Reference-style output: each rank's batches as sample values (id + 1), then the merge."""
    talk(f"epoch {record['epoch']}")
    small = n <= PRINT_LIMIT
    for rank in record["ranks"]:
        label = rank_label(rank["rank"], world)
        if small:
            for step, ids in enumerate(rank["batches"]):
                talk(f"{label} batch {step}: {[i + 1 for i in ids]}")
        else:
            count = sum(len(b) for b in rank["batches"])
            talk(f"{label} {len(rank['batches'])} batches, {count} samples")
    total = record["gathered_count"]
    if record["gather"] == "batch" and small:
        talk(f"merged by accelerator.gather: {[i + 1 for i in record['gathered']]}")
    elif small:
        merged = [i + 1 for r in record["ranks"] for b in r["batches"] for i in b]
        talk(f"merged by accelerator.gather of each rank's epoch: {merged}")
    else:
        how = "every batch" if record["gather"] == "batch" else "each rank's epoch"
        talk(f"merged by accelerator.gather of {how}: {total} values")
    talk(f"total {total} = {total / n:g}x the dataset of {n}")
    if record.get("gathered_for_metrics_count") is not None:
        talk(f"accelerator.gather_for_metrics returned {record['gathered_for_metrics_count']}")


def rank_fail(message: str, usage: bool = False) -> None:
    """One line on stderr, from the rank that failed. `sharddemo compare` and `audit` read
    these lines back: `Usage error` ones become exit code 2, the others 1."""
    kind = "Usage error" if usage else "Error"
    # One write call, so that lines from ranks failing together do not interleave.
    sys.stderr.write(f"{rank_label()} {kind}: {message}\n")
    sys.stderr.flush()
