"""Pure analysis of a trace: coverage, duplicates and why, balance, order, a conclusion, and
the audit's verdicts.

Plain data in, plain data out (the JSON the ranks wrote; numpy only to count ids fast), so it
is tested without processes.
"""

from __future__ import annotations

from typing import Any, Optional

REPORT_SCHEMA = "sharddemo.report/1"

# What each mode promises: sharded modes split the dataset, replicated ones repeat it.
SHARDED = "sharded"
REPLICATED = "replicated"
MODE_KIND = {"replicated": REPLICATED}  # every other mode claims to shard

def interleave_steps(ranks: list[list[list[int]]]) -> list[int]:
    """What a per-batch all_gather returns: step by step, rank 0's batch, then rank 1's ..."""
    out: list[int] = []
    for step in range(max((len(b) for b in ranks), default=0)):
        for batches in ranks:
            if step < len(batches):
                out.extend(batches[step])
    return out


def _interleave_samples(flat: list[list[int]]) -> list[int]:
    """The order a DistributedSampler deals from: rank r's i-th id sits at i * W + r."""
    out: list[int] = []
    for i in range(max((len(ids) for ids in flat), default=0)):
        out.extend(ids[i] for ids in flat if i < len(ids))
    return out


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


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
                          "splits by rank (split_dataset_by_node, IterableDatasetShard, or "
                          "dispatch_batches)",
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
BY_DESIGN_MISSING = ("drop-last", "subset", "sampler-draws")


def missing_ok(e: dict) -> bool:
    """No sample missing, or only those the loader leaves out by design."""
    return not e["missing_count"] or (e["missing_reason"] in BY_DESIGN_MISSING
                                      and e["missing_explained"])


def loader_share(loader: dict, n: int) -> int:
    """How many distinct ids a loader deals in an epoch, from its description
    (walk.index_domain): the ids a Subset or SubsetRandomSampler leaves it (`domain`), at most
    its sampler's draw without replacement; n where nothing narrows it."""
    draws, domain = loader.get("draws"), loader.get("domain")
    share = n if domain is None else domain
    if draws and not draws["replacement"]:
        share = min(share, draws["count"])
    return share


def draws_repeat(loader: dict, n: int) -> bool:
    """The sampler itself deals some ids more than once: with replacement, or more draws
    than ids to draw from."""
    draws = loader.get("draws")
    return bool(draws) and (draws["replacement"]
                            or draws["count"] > (loader.get("domain") or n))


def by_design_sentence(code: str, loader: dict, n: int, missing: int,
                       explained: bool = True) -> str:
    """The sentence for the subset and sampler-draws reasons, with this loader's numbers;
    where they do not account for every missing sample (`explained` False), it says so."""
    draws, domain = loader.get("draws"), loader.get("domain")
    share = loader_share(loader, n)
    if code == "subset":
        text = (f"subset: the loader deals from {domain} of the {n} samples (a torch Subset, "
                "as random_split makes, a SubsetRandomSampler, or a view of a datasets.Dataset "
                f"such as train_test_split, select or filter make); the other {n - domain} "
                "are not its data")
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


def not_its_data(e: dict, loader: Optional[dict], n: int) -> int:
    """How many of an epoch's missing samples the loader could never deal, where something
    else lost the rest (a double split, or no known reason): the part of the n a Subset leaves
    out. 0 where the loader deals all n, or the missing are explained by its part."""
    if not loader or e["missing_reason"] not in ("double-split", "subset") or (
            e["missing_reason"] == "subset" and e["missing_explained"]):
        return 0
    outside = n - loader_share(loader, n)
    return outside if 0 < outside < e["missing_count"] else 0


def reason_sentence(code: str, loader: dict, n: int, missing: int = 0,
                    explained: bool = True) -> str:
    """The sentence for a reason code: REASON_SENTENCE, with this loader's numbers where the
    reason has them (drop_last's `missing`, a subset's or a draw's sizes)."""
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
    return REASON_SENTENCE[code]


# Audit modes: "audit" (a make_loader factory) and the loaders a framework builds.
FRAMEWORK_PREFIXES = ("trainer:", "lightning:")


def is_audit_mode(mode: str) -> bool:
    return mode == "audit" or mode.startswith(FRAMEWORK_PREFIXES)


def mode_kind(mode: str, trace: dict) -> str:
    if is_audit_mode(mode):
        return REPLICATED if _expect(trace) == "replicated" else SHARDED
    return MODE_KIND.get(mode, SHARDED)


def _opts(trace: dict) -> dict:
    return trace.get("options", {})


def _expect(trace: dict) -> str:
    return _opts(trace).get("audit", {}).get("expect", "sharded")


def global_batch(trace: dict) -> int:
    """Samples per step over all ranks, as the trace states it."""
    return int(trace.get("global_batch") or trace["batch_size"] * trace["world_size"])


