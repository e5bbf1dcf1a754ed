"""`sharddemo audit`: run a user's own DataLoader factory on real ranks and prove that it shards.

The factory is `make_loader(accelerator) -> DataLoader`, named as `package.module:make_loader`
or `path/to/file.py:make_loader`. Every rank calls it with its own Accelerator and walks what
it returns exactly as a training loop does (prepared or not: the user's code decides). The
ids each rank received come from an id field of the batches (`--id-field`) or, for map-style
datasets, from the indices the loader's own sampler handed out, recorded without changing
what the loader yields (workers included: indices are drawn in the main process).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Callable, Optional

from sharddemo.errors import LoaderRaised, RunFailed, UsageError, describe_exception
from sharddemo.options import AuditOptions
from sharddemo.record import largest_id
from sharddemo.targets import FACTORY_CALLS, factory_name, parse_target

AUDIT_MODE = "audit"

def load_factory(target: str, framework: Optional[str] = None) -> Callable:
    where, name = parse_target(target, framework)
    try:
        if where.endswith(".py") or os.sep in where:
            path = os.path.abspath(where)
            module_name = "sharddemo_user_" + os.path.splitext(os.path.basename(path))[0]
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # lets dataclasses and pickling find it
            sys.path.insert(0, os.path.dirname(path))
            spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except Exception as exc:
        from sharddemo.extras import missing_module_hint

        raise UsageError(f"{where} does not import: {describe_exception(exc)}"
                         f"{missing_module_hint(exc)}") from exc
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{where} has no {name!r}; name the function that builds your "
                             f"{FACTORY_CALLS[framework][1]}, e.g. {where}:{factory_name(framework)}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{where}:{name} is not a function but a {type(obj).__name__}; it must "
                         f"be callable as {FACTORY_CALLS[framework][0]}")
    return obj


def id_reader(loader, id_field: Optional[str], keys_file: Optional[str] = None) -> Callable:
    """Return read_ids(batch, tag) for the walk: the 0-based sample ids of a batch.

    By id field, or by the indices the dataset was really asked for (rank.tagging.tag_batches
    records them in whatever process fetched the batch, so workers, stateful loaders,
    prefetching and accelerate's dispatch are all covered)."""
    import torch

    from sharddemo.rank.describe import base_loader

    from sharddemo.rank.tagging import is_tagged, tag_batches

    if id_field is not None:
        from sharddemo.rank.ids import Packs, field_values, integer_ids, packed_ids
        from sharddemo.rank.keys import KeyTable, file_keys, key_values, source_keys

        whole = id_field == "."
        label = f"--id-field {id_field}"
        # keys (str, bytes) -> this rank's ids (rank.keys); the set of all keys where known:
        # --keys FILE, else the dataset's own column
        own = None if keys_file is not None or whole else source_keys(loader, id_field)
        if keys_file is not None:
            table = KeyTable(id_field, lambda: file_keys(keys_file), f"--keys {keys_file}")
            table.known_count = sum(len(chunk) for chunk in file_keys(keys_file))
        elif own is not None:
            table = KeyTable(id_field, own[0], f"the dataset's column {id_field!r}")
            table.known_count = own[1]
        else:
            table = KeyTable(id_field)
        # packed rows: this rank's last row, carried from batch to batch (the walk starts it
        # anew each epoch): a sample split across two consecutive rows counts once
        packs = Packs()

        def by_field(batch, tag):
            values = field_values(batch, id_field, label)
            keys = key_values(values)
            if keys is not None:
                return table.lookup(keys)
            table.numbers = True
            if (not whole and torch.is_tensor(values) and values.dim() == 0
                    and torch.is_tensor(batch) and batch.dim() > 0):
                raise UsageError(f"--id-field {id_field} selects one number per batch (the "
                                 f"batches are tensors of shape {tuple(batch.shape)}), not the "
                                 "ids of its samples; pass --id-field . when each batch is "
                                 "itself the tensor of ids")
            packed = packed_ids(values, label, None, packs)  # (several samples a row)
            return packed if packed is not None else integer_ids(values, label)

        tag_batches(loader, record_indices=False)  # which worker made each batch
        by_field.keys = table  # the walk exchanges it at each epoch's end
        by_field.packs = packs
        return by_field
    base = base_loader(loader)
    dataset = getattr(base, "dataset", None)
    from torch.utils.data import IterableDataset

    dataset = getattr(dataset, "_inner", dataset)  # already tagged on its way through prepare
    if dataset is None or isinstance(dataset, IterableDataset) \
            or type(dataset).__name__ == "IterableDataset":
        raise UsageError("the loader reads an iterable dataset, which has no indices to record; "
                         "pass --id-field with a field of the batches that holds each sample's "
                         "id (--id-field . when each batch is the ids)")
    if not tag_batches(loader, record_indices=True) and not is_tagged(loader):
        raise UsageError("the loader's batches cannot be traced to dataset indices (no "
                         "collate function to wrap); pass --id-field")

    def by_index(batch, tag):
        if tag is None or "index" not in tag:
            raise RunFailed("a batch arrived without the indices it was made of (the dataset "
                            "was not asked for them one by one); pass --id-field")
        return tag["index"].to("cpu", torch.int64)

    return by_index


def build_factory_loader(accelerator, factory: Callable, opts: AuditOptions,
                         stateful: bool = False, mesh=None):
    """Build the user's loader on this rank, as their script builds it.

    The factory called with the rank's Accelerator (with use_stateful_dataloader set first when
    `stateful`), every DataLoader tagged on its way through prepare. A factory that raises is a
    RunFailed. On a mesh (`mesh`: rank.mesh.RankMesh) the factory gets it as `mesh=` where it
    takes one."""
    if stateful:
        # What DataLoaderConfiguration(use_stateful_dataloader=True) says in a script.
        accelerator.dataloader_config.use_stateful_dataloader = True
    from sharddemo.rank.frameworks import call_factory

    from sharddemo.rank.tagging import tagging_prepare

    with tagging_prepare(accelerator, record_indices=opts.id_field is None):
        if mesh is not None:
            from sharddemo.rank.mesh import call_with_mesh

            return call_factory(lambda acc: call_with_mesh(factory, mesh, acc), opts.target,
                                accelerator)
        return call_factory(factory, opts.target, accelerator)


def set_epoch(loader, epoch: int) -> None:
    """Call set_epoch as a training loop does.

    On the loader's sampler, else on the loader (a prepared one passes it on), else on the first
    sampler down the chain that has it (a DistributedSampler inside a batch_sampler, or inside a
    BatchSampler given as the `sampler` of a loader with batch_size=None)."""
    from sharddemo.rank.describe import base_loader, sampler_chain

    base = base_loader(loader)
    for obj in (getattr(base, "sampler", None), loader, *sampler_chain(base)):
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
            return


def audit_rank(opts: AuditOptions, *, device: str = "auto", trace_out: Optional[str] = None,
               say: Optional[Callable[[str], None]] = None) -> Optional[dict]:
    """The rank side: build the user's loader(s), walk each, gather what every rank saw."""
    from sharddemo.rank.session import peak_rss_mb, placement, rank_session

    factory = load_factory(opts.target, opts.framework)
    with rank_session(device, opts.timeout) as session:
        accelerator = session.accelerator
        mesh = None
        if opts.mesh is not None:  # before the factory, which may prepare over it
            from sharddemo.rank.mesh import form_mesh

            mesh = form_mesh(opts.mesh, accelerator)
        targets = audited_loaders(accelerator, factory, opts, mesh)
        modes, elapsed = {}, {}
        for target in targets:
            start = time.perf_counter()
            modes[target.mode] = _walk_target(accelerator, target, opts)
            elapsed[target.mode] = round(time.perf_counter() - start, 6)
        peak = peak_rss_mb(accelerator)
        where = placement(accelerator)
        if not session.is_main:
            return None
        first = modes[targets[0].mode]
        return session.finish({
            **({} if mesh is None else {"mesh": mesh.trace()}),
            "source": "user" if opts.framework is None else opts.framework,
            **first["sizes"],
            "epochs": opts.epochs,
            "seed": 0,
            "options": {"audit": asdict(opts), "drop_last": first["loader"]["drop_last"]},
            "placement": where,
            "fingerprint": first["fingerprint"],
            "modes": modes,
            "timings": {"mode_s": elapsed, "peak_rss_mb": peak},
        }, trace_out)


def audited_loaders(accelerator, factory: Callable, opts: AuditOptions, mesh=None) -> list:
    """What this rank audits: the user's own loader, or the loaders a framework builds.
    `mesh`: the run's device mesh with --mesh (rank.mesh.RankMesh), given to the factory."""
    from sharddemo.rank.frameworks import Audited
    from sharddemo.rank.describe import base_loader

    if opts.framework == "trainer":
        from sharddemo.rank.frameworks.trainer import trainer_loaders

        return trainer_loaders(accelerator, factory, opts)
    if opts.framework == "lightning":
        from sharddemo.rank.frameworks.lightning import lightning_loaders

        return lightning_loaders(accelerator, factory, opts)
    loader = build_factory_loader(accelerator, factory, opts, stateful=opts.stateful, mesh=mesh)
    if not hasattr(loader, "__iter__") or (opts.id_field is None
                                           and not hasattr(base_loader(loader), "dataset")):
        raise UsageError(f"the factory {opts.target} returned an object of type "
                         f"{type(loader).__name__}, not a DataLoader; return the loader your "
                         "training loop walks (or pass --id-field for another iterable of "
                         "batches)")
    return [Audited(AUDIT_MODE, loader, opts.epochs, f"your loader from {opts.target}",
                    start_epoch=(lambda epoch: set_epoch(loader, epoch)) if opts.set_epoch
                    else None, grad_accum=opts.grad_accum)]


def _walk_target(accelerator, target, opts: AuditOptions) -> dict:
    """Walk one audited loader for its epochs: its trace mode on the main rank ({} elsewhere)."""
    from sharddemo.rank.collect import exchange_ints
    from sharddemo.options import per_rank_batch
    from sharddemo.rank.describe import (agree_on_fingerprint, describe_loader, is_prepared,
                                         loader_batch_size)
    from sharddemo.rank.walk import EpochWalker

    loader = target.loader
    description = describe_loader(loader)  # before the walk wraps anything
    agreed = agree_on_fingerprint(accelerator, loader, description=description,
                                  ids_by_position=opts.id_field is None)
    read_ids = id_reader(loader, opts.id_field, opts.keys)
    prepared = is_prepared(loader)
    # N before the walk, where the loader says it (the count path needs it); else after.
    # Keys: the set of all keys, where known, is the dataset.
    table = getattr(read_ids, "keys", None)
    known = (table.known_count if table is not None and table.known_count is not None
             else _known_size(loader, opts, agreed))
    where = "" if target.mode == AUDIT_MODE else f"{target.mode}: "
    # (keep_ids: without N, `auto` never takes the count path)
    walker = EpochWalker(accelerator, loader, read_ids, strategy=opts.gather,
                         n=None if opts.keep_ids else known,
                         label="audit" if target.mode == AUDIT_MODE else target.mode,
                         before_epoch=target.start_epoch,
                         failure=lambda epoch, exc: f"{where}epoch {epoch} of the loader raised "
                                                    f"{describe_exception(exc)}")
    raised = None
    for epoch in range(target.epochs):
        try:
            walker.walk(epoch)
        except LoaderRaised as exc:
            # a library raised in the loader on every rank, and every rank knows it
            # (walk.settle): the loader's finding, reported with the epochs before it
            raised = exc.raised
            break
    records = walker.records
    size = _dataset_size(loader, opts, records, agreed)
    # An epoch with no ids anywhere still needs N: --dataset-size or len(dataset).
    sizes = exchange_ints(accelerator, [size])
    size = max(row[0] for row in sizes)
    batch = loader_batch_size(loader)
    if not accelerator.is_main_process:
        return {}
    world = accelerator.num_processes
    epochs = records
    seen = batch is None  # no batch size to read (a batch sampler of its own): the largest
    if seen:              # batch a rank received, which is per rank already
        batch = per_rank = max((len(b) for e in epochs for r in e["ranks"]
                                for b in r.get("batches", r.get("head", []))), default=1)
    else:
        per_rank = per_rank_batch(batch, world, bool(description.get("split_batches")))
    mode = {"description": target.description, "prepared": prepared, "loader": description,
            "fingerprint": agreed, "epochs": epochs, "role": target.role,
            # set_epoch was called before each epoch, as the training loop does (--set-epoch,
            # or the framework's own call)
            "set_epoch_called": target.start_epoch is not None,
            "sizes": {"dataset_size": size, "batch_size": batch,
                      "global_batch": per_rank * world, "batch_size_seen": seen}}
    if raised is not None:
        mode["raised"] = raised
    if target.settings:
        mode["settings"] = target.settings
    if target.note:
        mode["note"] = target.note
    if target.grad_accum is not None:
        mode["grad_accum"] = target.grad_accum
    if (table is not None and table.known is not None and opts.keys is None
            and any(r.get("ids_are_keys") or r.get("key_slots") for r in records)):
        # the dataset's own keys name the samples in the report (analysis.keys)
        mode["keys_known"] = [k for chunk in table.known() for k in chunk]
        mode["keys_from"] = table.known_from
    return mode


def _known_size(loader, opts: AuditOptions, agreed: Optional[dict] = None):
    """Return N where it is known before any walk; None for a stream without --dataset-size.

    The length of the dataset under any Subset, else (a stream) --dataset-size. The dataset's
    own length wins: a framework audit walks several loaders, and --dataset-size is meant for
    the stream among them, not for the map-style eval set beside it. Where the ranks read
    different rows (`agreed["rows_differ"]`: data split by rank before the loader, audited by
    --id-field), a rank's own length is its part only: --dataset-size, else None (found after
    the walk)."""
    from sharddemo.rank.describe import base_loader, root_length

    if agreed and agreed.get("rows_differ") and opts.id_field is not None:
        return opts.dataset_size
    length = root_length(getattr(base_loader(loader), "dataset", None))
    return length if length is not None else opts.dataset_size


def _dataset_size(loader, opts: AuditOptions, records: list,
                  agreed: Optional[dict] = None) -> int:
    """Return N: the dataset's length, else --dataset-size, else one past the largest id.

    The length of the dataset under any Subset; the largest id this rank saw (the ranks then
    agree on the largest); 0 for keys, which the parent numbers."""
    length = _known_size(loader, opts, agreed)
    if length is not None:
        return length
    if any(record.get("ids_are_keys") for record in records):
        return 0  # keys: the parent numbers them and sets N (analysis.keys)
    # (the main rank's records: every rank's batches; a counted one has N)
    return max((largest_id(record) for record in records), default=-1) + 1
