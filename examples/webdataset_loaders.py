"""WebDataset loaders as users build them, right and wrong, for `sharddemo audit` (extra
`[webdataset]`). Each rank writes the same tar shards into a temporary folder of its own:
samples named "sample000000".."sample000047" (`__key__`), 4 to a shard.

    sharddemo audit examples/webdataset_loaders.py:split --id-field __key__ --dataset-size 48
    sharddemo audit examples/webdataset_loaders.py:default_nodesplitter --id-field __key__ --dataset-size 48
    sharddemo audit examples/webdataset_loaders.py:silenced --id-field __key__ --dataset-size 48
    sharddemo audit examples/webdataset_loaders.py:resampled --id-field __key__ --dataset-size 48
    sharddemo audit examples/webdataset_loaders.py:uneven_shards --id-field __key__ --dataset-size 44

- `split`: WebDataset's documented split, `nodesplitter=wds.split_by_node` and
  `workersplitter=wds.split_by_worker`, batched in the pipeline (DataLoader batch_size=None),
  2 workers. 12 shards over 2 ranks x 2 workers (or 3 x 2): each sample once.
- `default_nodesplitter`: no nodesplitter. WebDataset's default (`single_node_only`) raises "you
  need to add an explicit nodesplitter" on more than one rank, because every rank would read
  every shard.
- `silenced`: the error silenced the wrong way, `nodesplitter=lambda src: src`: every rank
  reads every shard (replication).
- `resampled`: `resampled=True` with `.with_epoch(3)`: shards drawn with replacement, 3
  batches of 4 per worker an epoch (48 draws on 2 ranks x 2 workers). Its repeats and gaps
  are its design, not a bug.
- `uneven_shards`: 11 shards of 4 (44 samples), batched by the DataLoader: one rank reads 6
  shards and the other 5, so the ranks take unequal step counts (DDP would hang).
"""

import os
import tempfile

import webdataset as wds
from torch.utils.data import DataLoader

PER_SHARD = 4
BATCH = 4
WORKERS = 2


def write_shards(shards: int) -> list[str]:
    """`shards` tar files of PER_SHARD samples in a temporary folder of this process (a
    launch's own temporary folder, removed with it)."""
    folder = tempfile.mkdtemp(prefix="sharddemo-wds-")
    urls = []
    for s in range(shards):
        path = os.path.join(folder, f"shard-{s:05d}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(s * PER_SHARD, (s + 1) * PER_SHARD):
                sink.write({"__key__": f"sample{i:06d}", "id.txt": str(i)})
        urls.append(path)
    return urls


def split(accelerator):
    urls = write_shards(12)
    dataset = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node,
                              workersplitter=wds.split_by_worker)
               .decode().batched(BATCH))
    return DataLoader(dataset, batch_size=None, num_workers=WORKERS)


def default_nodesplitter(accelerator):
    urls = write_shards(12)
    dataset = wds.WebDataset(urls, shardshuffle=False).decode().batched(BATCH)
    return DataLoader(dataset, batch_size=None, num_workers=WORKERS)


def silenced(accelerator):
    urls = write_shards(12)
    dataset = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=lambda src: src)
               .decode().batched(BATCH))
    return DataLoader(dataset, batch_size=None, num_workers=WORKERS)


def resampled(accelerator):
    urls = write_shards(12)
    dataset = (wds.WebDataset(urls, resampled=True, shardshuffle=False,
                              nodesplitter=wds.split_by_node)
               .decode().batched(BATCH).with_epoch(3))
    return DataLoader(dataset, batch_size=None, num_workers=WORKERS)


def uneven_shards(accelerator):
    urls = write_shards(11)
    dataset = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node).decode()
    return DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS)