def tail_repeats_head(order: list[int]) -> Optional[int]:
    """If `order` is a run of distinct ids followed by that run dealt again from its start
    (tiled when short), the number of ids dealt again; else None.

    [3, 1, 4, 0, 2, 3, 1] -> 2 (the last two repeat the first two); [3, 1, 3, 1] -> 2;
    [0, 1, 1, 0] -> None. This is what padding by "repeat the start of the epoch" leaves,
    whether a DistributedSampler, accelerate's even_batches or IterableDatasetShard did it.
    """
    import numpy as np

    arr = np.asarray(order, dtype=np.int64)
    unique = len(np.unique(arr))
    head = arr[:unique]
    if len(np.unique(head)) != unique:
        return None
    tail = arr[unique:]
    if len(tail) and not np.array_equal(tail, np.resize(head, len(tail))):
        return None
    return int(len(tail))


def padding_mechanism(loader: dict) -> tuple[Optional[str], str]:
    """The reason code of the padding the loader's own objects can do, and the order it deals
    from: 'sample' (a DistributedSampler interleaves single ids) or 'batch' (accelerate deals
    whole batches round-robin). (None, '') when nothing in the loader pads."""
    if loader.get("batch_sampler_shard") or loader.get("dispatcher"):
        if loader.get("even_batches") is not False:
            return "even-batches-fill", "batch"
        return None, ""
    if loader.get("iterable_shard"):
        return "shard-fill", "batch"
    if loader.get("distributed_sampler"):
        return "sampler-padding", "sample"
    return None, ""


def worker_orders(ranks: list[list[list[int]]], workers: list[list[int]]) -> list[list[int]]:
    """For each DataLoader worker, the order its batches were dealt in: step by step, rank
    0's batch from that worker, then rank 1's ... (`workers[r][k]`: who made rank r's k-th
    batch). What IterableDatasetShard in each worker dealt, one global batch at a time."""
    made = sorted({k for made_by in workers for k in made_by})
    return [interleave_steps([[b for b, k in zip(batches, made_by) if k == worker]
                              for batches, made_by in zip(ranks, workers)])
            for worker in made]


def fill_per_worker(orders: list[list[int]], limit: int) -> Optional[int]:
    """IterableDatasetShard inside DataLoader workers: each worker iterates its own copy over
    its share of the stream and fills its own last global batch from the start of that share.
    The ids dealt again in all, where every worker's order (worker_orders) is distinct ids
    and then fewer than `limit` (one global batch) dealt again from its start; else None."""
    total = 0
    for order in orders:
        again = tail_repeats_head(order)
        if again is None or again >= max(limit, 1):
            return None
        total += again
    return total


def several_workers(workers: list[list[int]]) -> bool:
    """Batches made by more than one DataLoader worker (ids -1: not known)."""
    return len({k for made_by in workers for k in made_by if k >= 0}) > 1


def is_double_split(loader: dict) -> bool:
    """A DistributedSampler inside a loader that accelerate shards again."""
    return bool(loader.get("distributed_sampler") and loader.get("prepared")
                and (loader.get("batch_sampler_shard") or loader.get("iterable_shard")))


def _replicated(flat: list[list[int]]) -> bool:
    """Every rank walked the same samples, each once, or the very same sequence (a sampler
    that repeats ids, the same on every rank): the loader is not sharded."""
    if len(flat) < 2 or not flat[0]:
        return False
    if all(ids == flat[0] for ids in flat[1:]):
        return True
    first = sorted(flat[0])
    return (len(set(first)) == len(first)
            and all(sorted(ids) == first for ids in flat[1:]))


def dispatched_from_other_workers(loader: dict, worker_sets: list[set]) -> bool:
    """With dispatch_batches rank 0's loader makes every batch and each rank gets a slice. Where
    each rank's slices came from its own DataLoader workers (none shared between ranks), an id
    that reached several ranks was yielded by several workers: worker replication."""
    if not loader.get("dispatcher") or any(not ws or min(ws) < 0 for ws in worker_sets):
        return False
    return len(worker_sets) > 1 and sum(map(len, worker_sets)) == len(set().union(*worker_sets))


def explain_duplicates(ranks: list[list[list[int]]], loader: dict, hint: Optional[str],
                       kind: str, world: int, batch: int, n: int,
                       worker_sets: Optional[list[set]] = None) -> tuple[str, bool]:
    """Why samples appear more than once in this epoch, found in the records: which ids
    repeat and where. Returns a reason code and whether it accounts for every repeat
    (False: a broken promise)."""
    flat = [_flat(b) for b in ranks]
    if is_double_split(loader):
        return "double-split", True
    if hint:
        return hint, True
    if draws_repeat(loader, n) and sum(map(len, flat)) < (loader["draws"]["count"]
                                                           + world * batch):
        # the ranks together dealt one draw (and less than a round of fill): its own repeats
        return "sampler-draws", True
    code, order = padding_mechanism(loader)
    if code is not None:
        dealt = interleave_steps(ranks) if order == "batch" else _interleave_samples(flat)
        again = tail_repeats_head(dealt)
        # A DistributedSampler pads fewer than W ids; accelerate fills less than one round.
        limit = world if order == "sample" else world * batch
        if again is not None and 0 < again < max(limit, 1):
            return code, True
    if _replicated(flat):
        if dispatched_from_other_workers(loader, worker_sets or []):
            return "worker-replication", False
        return "replication", kind == REPLICATED
    if _ranks_disagree(flat, n) and (code is not None or loader.get("seedable_sampler")):
        # A loader that shards, each rank's slice clean, yet slices overlap: the ranks dealt
        # from different orders (no common seed, or a permutation drawn before the sync).
        return "ranks-disagree", False
    return code or "unexplained", False


