"""Layer 1: each mode's loader for ranks 0..W-1 in one process, against torch's
DistributedSampler and accelerate's BatchSamplerShard, and against literal index lists."""

from __future__ import annotations

import math

import pytest
from accelerate.data_loader import BatchSamplerShard
from support.sim import SimAccelerator, walk
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from sharddemo.rank.sources import ToyDataset
from sharddemo.rank.loaders import build_mode_loader
from sharddemo.options import RunOptions

# (N, B, W): divisible by W*B, not divisible, N < W, B > N/W, and W = 3.
GRID = [(8, 4, 2), (10, 3, 2), (9, 4, 2), (1, 4, 2), (2, 4, 3), (6, 4, 2), (10, 2, 3), (7, 3, 3)]


def per_rank(mode: str, n: int, b: int, w: int, epochs: int = 2, **opts) -> list:
    options = RunOptions(dataset_size=n, batch_size=b, epochs=epochs, **opts)
    return [walk(build_mode_loader(mode, SimAccelerator(w, r), ToyDataset(n), options), epochs)
            for r in range(w)]


def chunks(ids: list[int], b: int) -> list[list[int]]:
    return [ids[i:i + b] for i in range(0, len(ids), b)]


@pytest.mark.parametrize("n,b,w", GRID)
@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_mode_is_torchs_distributed_sampler(n, b, w, shuffle):
    got = per_rank("sampler", n, b, w, shuffle=shuffle, seed=7)
    for r in range(w):
        reference = DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=shuffle, seed=7)
        for epoch in range(2):
            reference.set_epoch(epoch)
            assert got[r][epoch] == chunks(list(reference), b), f"rank {r} epoch {epoch}"


@pytest.mark.parametrize("n,b,w", GRID)
def test_prepared_mode_is_accelerates_batch_sampler_shard(n, b, w):
    got = per_rank("prepared", n, b, w, shuffle=False)
    for r in range(w):
        shard = BatchSamplerShard(BatchSampler(SequentialSampler(range(n)), b, False),
                                  num_processes=w, process_index=r, even_batches=True)
        assert got[r][0] == list(shard), f"rank {r}"
        # every rank gets ceil(K/W) batches (K = ceil(N/B) global batches)
        assert len(got[r][0]) == math.ceil(math.ceil(n / b) / w)


def test_prepared_literal_two_ranks_n10_b3():
    # accelerate 1.16, checked on real ranks: round-robin batches, the short last round filled from the epoch's start.
    got = per_rank("prepared", 10, 3, 2, epochs=1, shuffle=False)
    assert got[0][0] == [[0, 1, 2], [6, 7, 8]]
    assert got[1][0] == [[3, 4, 5], [9, 0, 1]]


def test_sampler_literal_four_ranks_n10():
    # torch DistributedSampler: rank r takes indices r::4 of the order padded with its first two indices.
    got = per_rank("sampler", 10, 3, 4, epochs=1, shuffle=False)
    assert [sum(e[0], []) for e in got] == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]


def test_sampler_n_below_world_tiles_the_dataset():
    # N=2 < W=3: num_samples = 1 per rank, the order tiled.
    got = per_rank("sampler", 2, 4, 3, epochs=1, shuffle=False)
    assert [e[0] for e in got] == [[[0]], [[1]], [[0]]]


@pytest.mark.parametrize("n,b,w", GRID)
def test_replicated_mode_gives_every_rank_everything(n, b, w):
    got = per_rank("replicated", n, b, w)
    for r in range(w):
        for epoch in range(2):
            assert sorted(sum(got[r][epoch], [])) == list(range(n))
    assert got[0] == got[-1], "same seed on every rank: the same order"


def test_sampler_set_epoch_changes_the_order_and_no_set_epoch_does_not():
    moved = per_rank("sampler", 64, 8, 2)
    assert moved[0][0] != moved[0][1]
    frozen = per_rank("sampler", 64, 8, 2, set_epoch=False)
    assert frozen[0][0] == frozen[0][1]


