"""Why samples repeat or go missing: the reason codes, their words, and their finders.

The functions here find a reason in an epoch view (analysis.views) and the loader's description
(rank.describe.describe_loader).

A reason is named only where the mechanism that causes it is really in the loader (a
DistributedSampler pads, accelerate's BatchSamplerShard fills, IterableDatasetShard loops
around, drop_last drops), and found in the records: which id repeats, where, on which rank.
"""

from __future__ import annotations

from typing import Optional, cast

from sharddemo.analysis.modes import REPLICATED
from sharddemo.analysis.views import EpochView
from sharddemo.record import loader_share
from sharddemo.analysis.types import Draws, LoaderDescription

# A few words for each reason code, for the one-sentence conclusion.
REASON_LABEL = {
    "sampler-padding": "DistributedSampler padding",
    "even-batches-fill": "accelerate's even_batches loop-around",
    "shard-fill": "IterableDatasetShard's loop-around",
    "replication": "replication",
    "worker-replication": "every DataLoader worker yielded the same stream",
    "stream-replication": "every rank read the same unsplit stream",
    "double-split": "the loader was split twice",
    "ranks-disagree": "the ranks dealt from different orders",
    "drop-last": "drop_last",
    "subset": "the loader reads a subset",
    "sampler-draws": "the sampler's own draw",
    "short-rounds": "accelerate drops rounds that end in a short batch",
    "ray-equal-split": "ray's streaming_split(equal=True) drops up to world_size - 1 rows so "
                       "that every worker gets the same number",
    "unexplained": "no known reason",
}


REASON_SENTENCE = {
    "sampler-padding": "DistributedSampler padding: every rank gets ceil(N/W) samples, so the "
                       "sampler repeats the first indices of the epoch's order",
    "even-batches-fill": "accelerate even_batches loop-around: the last round of batches is "
                         "filled from the start of the epoch so every rank gets as many batches; "
                         "gather_for_metrics is meant to drop them (whether it did: the report's "
                         "gather_for_metrics count)",
    "shard-fill": "IterableDatasetShard: the last global batch is filled from the start of the "
                  "stream (with DataLoader workers, each worker's own copy fills its own last "
                  "global batch from the start of its share of the stream: one fill per worker)",
    "replication": "replication: the loader is not sharded, so every rank walks the same samples",
    "worker-replication": "worker replication: the IterableDataset ignores "
                          "torch.utils.data.get_worker_info(), so each of a rank's DataLoader "
                          "workers yields the whole stream (split it by worker id)",
    "stream-replication": "stream replication: every rank reads the same stream, which nothing "
                          "splits by rank (split_dataset_by_node, IterableDatasetShard, "
                          "dispatch_batches, or WebDataset's nodesplitter=wds.split_by_node)",
    "double-split": "double split: a loader that already has a DistributedSampler was sharded "
                    "again by accelerator.prepare, so each rank's half is dealt round-robin "
                    "across the ranks once more",
    "ranks-disagree": "the ranks dealt from different orders: each rank's slice is clean, but "
                      "the slices overlap and leave holes (no common seed: use_seedable_sampler "
                      "without set_seed, or a permutation drawn before the ranks synchronise "
                      "their RNG, as a prepared stateful loader with workers does, accelerate "
                      "issue 4204; or data split differently on each rank, as a random_split "
                      "without a seeded generator is)",
    "unexplained": "not explained by the loader's own padding",
}


# Missing samples the loader's own objects leave out by design: not a broken promise when the
# reason accounts for all of them (missing_explained).
BY_DESIGN_MISSING = ("drop-last", "subset", "sampler-draws", "ray-equal-split")


def missing_ok(e: dict) -> bool:
    """No sample missing, or only those the loader leaves out by design."""
    return not e["missing_count"] or (e["missing_reason"] in BY_DESIGN_MISSING
                                      and e["missing_explained"])


def draws_repeat(loader: LoaderDescription, n: int) -> bool:
    """Say whether the sampler itself deals some ids more than once.

    It does with replacement, or with more draws than ids to draw from."""
    draws = loader.get("draws")
    if not draws:
        return False
    return draws["replacement"] or (draws["count"] or 0) > (loader.get("domain") or n)


