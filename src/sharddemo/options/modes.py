"""The modes `run` and `compare` know, the sources their samples come from, and their words
(the help and the description each mode's report carries)."""

from __future__ import annotations

from sharddemo.errors import UsageError

# The modes `run` and `compare` know. `all` is the reference's three; `pitfalls` the two
# that silently lose samples; `split` is the datasets-native split for the HF sources.
BASIC_MODES = ("prepared", "sampler", "replicated")
PITFALL_MODES = ("double-split", "unseeded")
# --source webdataset has its own: the documented split and what users meet instead of it.
# `all` there means these five.
WDS_MODES = ("split", "no-nodesplitter", "silenced", "resampled", "uneven-shards")
# On a device mesh (--mesh), the bug a mesh adds: a sampler over every rank of the world, so
# replica peers (tp, cp) receive different batches; `pitfalls` includes it there.
MESH_PITFALL = "world-sampler"
MODES = BASIC_MODES + PITFALL_MODES + ("split", "resume") + WDS_MODES[1:] + (MESH_PITFALL,)
MODE_GROUPS = {"all": BASIC_MODES, "pitfalls": PITFALL_MODES}
# the modes built on a mesh (rank/loaders.py), and what they refuse
MESH_MODES = BASIC_MODES + PITFALL_MODES + (MESH_PITFALL,)

MODE_HELP = {
    "prepared": "plain DataLoader(shuffle=True) passed through accelerator.prepare, which shards it",
    "sampler": "DataLoader with an explicit DistributedSampler and set_epoch each epoch, not prepared",
    "replicated": "plain DataLoader(shuffle=True), not prepared, no sampler: every rank walks all of it",
    "double-split": "pitfall: a DataLoader that already has a DistributedSampler, passed through "
                    "accelerator.prepare as well, so it is split twice",
    "unseeded": "pitfall: accelerator.prepare with use_seedable_sampler=True and no seed, so every "
                "process shuffles with its own seed",
    "split": "the source's own split, then a plain DataLoader, not prepared: "
             "datasets.distributed.split_dataset_by_node per rank (hf, hf-stream), or WebDataset's "
             "nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker (webdataset)",
    "no-nodesplitter": "webdataset: wds.WebDataset(urls) with its default nodesplitter, which "
                       "raises on more than one rank rather than let every rank read every shard",
    "silenced": "webdataset pitfall: that error silenced with nodesplitter=lambda src: src, so every "
                "rank reads every shard",
    "resampled": "webdataset: resampled=True with .with_epoch(ceil(N / (ranks x workers))) per "
                 "worker: shards drawn with replacement, repeats and gaps by design",
    "uneven-shards": "webdataset: the documented split over the same samples in ranks x workers + 1 "
                     "shards, which do not divide: the ranks read unequal amounts",
    "world-sampler": "mesh pitfall: DistributedSampler(num_replicas=world size, rank=process "
                     "index), over every rank of the mesh instead of its data-parallel groups, so "
                     "replica peers (tp, cp) receive different batches",
    "resume": "the prepared loader stopped, saved, restarted and resumed: skip, stateful and restart "
              "strategies, mid-epoch and epoch-boundary stops, 0 and 2 workers, epochs 0..2 (compare only; "
              "--epochs, --num-workers and --gather do not apply)",
}


# On a mesh the prepared loaders go through accelerate with the mesh as its torch_device_mesh
# (accelerate 1.16's ParallelismConfig refuses MULTI_CPU: on CPU the mesh is torch's
# init_device_mesh, and accelerate's PartialState is the launch's), and the sampler splits over
# the data-parallel groups, its rank the mesh's own data coordinate.
MESH_WORDS = ("accelerator.prepare with the mesh as accelerate's torch_device_mesh, so that "
              "prepare_data_loader(torch_device_mesh=mesh) deals it (on CPU, where "
              "ParallelismConfig refuses MULTI_CPU, the mesh is torch's init_device_mesh)")
MESH_HELP = {
    "prepared": "plain DataLoader(shuffle=True) passed through " + MESH_WORDS,
    "sampler": "DataLoader with DistributedSampler(num_replicas=the data-parallel groups, "
               "rank=the mesh's data coordinate) and set_epoch each epoch, not prepared: "
               "replica peers share a sampler rank",
    "double-split": "pitfall: a DataLoader with a DistributedSampler over the data-parallel "
                    "groups, passed through " + MESH_WORDS + " as well, so it is split twice",
    "unseeded": "pitfall: use_seedable_sampler=True and no seed, passed through " + MESH_WORDS
                + ", so every process shuffles with its own seed",
}


def mode_description(mode: str, shuffle: bool, source: str, mesh: bool = False) -> str:
    """MODE_HELP as the run built the mode: its plain DataLoader shuffles only with --shuffle
    over a map-style source (a stream has no order to shuffle; loaders.plain_loader); on a
    mesh (--mesh) as MESH_HELP says."""
    text = MESH_HELP.get(mode, MODE_HELP[mode]) if mesh else MODE_HELP[mode]
    if not (shuffle and source in MAP_SOURCES):
        text = text.replace("DataLoader(shuffle=True)", "DataLoader(shuffle=False)")
    return text


# Where the samples come from. Every source carries its sample ids.
SOURCES = ("toy", "hf", "iterable", "iterable-unsplit", "hf-stream", "webdataset")
MAP_SOURCES = ("toy", "hf")
SOURCE_HELP = {
    "toy": "the reference's dataset: sample i holds the value i + 1",
    "hf": "a datasets.Dataset built in memory with an `id` column, torch format",
    "iterable": "a torch IterableDataset streaming ids 0..N-1 (no length), split by DataLoader "
                "worker",
    "iterable-unsplit": "the common mistake: an IterableDataset that ignores workers and ranks, "
                        "so every worker yields the whole stream",
    "hf-stream": "a datasets.IterableDataset streamed from JSON-lines shards written locally",
    "webdataset": "WebDataset tar shards written locally, samples keyed sample000000.. (extra "
                  "[webdataset]); modes: " + ", ".join(WDS_MODES) + " (all: these five)",
}

def parse_modes(text: str, source: str = "toy", mesh: bool = False) -> tuple[str, ...]:
    """`all`, one mode, or a comma list of modes -> a tuple in the order given, no repeats.
    Over --source webdataset, `all` is that source's five modes (WDS_MODES); on a mesh,
    `pitfalls` adds world-sampler."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise UsageError("no mode given; pass --mode all or a comma list of: " + ", ".join(MODES))
    out: list[str] = []
    for name in names:
        if name == "all" and source == "webdataset":
            chosen = list(WDS_MODES)
        elif name in MODE_GROUPS:
            chosen = list(MODE_GROUPS[name])
            if name == "pitfalls" and mesh:
                chosen.append(MESH_PITFALL)
        elif name in MODES:
            chosen = [name]
        else:
            raise UsageError(
                f"unknown mode {name!r}; choose 'all', 'pitfalls' or a comma list of: "
                + ", ".join(MODES)
            )
        out.extend(m for m in chosen if m not in out)
    return tuple(out)
