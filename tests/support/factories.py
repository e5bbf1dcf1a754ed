"""DataLoader factories for the audit tests: make_x(accelerator) -> DataLoader."""

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

N = 60


def _dataset(n=N):
    features = torch.randn(n, 2, generator=torch.Generator().manual_seed(0))  # same on every rank
    return TensorDataset(torch.arange(n), features)


def sampler_with_workers(accelerator):
    """Not prepared, DistributedSampler, 2 workers: ids come from the recorded indices."""
    sampler = DistributedSampler(_dataset(), num_replicas=accelerator.num_processes,
                                 rank=accelerator.process_index, shuffle=True, seed=3)
    return DataLoader(_dataset(), batch_size=4, sampler=sampler, num_workers=2)


def hf_with_id_field(accelerator):
    from datasets import Dataset

    ds = Dataset.from_dict({"sample_id": list(range(N)), "x": [float(i) for i in range(N)]})
    return accelerator.prepare(DataLoader(ds.with_format("torch"), batch_size=5, shuffle=True))


def tuple_ids(accelerator):
    """Batches are (ids, features): --id-field 0."""
    return accelerator.prepare(DataLoader(_dataset(), batch_size=4, shuffle=True))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(N))


def stream_without_ids(accelerator):
    return DataLoader(Stream(), batch_size=4)


def everyone_everything(accelerator):
    """Not prepared, no sampler: meant to replicate (say, an eval set every rank scores)."""
    return DataLoader(_dataset(), batch_size=4, shuffle=False)


def unequal_lengths(accelerator):
    """A split by hand whose shards differ in length: the ranks take different step counts."""
    from torch.utils.data import Subset

    r, w = accelerator.process_index, accelerator.num_processes
    return DataLoader(Subset(_dataset(N + 1), list(range(r, N + 1, w))), batch_size=1)


def raises(accelerator):
    raise RuntimeError("cannot open the shards")


class Faulty(torch.utils.data.Dataset):
    """Fails on one rank at its `after`-th fetch: raises, kills itself, or stalls."""

    def __init__(self, rank, how, after=5, n=N):
        self.rank, self.how, self.after, self.n, self.fetched = rank, how, after, n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        self.fetched += 1
        if self.rank == 1 and self.fetched == self.after:
            if self.how == "raise":
                raise ValueError(f"corrupt sample {index}")
            if self.how == "kill":
                import os
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "stall":
                import time

                time.sleep(600)  # alive, but never reaches the next collective
        return torch.tensor(index)


def _faulty(accelerator, how):
    dataset = Faulty(accelerator.process_index, how)
    return accelerator.prepare(DataLoader(dataset, batch_size=2, shuffle=False))


def raise_mid_epoch(accelerator):
    return _faulty(accelerator, "raise")


def kill_mid_epoch(accelerator):
    return _faulty(accelerator, "kill")


def stall_mid_epoch(accelerator):
    return _faulty(accelerator, "stall")


def ragged_shapes(accelerator):
    """Equal step counts, different batch sizes per rank: a plain gather would abort."""
    from torch.utils.data import Subset

    r = accelerator.process_index
    ids = list(range(0, N, 2)) if r == 0 else list(range(1, 40, 2))  # 30 and 20 samples
    return DataLoader(Subset(_dataset(), ids), batch_size=3 if r == 0 else 2)  # 10 steps each


def stateful_with_workers(accelerator):
    """accelerate issue 4204: a prepared StatefulDataLoader with workers and no seed draws its
    first permutation inside prepare(), before the ranks synchronise their RNG."""
    accelerator.dataloader_config.use_stateful_dataloader = True
    return accelerator.prepare(DataLoader(TensorDataset(torch.arange(40)), batch_size=4,
                                          shuffle=True, num_workers=2))


def length_depends_on_rank(accelerator):
    """One node sees one file fewer: rank 1 has 9,999 samples, rank 0 10,000."""
    n = 10_000 - accelerator.process_index
    return accelerator.prepare(DataLoader(TensorDataset(torch.arange(n)), batch_size=4))


class Unsplit(IterableDataset):
    """Ignores workers and ranks: every worker yields ids 0..11."""

    def __iter__(self):
        return iter(range(12))