def by_design_sentence(code: str, loader: LoaderDescription, n: int, missing: int,
                       explained: bool = True) -> str:
    """Return the sentence for the subset and sampler-draws reasons, with this loader's numbers.

    Where they do not account for every missing sample (`explained` False), it says so."""
    # Called for these two reasons only: the loader says how it draws, or from what domain.
    draws, domain = cast(Draws, loader.get("draws")), cast(int, loader.get("domain"))
    share = loader_share(loader, n)
    if code == "subset":
        text = (f"subset: the loader deals from {domain} of the {n} samples (a torch Subset, "
                "as random_split makes, a SubsetRandomSampler, or a view of a datasets.Dataset "
                f"such as train_test_split, select or filter make); the other {n - domain} "
                "are not its data")
    elif draws.get("cycle"):
        return (f"the stream cycles its data ({draws['sampler']}): each pass takes that many "
                "samples a rank where the last one stopped, wrapping around, so a pass holds a "
                "window of the data, some samples twice or none, by design")
    elif draws["replacement"] and draws["count"] is None:
        return (f"the stream draws its shards with replacement ({draws['sampler']}): some "
                "samples come several times and some never, by design (for each sample once "
                "an epoch, split the shards instead: nodesplitter=wds.split_by_node)")
    elif draws["replacement"]:
        return (f"the sampler draws with replacement ({draws['sampler']}, {draws['count']} "
                "draws an epoch): some samples come several times and some never, by design")
    elif draws.get("repeated_indices"):
        text = (f"the sampler deals {draws['count']} indices an epoch that name {domain} "
                f"distinct samples ({draws['sampler']}: its indices, or its Subset's, repeat "
                "some samples), by design")
    else:
        text = (f"the sampler draws {draws['count']} of {domain or n} samples an epoch "
                f"({draws['sampler']}, num_samples={draws['count']})")
    if not explained:
        return text + (f"; but {missing - (n - share)} of the {share} it deals never came: "
                       "NOT explained")
    return text + (", and drop_last drops the rest" if missing > n - share else "")


def not_its_data(e: dict, loader: Optional[LoaderDescription], n: int) -> int:
    """Count the epoch's missing samples that the loader could never deal.

    Counted where something else lost the rest (a double split, or no known reason): the part of
    the n a Subset leaves out. 0 where the loader deals all n, or the missing are explained by
    its part."""
    if not loader or e["missing_reason"] not in ("double-split", "subset") or (
            e["missing_reason"] == "subset" and e["missing_explained"]):
        return 0
    outside = n - loader_share(loader, n)
    return outside if 0 < outside < e["missing_count"] else 0


def reason_sentence(code: str, loader: LoaderDescription, n: int, missing: int = 0,
                    explained: bool = True) -> str:
    """Return the sentence for a reason code, with this loader's numbers.

    REASON_SENTENCE, with the numbers where the reason has them (drop_last's `missing`, a
    subset's or a draw's sizes)."""
    if code == "short-rounds":
        return ("short rounds: accelerate's BatchSamplerShard deals a round of batches only "
                f"when the round's last batch holds batch_size ({loader['shard_batch_size']}) "
                "samples, the size it reads from your batch sampler "
                f"({loader.get('batch_sampler_class')}), so every round that ends in a shorter "
                "batch is dropped whole, mid-epoch. A batch sampler whose batches vary in size "
                "must not have a batch_size attribute (accelerate then takes its batches as they "
                "come), or every batch must be full")
    share = loader_share(loader, n)
    if code == "double-split" and missing and share < n:
        return (REASON_SENTENCE[code] + f"; {missing - (n - share)} of the {share} samples it "
                f"deals were lost that way, and the other {n - share} of the {n} are not its "
                "data (it reads a subset)")
    if code == "drop-last":
        return (f"drop_last: {missing} sample(s) did not make a complete batch (or round of "
                "batches) and were dropped")
    if code in ("subset", "sampler-draws"):
        return by_design_sentence(code, loader, n, missing, explained)
    if code == "ray-equal-split":
        return ray_split_sentence(loader, missing, explained)
    if code == "unexplained" and not loader_pads(loader):
        return "not explained: the loader does not pad"
    ray = loader.get("ray_data") or {}
    if code == "replication" and ray.get("split") == "none":
        return ("replication: Ray hands this dataset whole to every worker (a dataset left out "
                "of DataConfig(datasets_to_split=...) is read with ds.iterator() on each), so "
                "every worker walks the same rows; name it in datasets_to_split to split it")
    return REASON_SENTENCE[code]