def test_prepared_shuffled_shards_cover_the_dataset_once():
    got = per_rank("prepared", 16, 4, 2)
    for epoch in range(2):
        seen = sum(got[0][epoch], []) + sum(got[1][epoch], [])
        assert sorted(seen) == list(range(16))
    assert got[0][0] != got[0][1], "accelerate sets the epoch itself: a new order each epoch"


def _made_by(samples):
    """A collate that returns, per sample, the worker torch says is making the batch (-1: the
    main process, where get_worker_info() is None)."""
    import torch
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return torch.full((len(samples),), info.id if info is not None else -1)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("prepared", [False, True])
def test_the_walk_knows_the_worker_without_a_tag_only_where_torch_has_no_workers(workers,
                                                                                 prepared):
    """With num_workers=0 the walk takes every batch as made by the main process and tags
    nothing (no tag to pay for); with workers it cannot know, and tags. What made each batch
    is what torch's own get_worker_info() says inside the loader."""
    import torch
    from accelerate.data_loader import prepare_data_loader
    from support.oracle import ensure_accelerator_state
    from torch.utils.data import DataLoader

    from sharddemo.rank.tagging import known_worker, tag_batches

    def build():
        loader = DataLoader(range(8), batch_size=2, num_workers=workers, collate_fn=_made_by)
        if prepared:
            ensure_accelerator_state()
            loader = prepare_data_loader(loader, num_processes=2, process_index=0,
                                         put_on_device=False)
        return loader

    made = {int(i) for batch in build() for i in batch}
    loader = build()
    if made == {-1}:
        assert known_worker(loader) == -1
        assert tag_batches(loader, record_indices=False) is False  # left as it is
        assert all(torch.is_tensor(b) for b in loader)  # no tag around the batches
    else:
        assert made == {0, 1} and known_worker(loader) is None
        assert tag_batches(loader, record_indices=False) is True
    assert known_worker([[0, 1], [2, 3]]) is None  # not a DataLoader: its tags say, if any


def test_index_domain_reads_what_the_loaders_own_objects_can_deal():
    """rank.describe.index_domain against torch's objects: the distinct ids a Subset chain or a
    SubsetRandomSampler leaves, and the draw of a sampler that does not deal each id once,
    read from each loader as built and as accelerate's prepare_data_loader rebuilds it."""
    import torch
    from accelerate.data_loader import prepare_data_loader
    from support.oracle import ACCELERATOR_RNG_TYPES, ensure_accelerator_state
    from torch.utils.data import (DataLoader, RandomSampler, Subset, SubsetRandomSampler,
                                  TensorDataset, WeightedRandomSampler, random_split)

    from sharddemo.rank.describe import index_domain

    data = TensorDataset(torch.arange(30))
    train, _ = random_split(data, [21, 9], generator=torch.Generator().manual_seed(1))
    nested = Subset(train, list(range(0, 21, 3)))  # 7 of the 21
    picked = SubsetRandomSampler([4, 9, 12, 20])
    weighted = WeightedRandomSampler(torch.ones(30), 30)
    fewer = RandomSampler(data, num_samples=12)
    repeated = SubsetRandomSampler([5, 5, 7, 11])
    twice = Subset(data, [2, 3, 3, 8, 8, 9])
    cases = [
        (DataLoader(data, batch_size=4, shuffle=True), None, None),
        (DataLoader(train, batch_size=4, shuffle=True), len(set(train.indices)), None),
        (DataLoader(nested, batch_size=4),
         len({train.indices[i] for i in nested.indices}), None),
        (DataLoader(data, batch_size=4, sampler=picked), len(set(picked.indices)), None),
        (DataLoader(data, batch_size=4, sampler=weighted), None,
         {"sampler": "WeightedRandomSampler", "replacement": weighted.replacement,
          "count": weighted.num_samples}),
        (DataLoader(data, batch_size=4, sampler=fewer), None,
         {"sampler": "RandomSampler", "replacement": False, "count": fewer.num_samples}),
        (DataLoader(data, batch_size=4,
                    sampler=DistributedSampler(data, num_replicas=2, rank=0)), None, None),
        # a DistributedSampler over a Subset shards the part: the part is still its domain
        (DataLoader(train, batch_size=4,
                    sampler=DistributedSampler(train, num_replicas=2, rank=1)),
         len(set(train.indices)), None),
        # indices that name a sample twice: 4 indices dealt, 3 distinct samples
        (DataLoader(data, batch_size=4, sampler=repeated), len(set(repeated.indices)),
         {"sampler": "SubsetRandomSampler", "replacement": False,
          "count": len(repeated.indices), "repeated_indices": True}),
        (DataLoader(twice, batch_size=4, shuffle=True), len(set(twice.indices)),
         {"sampler": "RandomSampler", "replacement": False, "count": len(twice.indices),
          "repeated_indices": True}),
    ]
    ensure_accelerator_state()
    for loader, domain, draws in cases:
        for built in (loader, prepare_data_loader(loader, num_processes=2, process_index=1,
                                                  put_on_device=False,
                                                  rng_types=list(ACCELERATOR_RNG_TYPES))):
            got = index_domain(built)
            assert got["domain"] == domain, (loader, built)
            if draws is None:
                assert got["draws"] is None, (loader, built)
            else:  # accelerate may put its SeedableRandomSampler in the RandomSampler's place
                assert {k: v for k, v in got["draws"].items() if k != "sampler"} == \
                    {k: v for k, v in draws.items() if k != "sampler"}