def unsplit_stream_with_workers(accelerator):
    return DataLoader(Unsplit(), batch_size=3, num_workers=2)


class Ordered(IterableDataset):
    """{"id": i} for 1,003 ids, in order or in one fixed shuffled order (the same each epoch)."""

    def __init__(self, shuffled: bool = False) -> None:
        self.order = list(range(1003))
        if shuffled:
            import random

            random.Random(0).shuffle(self.order)

    def __iter__(self):
        return ({"id": i} for i in self.order)


def stream_in_order_dispatched(accelerator):
    return accelerator.prepare(DataLoader(Ordered(), batch_size=8))


def stream_in_order_sharded(accelerator):
    accelerator.dataloader_config.dispatch_batches = False
    return accelerator.prepare(DataLoader(Ordered(), batch_size=8))


def stream_sharded_read_whole_by_each_worker(accelerator):
    accelerator.dataloader_config.dispatch_batches = False
    return accelerator.prepare(DataLoader(Ordered(), batch_size=8, num_workers=2))


def stream_shuffled_alike_each_epoch(accelerator):
    return accelerator.prepare(DataLoader(Ordered(shuffled=True), batch_size=8))


def id_tensor_batches(accelerator):
    """Each batch is itself the tensor of ids."""
    return DataLoader(Unsplit(), batch_size=3)


def seeded_40(accelerator):
    """A prepared shuffled loader of 40, seeded before it is built: every launch draws the same
    permutation."""
    from accelerate.utils import set_seed

    set_seed(0)
    return accelerator.prepare(DataLoader(TensorDataset(torch.arange(40)), batch_size=4,
                                          shuffle=True))


def unseeded_40(accelerator):
    return accelerator.prepare(DataLoader(TensorDataset(torch.arange(40)), batch_size=4,
                                          shuffle=True))


def split_batches_40(accelerator):
    """Prepared with split_batches: each batch of 8 is sliced across the ranks."""
    from accelerate.data_loader import prepare_data_loader

    return prepare_data_loader(DataLoader(TensorDataset(torch.arange(40)), batch_size=8),
                               num_processes=accelerator.num_processes,
                               process_index=accelerator.process_index, split_batches=True,
                               put_on_device=False)


def plain_40(accelerator):
    """Not prepared, no state_dict: nothing the stateful strategy could restore."""
    return DataLoader(TensorDataset(torch.arange(40)), batch_size=4)


def fails_in_the_third_launch(accelerator):
    """Counts its calls per rank in $SHARDDEMO_TEST_COUNTER_DIR: the reference and the stopping
    launch run, the resuming launch (the third) raises."""
    import os

    folder = os.environ["SHARDDEMO_TEST_COUNTER_DIR"]
    path = os.path.join(folder, f"calls-{accelerator.process_index}")
    calls = int(open(path).read()) + 1 if os.path.exists(path) else 1
    with open(path, "w") as handle:
        handle.write(str(calls))
    if calls == 3:
        raise RuntimeError("the resumed run cannot open its shards")
    return seeded_40(accelerator)


def counts_its_launches_40(accelerator):
    """seeded_40 that notes each call (one per rank per launch) as a line of
    $SHARDDEMO_TEST_COUNTER_DIR/launches: the world size it was built on."""
    import os

    with open(os.path.join(os.environ["SHARDDEMO_TEST_COUNTER_DIR"], "launches"), "a") as handle:
        handle.write(f"{accelerator.num_processes}\n")
    return seeded_40(accelerator)


# Loaders whose own objects deal part of the dataset, or repeat ids, by design.
def split_parts(seed=0):
    """random_split of the 60 ids into 45 to train on and 15 held out (a seeded generator:
    every rank draws the same split)."""
    from torch.utils.data import random_split

    return random_split(_dataset(), [45, 15], generator=torch.Generator().manual_seed(seed))


def random_split_train(accelerator):
    """The usual train/validation split, the train part prepared: the 15 held out are not
    its data."""
    return accelerator.prepare(DataLoader(split_parts()[0], batch_size=4, shuffle=True))