def _ranks_disagree(flat: list[list[int]], n: int) -> bool:
    """Every rank's ids are distinct, but some id is on several ranks while others are on
    none: the overlap and the holes of slices cut from different orders."""
    if len(flat) < 2 or any(len(set(ids)) != len(ids) for ids in flat):
        return False
    union = set().union(*map(set, flat))
    return sum(len(ids) for ids in flat) != len(union) and len(union) < n


def stream_duplicate_reasons(ranks: list[list[list[int]]], workers: list[list[int]],
                             dups: list[int]) -> dict[int, str]:
    """For a stream: each duplicated id -> `worker-replication` when some rank received it
    from several of its DataLoader workers, else `stream-replication` (several ranks read it).
    Found in the records: which rank and which worker delivered each copy."""
    wanted = set(dups)
    where: dict[int, set] = {}
    for r, (batches, made_by) in enumerate(zip(ranks, workers)):
        for batch, worker in zip(batches, made_by):
            for i in batch:
                if i in wanted:
                    where.setdefault(i, set()).add((r, worker))
    out = {}
    for i in dups:
        seen = where.get(i, set())
        per_rank: dict[int, set] = {}
        for r, worker in seen:
            per_rank.setdefault(r, set()).add(worker)
        causes = []
        if any(len(ws) > 1 and min(ws) >= 0 for ws in per_rank.values()):
            causes.append("worker-replication")
        if len(per_rank) > 1:
            causes.append("stream-replication")
        out[i] = causes or ["stream-replication"]
    return out


def worker_shares(ranks: list[list[list[int]]], workers: list[list[int]], configured: int,
                  dispatched: bool = False) -> tuple[list[dict], list[dict]]:
    """Per rank and worker: batches, samples and the worker's share of its rank; and the
    workers that made nothing (of the `configured` per rank). With dispatch_batches every
    batch is made by one of rank 0's workers and sliced to the ranks: idle is rank 0's."""
    rows, idle = [], []
    if dispatched:
        made = {w for made_by in workers for w in made_by}
        idle = [{"rank": 0, "worker": k} for k in range(configured) if k not in made]
        configured = 0
    for r, (batches, made_by) in enumerate(zip(ranks, workers)):
        total = sum(len(b) for b in batches)
        counts: dict[int, list[int]] = {}
        for batch, worker in zip(batches, made_by):
            entry = counts.setdefault(worker, [0, 0])
            entry[0] += 1
            entry[1] += len(batch)
        for worker in sorted(counts):
            rows.append({"rank": r, "worker": worker, "batches": counts[worker][0],
                         "samples": counts[worker][1],
                         "share": round(counts[worker][1] / total, 4) if total else 0.0})
        idle += [{"rank": r, "worker": k} for k in range(configured) if k not in counts]
    return rows, idle


def explain_missing(missing: int, loader: dict, hint: Optional[str],
                    global_size: int, dup_code: Optional[str] = None, n: Optional[int] = None,
                    unique: Optional[int] = None) -> tuple[Optional[str], bool]:
    """Why samples were never seen: a code (None: no reason, a broken promise) and whether
    that reason accounts for all of them. drop_last can drop less than one global batch:
    an incomplete last batch on each rank, or an incomplete last round of batches, or the
    DistributedSampler's cut to a multiple of W (all three together stay under W x B).
    A loader that deals only part of the n ids (a Subset, a SubsetRandomSampler, a draw of
    fewer, loader_share) accounts for them when the ranks received that many distinct ids
    (it can deal no others), less what drop_last drops; one that draws with replacement
    accounts for any. Where none of these accounts for them all and accelerate shards a
    batch sampler of the user's that has a batch_size, the rounds it drops are named
    (`short-rounds`: a loss, not a design)."""
    if is_double_split(loader):
        return "double-split", True
    if hint:
        return hint, True
    if dup_code == "ranks-disagree":
        return "ranks-disagree", True
    draws = loader.get("draws")
    if draws and draws["replacement"]:
        return "sampler-draws", True
    short = loader.get("shard_batch_size") is not None
    share = loader_share(loader, n) if n is not None else None
    if share is not None and share < n and unique is not None:
        slack = global_size - 1 if loader.get("drop_last") else 0
        code = "subset" if share == loader.get("domain") else "sampler-draws"
        explained = share - slack <= unique <= share
        if explained or not short:
            return code, explained
    elif loader.get("drop_last") and (missing < global_size or not short):
        return "drop-last", missing < global_size
    return ("short-rounds", False) if short else (None, False)