def test_shuffled_is_what_the_loaders_own_sampler_says():
    """rank.describe.describe_loader's `shuffled`, for loaders built here with a known sampler (the
    expected values are how each was built), as built and as accelerate's prepare_data_loader
    rebuilds it (it keeps a SequentialSampler, puts a SeedableRandomSampler, a RandomSampler,
    in a RandomSampler's place, and keeps any other sampler)."""
    import torch
    from accelerate.data_loader import prepare_data_loader
    from support.oracle import ACCELERATOR_RNG_TYPES, ensure_accelerator_state
    from torch.utils.data import (DataLoader, IterableDataset, Sampler, SubsetRandomSampler,
                                  TensorDataset, WeightedRandomSampler)

    from sharddemo.rank.describe import describe_loader

    class EveryOther(Sampler):  # a sampler of the user's: it says nothing of shuffling
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(0, self.n, 2))

        def __len__(self):
            return (self.n + 1) // 2

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(12))

    data = TensorDataset(torch.arange(12))
    cases = [
        (DataLoader(data, batch_size=4), False),  # torch puts a SequentialSampler there
        (DataLoader(data, batch_size=4, shuffle=True), True),
        (DataLoader(data, batch_size=4,
                    sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)),
         False),
        (DataLoader(data, batch_size=4,
                    sampler=DistributedSampler(data, num_replicas=2, rank=1, shuffle=True)),
         True),
        (DataLoader(data, batch_size=4, sampler=SubsetRandomSampler([1, 4, 7])), True),
        (DataLoader(data, batch_size=4, sampler=WeightedRandomSampler(torch.ones(12), 12)),
         True),
        (DataLoader(data, batch_size=4, sampler=EveryOther(12)), None),
        (DataLoader(Stream(), batch_size=4), None),
    ]
    ensure_accelerator_state()
    for loader, shuffled in cases:
        for built in (loader, prepare_data_loader(loader, num_processes=2, process_index=0,
                                                  put_on_device=False,
                                                  rng_types=list(ACCELERATOR_RNG_TYPES))):
            assert describe_loader(built)["shuffled"] is shuffled, (loader, built)