def random_split_distributed(accelerator):
    """The DDP recipe: the train part of the same split under torch's DistributedSampler
    (seed 0; 45 do not divide by 2 ranks: it pads), not prepared."""
    train = split_parts()[0]
    sampler = DistributedSampler(train, num_replicas=accelerator.num_processes,
                                 rank=accelerator.process_index, seed=0)
    return DataLoader(train, batch_size=4, sampler=sampler)


def random_split_eval(accelerator):
    """The validation part of the same split, prepared as an eval loader."""
    return accelerator.prepare(DataLoader(split_parts()[1], batch_size=4))


def weighted_draws(accelerator):
    """WeightedRandomSampler (replacement=True): 60 draws an epoch, repeats and gaps by design."""
    from torch.utils.data import WeightedRandomSampler

    sampler = WeightedRandomSampler(torch.ones(N), N, generator=torch.Generator().manual_seed(5))
    return accelerator.prepare(DataLoader(_dataset(), batch_size=4, sampler=sampler))


def weighted_draws_unprepared(accelerator):
    """The same sampler on every rank, not prepared: each rank draws the whole epoch."""
    from torch.utils.data import WeightedRandomSampler

    sampler = WeightedRandomSampler(torch.ones(N), N, generator=torch.Generator().manual_seed(5))
    return DataLoader(_dataset(), batch_size=4, sampler=sampler)


def hf_ids(n=N):
    from datasets import Dataset

    return Dataset.from_dict({"sample_id": list(range(n)),
                              "x": [float(i) for i in range(n)]}).with_format("torch")


def hf_train_test_split(accelerator):
    """datasets' train_test_split (a view with an indices mapping), the train part prepared."""
    train = hf_ids().train_test_split(test_size=0.25, seed=0)["train"]
    return accelerator.prepare(DataLoader(train, batch_size=4, shuffle=True))


def hf_split_by_node(accelerator):
    """split_dataset_by_node on a map-style datasets.Dataset: each rank its own contiguous
    rows, a plain DataLoader (the positions 0.. are not the same samples on every rank)."""
    from datasets.distributed import split_dataset_by_node

    part = split_dataset_by_node(hf_ids(), rank=accelerator.process_index,
                                 world_size=accelerator.num_processes)
    return DataLoader(part, batch_size=4, shuffle=True)


def tensor_sliced_by_rank(accelerator):
    """A TensorDataset built per rank from its slice of the ids (ids r, r + W, ...), a plain
    shuffled DataLoader: each rank's position i is another sample. Batches are [ids, x]."""
    ids = torch.arange(accelerator.process_index, 40, accelerator.num_processes)
    return DataLoader(TensorDataset(ids, ids * 2.0), batch_size=4, shuffle=True)


def tensor_unseeded_prepared(accelerator):
    """torch.randn with no seed on each rank, then a prepared (sharded) loader: every rank
    shards its own, different data."""
    return accelerator.prepare(DataLoader(TensorDataset(torch.randn(40, 3)), batch_size=4,
                                          shuffle=True))


class BatchFetched(torch.utils.data.Dataset):
    """A dataset that fetches a whole batch per call: dataset[[i, j, ...]] -> tensor of ids."""

    def __len__(self):
        return 40

    def __getitem__(self, indices):
        return torch.tensor(indices)


def batch_fetched(accelerator):
    """A BatchSampler over a DistributedSampler (seed 0) given as the loader's `sampler`, with
    batch_size=None: one __getitem__ per batch, with a list of indices."""
    from torch.utils.data import BatchSampler

    dataset = BatchFetched()
    sampler = DistributedSampler(dataset, num_replicas=accelerator.num_processes,
                                 rank=accelerator.process_index, seed=0)
    return DataLoader(dataset, sampler=BatchSampler(sampler, 4, False), batch_size=None)


def unshuffled_distributed_11(accelerator):
    """torch's DistributedSampler with shuffle=False over 11 samples: the ranks' share is padded
    with sample 0, so the last rank's ids wrap back to 0, and the order is the same every epoch
    by design."""
    dataset = _dataset(11)
    sampler = DistributedSampler(dataset, num_replicas=accelerator.num_processes,
                                 rank=accelerator.process_index, shuffle=False)
    return DataLoader(dataset, batch_size=2, sampler=sampler)