def coverage(flat: list[list[int]], n: int) -> dict:
    """Unique, missing, out-of-range and duplicated ids over all ranks' ids.

    Counted with numpy's bincount: a dict of 10 million counts, sorted, took over 20 s.
    """
    import numpy as np

    ids = np.fromiter((i for ids in flat for i in ids), dtype=np.int64,
                      count=sum(len(x) for x in flat))
    inside = ids[(ids >= 0) & (ids < n)]
    counts = np.bincount(inside, minlength=n)
    dup = np.flatnonzero(counts > 1)
    outside = np.unique(ids[(ids < 0) | (ids >= n)])
    return {
        "seen": int(len(ids)),
        "unique": int(np.count_nonzero(counts)) + len(outside),
        "missing": np.flatnonzero(counts == 0).tolist(),
        "out_of_range": outside.tolist(),
        "duplicates": list(zip(dup.tolist(), counts[dup].tolist())),
        "most_copies": int(counts.max(initial=0)),
    }


def _exactly_once(ids: list[int], n: int, share: Optional[int] = None) -> bool:
    """Every id of the dataset exactly once; or, for a loader that deals `share` of its n ids
    (loader_share), that many distinct ids (it can deal no others)."""
    if share is not None and share < n:
        return len(ids) == share == len(set(ids)) and all(0 <= i < n for i in ids)
    return len(ids) == n and sorted(ids) == list(range(n))


def for_metrics(record: dict, ranks: list[list[list[int]]]) -> Optional[list[int]]:
    """What accelerator.gather_for_metrics returned over the epoch: recorded as it came when
    walked per batch; for an epoch gathered at once, every batch whole except the last step,
    which keeps its first `remainder` ids (accelerate's gradient_state.remainder, read on the
    ranks) when that is positive. None where no training loop could reach the last step
    (unequal step counts) or the loader is not prepared."""
    if record.get("gather") == "batch" or record.get("gathered_for_metrics") is not None:
        return record.get("gathered_for_metrics")
    remainders = record.get("remainder") or []
    steps = {len(b) for b in ranks}
    if not remainders or None in remainders or len(steps) != 1 or len(set(remainders)) != 1:
        return None
    done = [i for batches in ranks for batch in batches[:-1] for i in batch]
    last = [i for batches in ranks for i in (batches[-1] if batches else [])]
    keep = remainders[0]
    return done + (last[:keep] if keep > 0 else last)