def test_rows_digest_reads_rows_as_stored_and_nothing_of_the_users():
    """Ranks compare these to tell whether position i is the same sample everywhere."""
    import numpy as np
    import torch
    from datasets import Dataset as HFDataset
    from torch.utils.data import Dataset, TensorDataset

    from sharddemo.rank.describe import rows_digest

    ids = torch.arange(40)
    same = rows_digest(TensorDataset(ids, ids * 2.0))
    assert same == rows_digest(TensorDataset(ids.clone(), ids * 2.0))  # equal content
    assert same != rows_digest(TensorDataset(ids[0::2], ids[0::2] * 2.0))  # rank 0's slice
    assert rows_digest(TensorDataset(ids[0::2])) != rows_digest(TensorDataset(ids[1::2]))
    # only the first, middle and last rows are read: a change elsewhere is not seen
    changed = ids.clone()
    changed[7] = -1
    assert rows_digest(TensorDataset(changed)) == rows_digest(TensorDataset(ids))
    changed[20] = -1  # the middle row of 40
    assert rows_digest(TensorDataset(changed)) != rows_digest(TensorDataset(ids))
    assert rows_digest(torch.zeros(4, 2, dtype=torch.bfloat16)) is not None  # no numpy dtype
    assert rows_digest(np.arange(10)) == rows_digest(np.arange(10)) != rows_digest(np.arange(1, 11))
    assert rows_digest(list(range(10))) == rows_digest(range(10)) != rows_digest(range(1, 11))
    assert rows_digest([(1, "a"), (2, "b")]) is not None
    hf = HFDataset.from_dict({"id": list(range(10))})
    assert rows_digest(hf) == rows_digest(HFDataset.from_dict({"id": list(range(10))}))
    assert rows_digest(hf.shard(2, 0)) != rows_digest(hf.shard(2, 1))

    class Touchy:  # its repr is the user's code: never called
        def __repr__(self):
            raise AssertionError("repr called")

    class Mine(Dataset):  # reading a row would run the user's __getitem__
        def __len__(self):
            return 3

        def __getitem__(self, i):
            raise AssertionError("__getitem__ called")

    assert rows_digest([Touchy()] * 3) is None and rows_digest(Mine()) is None
    assert rows_digest(np.array([Touchy()] * 3, dtype=object)) is None  # bytes are pointers
    assert rows_digest(hf.select([3, 1])) is None  # a view: its rows go through a mapping


def test_set_epoch_reaches_a_distributed_sampler_inside_a_batch_sampler():
    """audit --set-epoch does what the training loop does: where neither the loader nor its
    `sampler` has set_epoch, the DistributedSampler inside a batch_sampler (or inside a
    BatchSampler passed as `sampler` with batch_size=None) gets it."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader

    from sharddemo.rank.audit import set_epoch

    data = list(range(20))
    for make in (lambda s: DataLoader(data, batch_sampler=BatchSampler(s, 4, False)),
                 lambda s: DataLoader(data, sampler=BatchSampler(s, 4, False), batch_size=None),
                 lambda s: DataLoader(data, sampler=s, batch_size=4)):
        inner = DistributedSampler(data, num_replicas=2, rank=0, seed=0)
        set_epoch(make(inner), 3)
        assert inner.epoch == 3
    del torch


def test_tags_of_a_loader_without_auto_collation_are_its_samplers_indices():
    """batch_size=None: one fetch per sampler item, a single index (each batch one sample) or a
    list of them (a BatchSampler as `sampler`). The recorded indices are what torch's sampler
    yields, item by item."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, TensorDataset

    from support.factories import BatchFetched
    from sharddemo.rank.tagging import tag_batches, unwrap

    single = TensorDataset(torch.arange(12), torch.zeros(12, 3))
    for dataset, wrap in ((single, lambda s: s), (BatchFetched(), lambda s: BatchSampler(s, 4,
                                                                                       False))):
        loader = DataLoader(dataset, sampler=wrap(DistributedSampler(dataset, 2, 1, seed=0)),
                            batch_size=None)
        assert tag_batches(loader, record_indices=True)
        got = [unwrap(batch)[1]["index"].tolist() for batch in loader]
        expected = wrap(DistributedSampler(dataset, 2, 1, seed=0))
        assert got == [list(item) if isinstance(item, list) else [item] for item in expected]


def test_index_domain_reads_the_draw_lightning_wraps_for_ddp():
    """Lightning puts a custom sampler (a WeightedRandomSampler, for imbalanced classes) under
    its DistributedSamplerWrapper in DDP: the draw is the wrapped sampler's, sharded over the
    ranks, and a Subset under it still narrows the ids."""
    distributed = pytest.importorskip("lightning.fabric.utilities.distributed")
    import torch
    from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler, random_split

    from sharddemo.rank.describe import index_domain

    train, _ = random_split(TensorDataset(torch.arange(30)), [22, 8],
                            generator=torch.Generator().manual_seed(0))
    weighted = WeightedRandomSampler(torch.ones(22), 22)
    wrapper = distributed.DistributedSamplerWrapper(weighted, num_replicas=2, rank=1)
    got = index_domain(DataLoader(train, batch_size=2, sampler=wrapper))
    assert got["draws"] == {"sampler": "WeightedRandomSampler",
                            "replacement": weighted.replacement, "count": weighted.num_samples}
    assert got["domain"] == len(set(train.indices))