class Buckets(torch.utils.data.Sampler):
    """A bucketing batch sampler of the user's: each epoch a new permutation (seeded with
    seed + epoch, set by its own set_epoch), grouped into batches of 4 by id % 3."""

    def __init__(self, n, batch_size=4, seed=0):
        self.n, self.batch_size, self.seed, self.epoch = n, batch_size, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        batches = []
        for r in range(3):
            ids = [i for i in order.tolist() if i % 3 == r]
            batches += [ids[k:k + self.batch_size] for k in range(0, len(ids), self.batch_size)]
        return iter(batches)

    def __len__(self):
        return sum(-(-len(range(r, self.n, 3)) // self.batch_size) for r in range(3))


def bucketing_prepared_31(accelerator):
    """Buckets over 31 samples as the loader's batch_sampler, passed through prepare."""
    return accelerator.prepare(DataLoader(_dataset(31), batch_sampler=Buckets(31)))


# -- samples named by keys (str), not positions ---------------------------------------------

KEYED = 22  # 22 samples named "s-000".."s-021" ("s-007" is sample 7)


class Keyed(torch.utils.data.Dataset):
    """Samples {"key": "s-007", "x": 7.0}: the DataLoader's collate makes "key" a list of str."""

    def __len__(self):
        return KEYED

    def __getitem__(self, i):
        return {"key": f"s-{i:03d}", "x": float(i)}


def keyed_prepared(accelerator):
    """A map-style dataset named by keys, prepared (shuffled, seeded as set_seed(7) does),
    batches of 4."""
    torch.manual_seed(7)
    return accelerator.prepare(DataLoader(Keyed(), batch_size=4, shuffle=True))


def keyed_replicated(accelerator):
    """The same, neither prepared nor sampled: every rank reads every key."""
    return DataLoader(Keyed(), batch_size=4, shuffle=False)


class KeyedStream(IterableDataset):
    """A stream of keyed samples split by rank (every W-th), with no length: bytes keys, and
    the key "s-021" never sent (a shard that went missing)."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def __iter__(self):
        for i in range(self.rank, KEYED - 1, self.world):
            yield {"key": f"s-{i:03d}".encode(), "x": float(i)}


def keyed_stream(accelerator):
    return DataLoader(KeyedStream(accelerator.process_index, accelerator.num_processes),
                      batch_size=3)


def hf_question_ids(accelerator):
    """A datasets.Dataset whose samples are named by a string column ("q0000".."q0021"),
    torch format (the string column stays a list of str), prepared and shuffled."""
    from datasets import Dataset

    ds = Dataset.from_dict({"qid": [f"q{i:04d}" for i in range(KEYED)],
                            "x": [float(i) for i in range(KEYED)]}).with_format("torch")
    torch.manual_seed(3)
    return accelerator.prepare(DataLoader(ds, batch_size=4, shuffle=True))


def keyed_sampled_workers(accelerator):
    """Keyed samples through an explicit DistributedSampler (shuffled, seed 5), 2 DataLoader
    workers, batches of 4, not prepared: the count path over keys with workers."""
    sampler = DistributedSampler(Keyed(), num_replicas=accelerator.num_processes,
                                 rank=accelerator.process_index, shuffle=True, seed=5)
    return DataLoader(Keyed(), batch_size=4, sampler=sampler, num_workers=2)


def hf_question_ids_drop_last(accelerator):
    """The string id column again, prepared with drop_last=True: the last short round is
    dropped, so some questions are never seen; no file of keys names them, the column does."""
    from datasets import Dataset

    ds = Dataset.from_dict({"qid": [f"q{i:04d}" for i in range(KEYED)],
                            "x": [float(i) for i in range(KEYED)]}).with_format("torch")
    torch.manual_seed(3)
    return accelerator.prepare(DataLoader(ds, batch_size=4, shuffle=True, drop_last=True))


class Slow(torch.utils.data.Dataset):
    """Every fetch sleeps `pause` seconds: a loader slower than the watchdog's bound in all,
    never in one step."""

    def __init__(self, pause, n=N):
        self.pause, self.n = pause, n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        import time

        time.sleep(self.pause)
        return torch.tensor(index)


def slow_batches(accelerator):
    """60 samples, batches of 2, a DistributedSampler on 2 ranks: 15 batches a rank, each
    0.8 s (2 fetches of 0.4 s), so an epoch walks for 12 s on every rank."""
    dataset = Slow(0.4)
    sampler = DistributedSampler(dataset, num_replicas=accelerator.num_processes,
                                 rank=accelerator.process_index, shuffle=False)
    return DataLoader(dataset, batch_size=2, sampler=sampler)


def dispatch_empty_epoch(accelerator):
    """The reported loader: accelerate's dispatcher (dispatch_batches=True), 8 samples, batch 6,
    drop_last: fewer samples than one global batch (8 < W x 6)."""
    from accelerate.data_loader import prepare_data_loader

    return prepare_data_loader(
        DataLoader(TensorDataset(torch.arange(8)), batch_size=6, drop_last=True),
        device=accelerator.device, num_processes=accelerator.num_processes,
        process_index=accelerator.process_index, dispatch_batches=True, put_on_device=True)


class OneWideSample(torch.utils.data.Dataset):
    """Sample i is tensor([i]), but at the `bad`-th fetch on the ranks in `ranks` it is two
    wide: torch's default_collate then cannot stack that batch (inside torch). 6 samples,
    batch 2, not shuffled, on every rank (replicated): the 9th fetch is epoch 1's step 1."""

    def __init__(self, rank, ranks, bad=9, n=6):
        self.bad, self.n, self.fetched = (bad if rank in ranks else None), n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        self.fetched += 1
        return torch.tensor([index, index] if self.fetched == self.bad else [index])


def collate_fails_everywhere(accelerator):
    return DataLoader(OneWideSample(accelerator.process_index, range(8)), batch_size=2)


def collate_fails_on_rank_1(accelerator):
    return DataLoader(OneWideSample(accelerator.process_index, (1,)), batch_size=2)


# The resume chains (tests/ranks/test_resume_chain.py): N = 80, batch 4.
def seeded_80(accelerator):
    """seeded_40 with 80 samples: every launch draws the same permutation."""
    from accelerate.utils import set_seed

    set_seed(0)
    return accelerator.prepare(DataLoader(TensorDataset(torch.arange(80)), batch_size=4,
                                          shuffle=True))


class Logged(TensorDataset):
    """Ids 0..79 that write every id they are asked for, in order, to one file per launch and
    rank in $SHARDDEMO_TEST_LOG_DIR: `<start ns>-<launch>-<rank>.log` (the launch: a number
    from its status folder, which sharddemo makes anew for each launch and gives every rank of
    it). The test reads them back beside the report."""

    def __init__(self, rank: int):
        import os
        import time
        import zlib

        super().__init__(torch.arange(80))
        launch = zlib.crc32(os.environ["SHARDDEMO_STATUS_DIR"].encode())
        self.path = os.path.join(os.environ["SHARDDEMO_TEST_LOG_DIR"],
                                 f"{time.time_ns()}-{launch}-{rank}.log")

    def __getitem__(self, index):
        with open(self.path, "a") as handle:
            handle.write(f"{int(index)}\n")
        return super().__getitem__(index)


def unseeded_logged_80(accelerator):
    """A prepared shuffled loader of 80, no seed (each launch draws its own permutation), that
    logs the ids it is asked for (Logged)."""
    return accelerator.prepare(DataLoader(Logged(accelerator.process_index), batch_size=4,
                                          shuffle=True))


def hf_stream_state_40(accelerator, rank=None, world=None):
    """A datasets stream of ids 0..39 (4 shards) split by node, read by torchdata's
    StatefulDataLoader (batch 4), not prepared: the loader keeps its own state (what
    `--resume-strategy stateful` saves). `rank`, `world`: for a test building it in one
    process."""
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    rank = accelerator.process_index if rank is None else rank
    world = accelerator.num_processes if world is None else world
    ds = Dataset.from_dict({"id": list(range(40))}).to_iterable_dataset(num_shards=4)
    ds = split_dataset_by_node(ds, rank, world).with_format("torch")
    return StatefulDataLoader(ds, batch_size=4)