def analyse_epoch(mode: str, trace: dict, record: dict, previous: Optional[dict],
                  loader: Optional[dict] = None, hint: Optional[str] = None) -> dict:
    if record.get("gather") == "count":
        from sharddemo.report_counts import analyse_counted_epoch

        return analyse_counted_epoch(mode, trace, record, previous, loader, hint)
    n, w = trace["dataset_size"], trace["world_size"]
    loader = dict(loader or {})
    # drop_last as the loader's objects say it, or as the run was asked for (older traces).
    loader["drop_last"] = bool(loader.get("drop_last") or _opts(trace).get("drop_last"))
    kind = mode_kind(mode, trace)
    ranks = [r["batches"] for r in record["ranks"]]
    flat = [_flat(b) for b in ranks]
    cov = coverage(flat, n)
    steps = [len(b) for b in ranks]
    extra = cov["seen"] - cov["unique"]
    per_rank_batch = max(1, global_batch(trace) // max(w, 1))
    reasons: dict[str, str] = {}
    dup_code, explained = None, True
    workers = [r.get("workers") or [] for r in record["ranks"]]
    known = all(len(wk) == len(b) for wk, b in zip(workers, ranks)) and any(
        x >= -1 for wk in workers for x in wk)
    per_id: dict[int, str] = {}
    # IterableDatasetShard with several DataLoader workers: one fill per worker.
    shard_workers = bool(loader.get("iterable_shard") and known and several_workers(workers)
                         and not (is_double_split(loader) or hint))
    if extra and shard_workers and fill_per_worker(worker_orders(ranks, workers),
                                                   w * per_rank_batch) == extra:
        dup_code, explained = "shard-fill", True
        reasons[dup_code] = REASON_SENTENCE[dup_code]
    elif extra and loader.get("iterable_dataset") and known and not (
            (loader.get("iterable_shard") and not shard_workers) or loader.get("dispatcher")
            or is_double_split(loader) or hint) and not _stream_padded(ranks, loader, w,
                                                                        per_rank_batch):
        per_id = stream_duplicate_reasons(ranks, workers, [i for i, _ in cov["duplicates"]])
        codes = {c for causes in per_id.values() for c in causes}
        dup_code = "worker-replication" if "worker-replication" in codes else "stream-replication"
        explained = codes == {"stream-replication"} and kind == REPLICATED
        for code in sorted(codes):
            reasons[code] = REASON_SENTENCE[code]
    elif extra:
        dup_code, explained = explain_duplicates(ranks, loader, hint, kind, w, per_rank_batch, n,
                                                 [set(wk) for wk in workers] if known else None)
        reasons[dup_code] = reason_sentence(dup_code, loader, n)
    miss_code, miss_explained = None, True
    if cov["missing"]:
        if kind == REPLICATED and not loader.get("drop_last"):
            miss_code, miss_explained = None, False
        else:
            miss_code, miss_explained = explain_missing(len(cov["missing"]), loader, hint,
                                                        global_batch(trace), dup_code, n,
                                                        cov["unique"])
        if miss_code:
            reasons[miss_code] = reason_sentence(miss_code, loader, n, len(cov["missing"]),
                                                 miss_explained)
    hang = min(steps) if len(set(steps)) > 1 else None
    ragged = [s for s in range(max(steps, default=0))
              if len({len(b[s]) for b in ranks if s < len(b)}) > 1]
    gathered = interleave_steps(ranks) if record.get("gather", "batch") == "batch" else None
    out: dict[str, Any] = {
        "epoch": record["epoch"],
        "ranks": [
            {"rank": r["rank"], "batches": r["batches"], "steps": len(r["batches"]),
             "samples": len(ids), **({"workers": r["workers"]} if r.get("workers") else {})}
            for r, ids in zip(record["ranks"], flat)
        ],
        "steps_equal": hang is None,
        "hang_at_step": hang,
        "ragged_steps": ragged,
        "gather": record.get("gather", "batch"),
        "gathered": gathered,
        "gathered_count": cov["seen"],
        "seen": cov["seen"],
        "times_dataset": round(cov["seen"] / n, 4) if n else 0.0,
        "unique": cov["unique"],
        "missing": cov["missing"],
        "missing_count": len(cov["missing"]),
        "missing_reason": miss_code,
        "missing_explained": bool(miss_code) and miss_explained if cov["missing"] else True,
        "out_of_range": cov["out_of_range"],
        "duplicates": [{"id": i, "count": c, "reason": per_id[i][0] if i in per_id else dup_code,
                        **({"causes": per_id[i]} if i in per_id else {})}
                       for i, c in cov["duplicates"]],
        "duplicate_count": len(cov["duplicates"]),
        "most_copies": cov["most_copies"],
        "most_copies_exact": True,
        "duplicates_explained": explained,
        "reasons": reasons,
    }
    if loader.get("prepared"):
        metrics = for_metrics(record, ranks)
        out["gathered_for_metrics"] = metrics if record.get("gather") == "batch" else None
        out["gathered_for_metrics_count"] = None if metrics is None else len(metrics)
        out["gather_for_metrics_exact"] = (None if metrics is None else
                                           _exactly_once(metrics, n, loader_share(loader, n)))
        out["gather_for_metrics_equals_gather"] = (metrics is not None
                                                   and len(metrics) == cov["seen"])
    if known:
        rows, idle = worker_shares(ranks, workers, int(loader.get("num_workers") or 0),
                                   dispatched=bool(loader.get("dispatcher")))
        out["workers"] = rows
        out["idle_workers"] = idle
    out["ranks_same_order"] = (len(flat) > 1 and bool(flat[0])
                               and all(ids == flat[0] for ids in flat[1:]))
    if previous is None or previous.get("gather") == "count":
        out["order_changed"] = None
    else:
        before = [_flat(r["batches"]) for r in previous["ranks"]]
        out["order_changed"] = before != flat
    sets = [set(ids) for ids in flat]
    out["same_ids_on_every_rank"] = all(x == sets[0] for x in sets[1:])
    for entry, ids in zip(out["ranks"], flat):
        entry["ascending"] = ids == sorted(ids)
    return out


def _stream_padded(ranks, loader, world: int, batch: int) -> bool:
    """A stream's repeats that are its own loop-around fill (never the case for an unsplit
    stream, whose repeats are whole copies)."""
    again = tail_repeats_head(interleave_steps(ranks))
    return again is not None and 0 < again < world * batch and bool(loader.get("iterable_shard"))


def replicated_ok(e: dict) -> bool:
    """Every rank saw every sample the loader kept (drop_last may keep fewer than N, the same
    ones on every rank)."""
    samples = [r["samples"] for r in e["ranks"]]
    # drop_last can keep nothing at all (N < B): then every rank saw all of nothing.
    return missing_ok(e) and e["same_ids_on_every_rank"] and (samples[0] > 0 or not any(samples))


def broken_promises(mode: str, trace: dict, epochs: list[dict]) -> list[str]:
    """What `--check` fails on: a sharded mode with missing samples or unequal step counts,
    a replicated one whose ranks did not each see everything."""
    kind = mode_kind(mode, trace)
    problems = []
    for e in epochs:
        tag = f"{mode} epoch {e['epoch']}"
        if kind == SHARDED:
            if not missing_ok(e):
                problems.append(f"{tag}: {e['missing_count']} sample(s) never seen: "
                                f"{_short(e['missing'], total=e['missing_count'])}")
            if not e["duplicates_explained"]:
                problems.append(f"{tag}: duplicates the loader's own padding does not explain")
            if not e["steps_equal"]:
                steps = [r["steps"] for r in e["ranks"]]
                problems.append(f"{tag}: ranks take unequal step counts {steps} (DDP would hang)")
        elif not replicated_ok(e):
            # With drop_last every rank still sees all the full batches, not the dropped tail.
            problems.append(f"{tag}: the ranks did not each see the whole dataset (less what "
                            "drop_last drops)")
        if any(d["reason"] == "worker-replication" for d in e["duplicates"]):
            # (with dispatch_batches the workers are rank 0's, whose loader feeds every rank)
            problems.append(f"{tag}: the DataLoader workers each yielded the whole stream "
                            f"(worker replication): samples arrived {_most_copies(e)}")
        if e["out_of_range"]:
            problems.append(f"{tag}: ids outside the dataset: {_short(e['out_of_range'])}")
    return problems


VERDICTS = {
    "no-missing-samples": "every sample is seen each epoch (drop_last may drop less than a round)",
    "no-unexplained-duplicates": "samples repeat no more than the loader's own padding explains",
    "equal-step-counts": "every rank takes the same number of steps (else DDP hangs)",
    "order-changes-each-epoch": "a shuffled loader gives a new order each epoch (set_epoch)",
    "no-silent-replication": "ranks do not all receive the same, whole dataset",
    "every-rank-sees-everything": "each rank receives the whole dataset (--expect replicated)",
    "eval-counts-each-sample-once": "an eval loader's metrics count each sample exactly once "
                                    "(gather_for_metrics where accelerate prepared it)",
}


def eval_verdict(e: dict, prepared: bool, n: int) -> tuple[bool, str]:
    """Do an eval loader's metrics count each of the N samples once? A prepared loader's
    metrics go through gather_for_metrics, which drops accelerate's fill; any other loader's
    metrics are averaged over exactly what the ranks received."""
    extra = e["seen"] - e["unique"]
    if prepared and e.get("gather_for_metrics_exact") is not None:
        if e["gather_for_metrics_exact"]:
            return True, ""
        if e["missing"]:
            why = " (drop_last)" if e["missing_reason"] == "drop-last" else ""
            return False, (f"{e['missing_count']} of {n} eval samples are never evaluated{why}: "
                           f"{_short(e['missing'], total=e['missing_count'])}")
        return False, f"gather_for_metrics returns {e['gathered_for_metrics_count']} ids, not {n}"
    # an eval loader over a Subset (random_split's validation part) evaluates its own data
    lost = e["missing"] and not (e["missing_reason"] == "subset" and e["missing_explained"])
    if not lost and not extra:
        return True, ""
    parts = []
    if lost:
        why = " (drop_last)" if e["missing_reason"] == "drop-last" else ""
        parts.append(f"{e['missing_count']} of {n} eval samples are never evaluated{why}")
    if extra:
        reason = e["duplicates"][0]["reason"] if e["duplicates"] else None
        label = f" ({REASON_LABEL[reason]})" if reason in REASON_LABEL else ""
        twice = [d["id"] for d in e["duplicates"]][:12]
        parts.append(f"{extra} eval sample(s) are evaluated more than once{label}, ids {twice}: "
                     "metrics averaged over the ranks count them again (validate on one "
                     "device, make N divisible by the world size, or drop the copies)")
    return False, "; ".join(parts)


def audit_verdicts(trace: dict, epochs: list[dict], role: str = "train",
                   prepared: bool = False, loader: Optional[dict] = None,
                   set_epoch_called: bool = False) -> list[dict]:
    """The audit's verdicts per epoch: [{"verdict", "epoch", "ok", "detail"}]. An eval loader
    (role "eval") also gets eval-counts-each-sample-once. `loader`: its description
    (walk.describe_loader), whose `shuffled` says whether a new order is due each epoch.
    `set_epoch_called`: the walk called set_epoch before each epoch, as the loop does."""
    w = trace["world_size"]
    expect = _expect(trace)
    out = []

    def add(name, epoch, ok, detail=""):
        out.append({"verdict": name, "epoch": epoch, "ok": bool(ok), "detail": detail})

    previous = None
    for e in epochs:
        k = e["epoch"]
        ok = missing_ok(e)
        outside = not_its_data(e, loader, trace["dataset_size"])
        lost = (f"{e['missing_count'] - outside} of the {trace['dataset_size'] - outside} "
                f"samples it deals never seen (and {outside} not its data)" if outside
                else f"{e['missing_count']} never seen")
        add("no-missing-samples", k, ok, "" if ok else
            f"{lost}: {_short(e['missing'], total=e['missing_count'])}")
        if expect == "sharded":
            ok = e["duplicates_explained"]
            extra = e["seen"] - e["unique"]
            add("no-unexplained-duplicates", k, ok, "" if ok else
                f"{extra} repeats, more than the loader's padding explains")
        steps = [r["steps"] for r in e["ranks"]]
        add("equal-step-counts", k, e["steps_equal"],
            "" if e["steps_equal"] else f"steps per rank {steps}: DDP would hang")
        if expect == "sharded":
            ok = w == 1 or not any({"replication", "stream-replication"}
                                   & {d["reason"], *d.get("causes", [])}
                                   for d in e["duplicates"])
            add("no-silent-replication", k, ok, "" if ok else
                f"all {w} ranks received the same samples: the loader is not sharded")
        else:
            ok = replicated_ok(e)
            short = [r["rank"] for r in e["ranks"] if r["samples"] < max(x["samples"] for x in e["ranks"])]
            add("every-rank-sees-everything", k, ok, "" if ok else
                "the ranks did not each receive the whole dataset (less what drop_last drops)"
                + (f": ranks {', '.join(map(str, short))} received fewer" if short else ""))
        if role == "eval":
            ok, detail = eval_verdict(e, prepared, trace["dataset_size"])
            add("eval-counts-each-sample-once", k, ok, detail)
        if previous is not None:
            # The sampler's own word where it has one: the padding or fill that wraps an
            # unshuffled walk back to its first ids makes its ids decrease once.
            shuffled = (loader or {}).get("shuffled")
            if shuffled is None:
                shuffled = not all(r["ascending"] for r in e["ranks"])
            ok = bool(e["order_changed"]) or not shuffled
            add("order-changes-each-epoch", k, ok, "" if ok else
                "the same shuffled order as the previous epoch, although set_epoch was called "
                "before each epoch as the training loop does: the call does not reach what "
                "draws the order (a sampler or batch sampler of its own needs its own "
                "set_epoch call)" if set_epoch_called else
                "the same shuffled order as the previous epoch: set_epoch is never called")
        previous = e
    return out


def _most_copies(e: dict) -> str:
    """"up to K times", K the most copies of one sample in the epoch; "at least" where the
    count path could only bound it (a rank repeated more ids than it lists)."""
    return f"up to {'' if e['most_copies_exact'] else 'at least '}{e['most_copies']} times"


def conclude(mode: str, trace: dict, epochs: list[dict], loader: Optional[dict] = None) -> str:
    """One sentence in plain words, with the arithmetic stated. `loader`: its description
    (walk.describe_loader), where it deals only part of the data."""
    n, w = trace["dataset_size"], trace["world_size"]
    g = global_batch(trace)
    b = g // max(w, 1)
    first = epochs[0]
    sums = f"(world size {w} x per-rank batch {b} = global batch {g})"
    seen = first["seen"]
    times = f"{first['times_dataset']:g}x"
    kind = mode_kind(mode, trace)
    # every copy past a sample's first (its duplicates list may be capped; these totals not)
    dup = seen - first["unique"]
    if seen == 0:
        why = (f"no batch of this dataset of {n} is complete (drop_last with per-rank batch "
               f"{b} and {w} ranks)" if first["missing_reason"] == "drop-last"
               else f"the loader yielded no sample of this dataset of {n}")
        return f"Every rank received nothing: {why}, so no step is taken at all {sums}."
    if n < w:
        sums += f"; there are more ranks ({w}) than samples ({n})"
    if kind == REPLICATED:
        order = ("in the same order, so the ranks train on identical batches"
                 if first["ranks_same_order"] else "each in its own order")
        dropped = (f"; drop_last dropped {first['missing_count']} on every rank"
                   if first["missing"] and first["missing_reason"] == "drop-last" else "")
        workers = ""
        if any(d["reason"] == "worker-replication" for d in first["duplicates"]):
            workers = (f"; worse, each rank's DataLoader workers each yielded the whole stream, "
                       f"so samples arrived {_most_copies(first)} "
                       f"({REASON_LABEL['worker-replication']})")
        return (f"Every rank walked the whole dataset {order}: {seen} samples per epoch for "
                f"a dataset of {n} = {times} {sums}{dropped}{workers}; shard it with "
                "accelerator.prepare or a DistributedSampler.")
    copies = {d["reason"] for d in first["duplicates"]} & {
        "replication", "worker-replication", "stream-replication"}
    if w == 1:
        text = (f"A single process (world size 1) walked all {seen} samples per epoch for a "
                f"dataset of {n} = {times}: nothing was sharded {sums}")
    elif copies:
        why = " and ".join(REASON_LABEL[c] for c in sorted(copies))
        text = (f"The {w} ranks did NOT split the epoch: {seen} samples per epoch for a dataset "
                f"of {n} = {times} {sums}, samples received {_most_copies(first)} ({why})")
    else:
        text = (f"The {w} ranks split each epoch between them: {seen} samples per epoch for a "
                f"dataset of {n} = {times} {sums}")
    missing, why_missing = first["missing_count"], first["missing_reason"]
    if missing and why_missing == "drop-last":
        text += f"; drop_last dropped {missing}"
    elif missing and why_missing in ("subset", "sampler-draws") and first["missing_explained"]:
        text += (f"; {missing} sample(s) are not its data" if why_missing == "subset"
                 else f"; {missing} sample(s) were not drawn") + f" ({REASON_LABEL[why_missing]})"
    elif missing:
        outside = not_its_data(first, loader, n)
        # (a subset that does not explain them all explains only the samples outside it)
        code = why_missing if why_missing != "subset" or not outside else None
        why = f" ({REASON_LABEL[code]})" if code else " (no known reason)"
        if outside:
            text += (f", but {missing - outside} of the {n - outside} sample(s) it deals were "
                     f"never seen{why}; the other {outside} are not its data (it reads a "
                     "subset)")
        else:
            text += f", but {missing} sample(s) were never seen{why}"
    if dup and not copies and first["duplicates"]:
        text += f", {dup} extra (repeated) sample(s) ({REASON_LABEL[first['duplicates'][0]['reason']]})"
    if first.get("gather_for_metrics_exact") is not None:
        if first["gather_for_metrics_exact"]:
            data = "the loader's data" if why_missing == "subset" else "the dataset"
            text += f"; gather_for_metrics returns exactly {data}, use it for metrics"
        elif first["gather_for_metrics_equals_gather"] and why_missing == "drop-last":
            text += "; gather_for_metrics then equals gather (nothing to drop)"
        else:
            text += "; gather_for_metrics does NOT return exactly the dataset"
    if not first["steps_equal"]:
        text += (f"; the ranks take {[r['steps'] for r in first['ranks']]} steps: a training "
                 f"loop would hang at step {first['hang_at_step']} (DDP's all-reduce waits for "
                 "the ranks that have run out)")
    elif first["ragged_steps"]:
        ragged = _short(first["ragged_steps"], 5, total=first.get("ragged_step_count"))
        text += (f"; the ranks' batches differ in size at step(s) {ragged}: "
                 "a plain accelerator.gather of them fails (pad_across_processes, or "
                 "gather_for_metrics(use_gather_object=True))")
    if len(epochs) > 1:
        changed = [e["order_changed"] for e in epochs[1:]]
        text += ("; the order changes every epoch" if all(changed)
                 else "; the order does NOT change between epochs")
    return text + "."


def _short(ids: list[int], limit: int = 12, total: Optional[int] = None) -> str:
    """The first `limit` ids, and `...` when there are more (`total`: how many there are, for
    a list kept short already)."""
    shown = ", ".join(str(i) for i in ids[:limit])
    more = (total if total is not None else len(ids)) > limit
    return f"[{shown}{', ...' if more else ''}]"


def build_report(trace: dict, *, launch_command: Optional[str] = None,
                 config_file: Optional[str] = None) -> dict:
    """Trace (what the ranks did) -> report (what it means). Deterministic for a given trace."""
    modes: dict[str, Any] = {}
    problems: list[str] = []
    for mode, data in trace["modes"].items():
        # A framework's loaders differ in N and batch (train vs eval): each mode's own sizes.
        view = {**trace, **data.get("sizes", {})}
        epochs: list[dict] = []
        previous = None
        for record in data["epochs"]:
            epochs.append(analyse_epoch(mode, view, record, previous,
                                        loader=data.get("loader"), hint=data.get("hint")))
            previous = record
        if is_audit_mode(mode):
            verdicts = audit_verdicts(view, epochs, role=data.get("role", "train"),
                                      prepared=data.get("prepared", False),
                                      loader=data.get("loader"),
                                      set_epoch_called=data.get("set_epoch_called", False))
            where = "" if mode == "audit" else f"{mode} "
            broken = [f"{where}{v['verdict']} (epoch {v['epoch']}): {v['detail']}"
                      for v in verdicts if not v["ok"]]
        else:
            verdicts = None
            broken = broken_promises(mode, view, epochs)
        problems += broken
        modes[mode] = {
            "description": data.get("description", ""),
            "kind": mode_kind(mode, view),
            "prepared": data.get("prepared", False),
            "loader": data.get("loader"),
            "epochs": epochs,
            "streams": data.get("streams"),
            "fingerprint": data.get("fingerprint"),
            "broken_promises": broken,
            "conclusion": conclude(mode, view, epochs, data.get("loader")),
        }
        if "sizes" in data:
            modes[mode].update(data["sizes"])
        for key in ("role", "settings", "note"):
            if key in data:
                modes[mode][key] = data[key]
        if data.get("grad_accum"):
            from sharddemo.windows import accumulation_windows, window_counts

            k = data["grad_accum"]
            for e, record in zip(epochs, data["epochs"]):
                e["grad_accum"] = (accumulation_windows([r["batches"] for r in record["ranks"]], k)
                                   if record.get("gather") != "count" else
                                   {**window_counts([r["steps"] for r in e["ranks"]], k),
                                    "counted": True})
        if verdicts is not None:
            modes[mode]["verdicts"] = verdicts
    where = trace.get("placement") or [
        {"rank": r, "local_rank": r, "node": 0, "host": None} for r in range(trace["world_size"])]
    nodes: dict[str, list[int]] = {}
    for p in where:
        nodes.setdefault(str(p["node"]), []).append(p["rank"])
    for data in modes.values():
        for e in data["epochs"]:
            e["by_node"] = {node: sum(e["ranks"][r]["samples"] for r in ranks)
                            for node, ranks in nodes.items()}
    report = {
        "schema": REPORT_SCHEMA,
        "world_size": trace["world_size"],
        "backend": trace["backend"],
        "distributed_type": trace.get("distributed_type"),
        "device": trace.get("device"),
        "dataset_size": trace["dataset_size"],
        "batch_size": trace["batch_size"],
        "batch_size_seen": bool(trace.get("batch_size_seen", False)),
        "global_batch": global_batch(trace),
        "epochs": trace["epochs"],
        "seed": trace["seed"],
        "source": trace.get("source", "toy"),
        "options": trace.get("options", {}),
        "config_file": config_file,
        "launch_command": launch_command,
        "placement": where,
        "nodes": nodes,
        "modes": modes,
        "broken_promises": problems,
    }
    if trace.get("fingerprint") is not None:
        report["fingerprint"] = trace["fingerprint"]
    if "timings" in trace:
        report["timings"] = trace["timings"]
    return report