def test_an_id_field_of_fractions_is_refused_in_one_line_and_strings_are_keys():
    """--id-field names integer ids or keys: a column of question ids (strings, as many
    datasets have) becomes this rank's key table (rank.keys: the keys in the order first
    seen), while fractions or objects are a usage error, the same words on every rank, not a
    crash inside the walk (it was "epoch 0 of the loader raised ValueError: too many
    dimensions 'str'")."""
    import torch
    from torch.utils.data import DataLoader

    from sharddemo.rank.audit import id_reader
    from sharddemo.errors import UsageError

    read = id_reader(DataLoader(range(4)), "id")
    assert read({"id": ["q0002", "q0001"]}, None).tolist() == [0, 1]
    assert read({"id": ["q0001", "q0009"]}, None).tolist() == [1, 2]
    assert read.keys.keys == ["q0002", "q0001", "q0009"]
    with pytest.raises(UsageError, match=r"an integer 0..N-1 or a key .*\(it holds object"):
        read({"id": [object(), object()]}, None)
    with pytest.raises(UsageError, match=r"\(it holds torch.float32 values that are not whole"):
        read({"id": torch.tensor([0.5, 1.0])}, None)
    assert read({"id": torch.tensor([3.0, 1.0])}, None).tolist() == [3, 1]
    assert read({"id": [7, 2]}, None).tolist() == [7, 2]


def test_a_batch_sampler_of_the_users_is_no_draw_and_its_batch_size_is_read_where_sharded():
    """A batch_sampler of the user's deals whole batches: its length (9 batches of 31 samples)
    is no draw of 9 samples, and its order says nothing of shuffling. Through accelerate's
    prepare_data_loader its BatchSamplerShard takes the batch_size (4) it reads from it (the
    size a round's last batch must have); torch's own BatchSampler there is not flagged."""
    from accelerate.data_loader import prepare_data_loader
    from support.factories import Buckets, _dataset
    from support.oracle import ACCELERATOR_RNG_TYPES, ensure_accelerator_state
    from torch.utils.data import DataLoader, RandomSampler

    from sharddemo.rank.describe import describe_loader

    ensure_accelerator_state()

    def prepared(loader):
        return prepare_data_loader(loader, num_processes=2, process_index=0, put_on_device=False,
                                   rng_types=list(ACCELERATOR_RNG_TYPES))

    built = DataLoader(_dataset(31), batch_sampler=Buckets(31))
    assert len(built.batch_sampler) == 9  # batches, not samples
    for loader in (built, prepared(built)):
        info = describe_loader(loader)
        assert info["draws"] is None and info["domain"] is None and info["shuffled"] is None
    assert "shard_batch_size" not in describe_loader(built)
    info = describe_loader(prepared(DataLoader(_dataset(31), batch_sampler=Buckets(31))))
    assert (info["shard_batch_size"], info["batch_sampler_class"]) == (4, "Buckets")
    plain = DataLoader(_dataset(31), batch_sampler=BatchSampler(RandomSampler(range(31)), 4,
                                                                  False))
    assert "shard_batch_size" not in describe_loader(prepared(plain))


def test_a_loader_whose_len_raises_value_error_has_no_length(fresh_accelerate_state):
    """accelerate's own skip_first_batches past the epoch's end: 8 samples in batches of 4 are
    2 batches, and skipping 5 leaves a loader whose len() raises ValueError (a negative
    length); the description treats it as a loader without a length, as it does an
    IterableDataset's, instead of raising."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from sharddemo.rank.describe import safe_len

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(8)), batch_size=4))
    skipped = accelerator.skip_first_batches(loader, 5)
    with pytest.raises(ValueError):
        len(skipped)
    assert safe_len(skipped) is None and safe_len(loader) == 2