def ray_split_sentence(loader: LoaderDescription, missing: int, explained: bool) -> str:
    """Return the sentence for Ray Data's equal split.

    Dataset.streaming_split(W, equal=True), as Ray Train's DataConfig splits each dataset: every
    worker gets the same number of rows, and up to W - 1 rows of the epoch reach no worker (ray
    issue 63285)."""
    ray = loader["ray_data"]
    world = ray["world_size"]
    text = (f"ray's streaming_split(equal=True) drops up to world_size - 1 rows so that every "
            f"worker gets the same number ({world} workers: up to {world - 1})")
    if loader.get("drop_last"):
        text += ", and iter_torch_batches(drop_last=True) drops each worker's short last batch"
    if not explained:
        text += f"; but {missing} rows never came: more than that explains, NOT explained"
    return text


def ray_split_slack(loader: LoaderDescription, global_size: int) -> Optional[int]:
    """Return how many rows Ray's equal split may leave out of an epoch.

    W - 1, and with iter_torch_batches(drop_last=True) each worker's short last batch too (W x
    (B - 1) more, B = global_size / W); None where the batches are not an equal split of Ray
    Data's."""
    ray = loader.get("ray_data") or {}
    if ray.get("split") != "equal" or not ray.get("world_size"):
        return None
    world = ray["world_size"]
    batch = max(1, global_size // world)
    return world - 1 + (world * (batch - 1) if loader.get("drop_last") else 0)


def padding_mechanism(loader: LoaderDescription) -> tuple[Optional[str], str]:
    """Return the reason code of the padding the loader can do, and the order it deals from.

    The order: 'sample' (a DistributedSampler interleaves single ids) or 'batch' (accelerate
    deals whole batches round-robin). (None, '') when nothing in the loader pads."""
    if loader.get("batch_sampler_shard") or loader.get("dispatcher"):
        if loader.get("even_batches") is not False:
            return "even-batches-fill", "batch"
        return None, ""
    if loader.get("iterable_shard"):
        return "shard-fill", "batch"
    if loader.get("distributed_sampler"):
        return "sampler-padding", "sample"
    return None, ""


def loader_pads(loader: Optional[LoaderDescription]) -> bool:
    """Say whether the loader's own objects add repeats to an epoch.

    They do in a DistributedSampler whose order is padded (its own total_size past N: N not a
    multiple of its num_replicas), accelerate's fill, IterableDatasetShard's loop-around. False
    for a loader with none of these (a plain DataLoader each rank reads whole, Ray Data's
    batches) and for a DistributedSampler that pads nothing; True where unknown (no
    description)."""
    if loader is None:
        return True
    code, _ = padding_mechanism(loader)
    return code is not None and not (code == "sampler-padding"
                                     and loader.get("sampler_padding") == 0)


def shards(loader: LoaderDescription) -> bool:
    """Whether anything in the loader deals each rank a share: a DistributedSampler,
    accelerate's BatchSamplerShard, IterableDatasetShard or dispatcher, a prepared loader, or
    Ray Data's equal split of a dataset."""
    return bool(loader.get("distributed_sampler") or loader.get("batch_sampler_shard")
                or loader.get("iterable_shard") or loader.get("dispatcher")
                or loader.get("prepared")
                or (loader.get("ray_data") or {}).get("split") == "equal")


def is_double_split(loader: LoaderDescription) -> bool:
    """A DistributedSampler inside a loader that accelerate shards again."""
    return bool(loader.get("distributed_sampler") and loader.get("prepared")
                and (loader.get("batch_sampler_shard") or loader.get("iterable_shard")))


def dispatched_from_other_workers(loader: LoaderDescription, worker_sets: list[set]) -> bool:
    """Say whether each rank's dispatched slices came from workers of its own.

    With dispatch_batches rank 0's loader makes every batch and each rank gets a slice. Where
    each rank's slices came from its own DataLoader workers (none shared between ranks), an id
    that reached several ranks was yielded by several workers: worker replication."""
    if not loader.get("dispatcher") or any(not ws or min(ws) < 0 for ws in worker_sets):
        return False
    return len(worker_sets) > 1 and sum(map(len, worker_sets)) == len(set().union(*worker_sets))


def explain_duplicates(view: EpochView, loader: LoaderDescription, hint: Optional[str], kind: str,
                       world: int, batch: int, n: int) -> tuple[str, bool]:
    """Find why samples appear more than once in this epoch, from the records.

    The records say which ids repeat and where. Returns a reason code and whether it accounts
    for every repeat (False: a broken promise)."""
    if is_double_split(loader):
        return "double-split", True
    if hint:
        return hint, True
    draws = loader.get("draws")
    count = draws["count"] if draws else None
    if draws_repeat(loader, n) and (count is None or sum(view.samples) < count + world * batch):
        # the ranks together dealt one draw (and less than a round of fill): its own repeats
        return "sampler-draws", True
    if (draws and draws["replacement"] and count is not None and world > 1
            and all(s <= count + batch for s in view.samples) and not view.replicated()):
        # a sampler with replacement not split over the ranks, each rank drawing its own
        # num_samples from the whole dataset with its own generator: its repeats (within and
        # across the ranks) are the draws', by design (the epoch is W draws, as conclude says)
        return "sampler-draws", True
    code, order = padding_mechanism(loader)
    if code is not None:
        again = view.repeats_head(order)
        # A DistributedSampler pads fewer than W ids; accelerate fills less than one round.
        limit = world if order == "sample" else world * batch
        if again is not None and 0 < again < max(limit, 1):
            return code, True
    if view.replicated():
        if dispatched_from_other_workers(loader, view.worker_sets()):
            return "worker-replication", False
        return "replication", kind == REPLICATED
    if view.ranks_disagree(n):
        if code is not None or loader.get("seedable_sampler"):
            # A loader that shards, each rank's slice clean, yet slices overlap: the ranks
            # dealt from different orders (no common seed, or a permutation drawn before the
            # sync).
            return "ranks-disagree", False
        if not shards(loader):
            # nothing in the loader shards, and the ranks' clean slices overlap: each rank
            # walks the dataset on its own, in an order of its own (a part of an epoch of an
            # unseeded loader that every rank reads whole): replication, not repeats
            return "replication", kind == REPLICATED
    return code or "unexplained", False


def explain_missing(missing: int, loader: LoaderDescription, hint: Optional[str],
                    global_size: int, dup_code: Optional[str] = None, n: Optional[int] = None,
                    unique: Optional[int] = None) -> tuple[Optional[str], bool]:
    """Find why samples were never seen, and whether that reason accounts for all of them.

    Returns a code (None: no reason, a broken promise) and whether it accounts for all of them.
    drop_last can drop less than one global batch: an incomplete last batch on each rank, or an
    incomplete last round of batches, or the DistributedSampler's cut to a multiple of W (all
    three together stay under W x B). A loader that deals only part of the n ids (a Subset, a
    SubsetRandomSampler, a draw of fewer, loader_share) accounts for them when the ranks
    received that many distinct ids (it can deal no others), less what drop_last drops; one that
    draws with replacement accounts for any. Where none of these accounts for them all and
    accelerate shards a batch sampler of the user's that has a batch_size, the rounds it drops
    are named (`short-rounds`: a loss, not a design)."""
    if is_double_split(loader):
        return "double-split", True
    if hint:
        return hint, True
    slack = ray_split_slack(loader, global_size)
    if slack is not None:
        return "ray-equal-split", missing <= slack
    if dup_code == "ranks-disagree":
        return "ranks-disagree", True
    draws = loader.get("draws")
    if draws and draws["replacement"]:
        return "sampler-draws", True
    short = loader.get("shard_batch_size") is not None
    share = loader_share(loader, n) if n is not None else None
    if share is not None and n is not None and share < n and unique is not None:
        slack = global_size - 1 if loader.get("drop_last") else 0
        code = "subset" if share == loader.get("domain") else "sampler-draws"
        explained = share - slack <= unique <= share
        if explained or not short:
            return code, explained
    elif loader.get("drop_last") and (missing < global_size or not short):
        return "drop-last", missing < global_size
    return ("short-rounds", False) if short else (None, False)
