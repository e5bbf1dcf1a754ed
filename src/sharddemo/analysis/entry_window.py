"""The watch's check of a window of steps, pure (no torch).

What a part of an epoch can already show, judged from one exchange in which every rank sent its
figures and the ids it received in the window (sharddemo.watching.step_windows.StepWindows.meet).

Two ranks, a stream that every rank reads whole, windows of 50 steps of 8: at step 51 both ranks
send ids 0..399 (judged a batch later, at step 52: the exchange runs in the background meanwhile);
all 400 were received by both, so `no-silent-replication` fails for steps 1-50 and the line says so
at once. Padding and accelerate's even-batches fill come only in a rank's last batch, and a window
never holds a rank's last batch (it is checked when the next batch arrives), so no window calls them
a fault. The same holds for a sample that one rank received twice (`no-unexplained-duplicates`):
only a loader that draws with replacement repeats by design before its last batch. From the second
epoch, a loader meant to shuffle whose ranks all received the same ids at the same steps as in the
previous epoch fails `order-changes-each-epoch`.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from sharddemo.analysis.idtext import MORE_REST, ids_text
from sharddemo.analysis.reasons import draws_repeat
from sharddemo.analysis.types import LoaderDescription
from sharddemo.analysis.entry import WATCH_SCHEMA, out_of_range_detail, sizes_agree
from sharddemo.analysis.entry_line import plural
from sharddemo.analysis.tokens import token_summary
from sharddemo.mesh import explain_on_mesh, peer_verdict


def judge_window(*, epoch: int, name: str, first: int, last: int, at: int,
                 heads: list[dict], ids: list, earlier: int,
                 n: int | None, loader: dict | None = None,
                 id_field: object = None, mesh: dict | None = None,
                 peers: dict | None = None, speakers: list[int] | None = None) -> dict:
    """Judge one window of steps from every rank's part of its exchange.

    The window is steps `first`..`last` of epoch `epoch`, checked at rank steps `at`: `heads[r]`
    rank r's {"done": 0 running, else out of data (or closing), "steps": its steps so far, "n": its
    dataset's length or -1, and optionally "repeats": the samples of its window it has received more
    than once so far this epoch, "examples": a few of them, "order": 1 where its window's ids equal
    the previous epoch's at the same steps, 0 where they differ, -1 not compared}; `ids[r]` the ids
    a running rank received in the window (capped; [] for a rank out of data); `earlier`: samples a
    rank found, at the previous window, that another rank received in an earlier window of this
    epoch. `loader`: the loader's description (its `draws`: a sampler that repeats by design);
    `id_field`: where the ids come from a batch's field (named where they fall outside 0..N-1).
    On a mesh (`mesh`: sharddemo.mesh.MeshLayout.describe()) `heads` and `ids` are each
    data-parallel group's first rank's, by group, and `peers` the peer check's finding (None:
    every peer received the same batches so far), and `speakers` those first ranks, by group
    (the ranks the details name).
    Returns the entry (docs/watch.schema.json, with `window`) and its line."""
    world = len(heads)
    named = speakers if speakers is not None else list(range(world))
    # on a mesh each head is a data-parallel group's, which its first rank speaks for
    someone = "data-parallel group" if mesh is not None else "rank"
    running = [r for r, h in enumerate(heads) if not h["done"]]
    out_of_data = [r for r, h in enumerate(heads) if h["done"]]
    verdicts = []

    def add(verdict: str, ok: bool, detail: str = "") -> None:
        verdicts.append({"verdict": verdict, "epoch": epoch, "ok": bool(ok), "detail": detail})

    ok = not (running and out_of_data)
    add("equal-step-counts", ok, "" if ok else (
        f"rank{'s' if len(out_of_data) > 1 else ''} {_ranks(out_of_data, named)} ran out of "
        f"data after {_steps(heads, out_of_data)} while rank{'s' if len(running) > 1 else ''} "
        f"{_ranks(running, named)} went on to step {max(heads[r]['steps'] for r in running) + 1}: a "
        "DDP loop hangs there"))
    add("ranks-agree-on-dataset", *sizes_agree([h["n"] for h in heads], named))
    # (numpy: a window holds thousands of ids a rank, and this runs on every rank)
    sets = [_distinct(np.asarray(ids[r], dtype=np.int64)) for r in running]
    pooled = np.sort(np.concatenate([np.empty(0, np.int64), *sets]))
    twice = pooled[1:] == pooled[:-1]  # (each rank's ids are distinct: a pair is two ranks)
    shared = _distinct(pooled[1:][twice]).tolist()
    every = _distinct_sorted(pooled)  # (the running ranks' ids, distinct)
    # a sampler that draws with replacement deals some samples to two ranks by design: only
    # the whole window alike on every rank (replication) is a fault then
    by_design = draws_repeat(cast(LoaderDescription, loader or {}), n or 0)
    same = bool(shared) and len(sets) > 1 and all(np.array_equal(s, sets[0]) for s in sets)
    if by_design and not same:
        shared, earlier = [], 0
    ok = not shared and not earlier
    detail = ""
    if not ok:
        parts = []
        if shared:
            parts.append(f"{plural(len(shared), 'sample')} of steps {first}-{last} received by "
                         f"more than one {someone} (ids {ids_text(shared, more=MORE_REST)})"
                         + (f": every {someone} received the same samples: the loader is not "
                            "sharded (replication)" if same else
                            ": the ranks' shares overlap (each rank drawing its own order of "
                            "the whole dataset: a loader not prepared and ranks not seeded "
                            "alike; or a double split's overlap)"))
        if earlier:
            parts.append(f"{plural(earlier, 'sample')} of the previous window received by a "
                         f"{someone} that had received it earlier in this epoch")
        detail = "; ".join(parts)
    add("no-silent-replication", ok, detail)
    # a sample one rank received twice: its counter says so (or, where it keeps none, the
    # window's own ids); padding and fill come only in a rank's last batch, never in a window
    repeats = {r: heads[r].get("repeats", 0) for r in running}
    ok = by_design or not any(repeats.values())
    add("no-unexplained-duplicates", ok, "" if ok else "; ".join(
        f"rank {named[r]} received {plural(count, 'sample')} more than once by step {last} "
        f"({_examples(heads[r].get('examples', []), count)})"
        for r, count in repeats.items() if count)
        + ": not the loader's own padding or fill (those come only in a rank's last batch)")
    again = sorted({i for r in running if repeats[r] and not by_design
                    for i in heads[r].get("examples", [])})
    orders = [heads[r].get("order", -1) for r in running]
    if running and all(o >= 0 for o in orders):
        ok = not all(o == 1 for o in orders)
        add("order-changes-each-epoch", ok, "" if ok else (
            f"every {someone} received the same ids at steps {first}-{last} as in epoch "
            f"{epoch - 1}: the loader is meant to shuffle but deals the previous epoch's order "
            "again (set_epoch is never called?)"))
    outside = every[(every < 0) | (every >= n)] if n is not None else every[every < 0]
    if outside.size:
        add("ids-in-range", False, out_of_range_detail(outside.tolist(), n, id_field))
    if mesh is not None:
        verdicts.append(peer_verdict(mesh, peers, loader, epoch))
        explain_on_mesh(verdicts, mesh, loader)
    failed = [v for v in verdicts if not v["ok"]]
    # every id the windows held (a rank sends at most WINDOW_IDS of them, and none at its end);
    # the distinct ones are known only where every id was sent
    seen = sum(h.get("kept", len(ids[r])) for r, h in enumerate(heads))
    whole = all(h.get("kept", len(ids[r])) == len(ids[r]) for r, h in enumerate(heads))
    top = int(every[-1]) + 1 if every.size else 0
    entry = {
        "schema": WATCH_SCHEMA, "loader": name, "epoch": epoch,
        "window": {"first_step": first, "last_step": last, "checked_at": at},
        "partial": True, "world_size": world,
        "dataset_size": n if n is not None else top,
        "seen": seen, "unique": int(every.size) if whole else None, "missing": None,
        "duplicated": {"count": len(shared) + (0 if by_design else sum(repeats.values())),
                       "ids": sorted(set(shared[:100]) | set(again)),
                       "reasons": ["replication"] if shared else []},
        "steps": [h["steps"] for h in heads], "order_changed": None,
        "verdicts": verdicts, "reasons": {}, "ok": not failed,
    }
    entry["deals"] = entry["dataset_size"]
    if heads and all(h.get("tokens", -1) >= 0 for h in heads):
        # tokens=: each group's tokens so far this epoch (the skew judged at the epoch's end)
        entry["tokens"] = token_summary([{"tokens": h["tokens"]} for h in heads])
    if mesh is not None:
        entry["mesh"] = {**mesh, "peers_differ": peers}
        entry["world_size"] = mesh["world"]
    so_far = ""
    measured = cast(dict, entry.get("tokens"))
    if measured:
        so_far = f", {measured['total']:,} tokens so far"
        if measured.get("skew"):
            so_far += f" (skew {measured['skew']:.2f}x)"
    entry["line"] = (f"sharddemo: epoch {epoch} {name} steps {first}-{last} (checked at step "
                     f"{at}){so_far}: " + ("ok" if not failed else "FAIL " + "; ".join(
                         f"{v['verdict']}: {v['detail']}" for v in failed)))
    return entry


def _distinct(values: np.ndarray) -> np.ndarray:
    """Return the sorted distinct values.

    Found by a sort: np.unique costs more (docs/benchmarks.md, "Figures behind design choices")."""
    return _distinct_sorted(np.sort(values))


def _distinct_sorted(values: np.ndarray) -> np.ndarray:
    """Return the distinct values of sorted `values`."""
    if values.size:
        values = values[np.concatenate(([True], values[1:] != values[:-1]))]
    return values


def _ranks(ranks: list[int], named: list[int]) -> str:
    """'0, 2': the ranks that speak for heads `ranks` (`named`: each head's rank)."""
    return ", ".join(str(named[r]) for r in ranks)


def _steps(heads: list[dict], ranks: list[int]) -> str:
    steps = sorted({heads[r]["steps"] for r in ranks})
    return (plural(steps[0], "step") if len(steps) == 1
            else f"{', '.join(map(str, steps))} steps")


def _examples(ids: list[int], count: int) -> str:
    """Return 'ids 3, 7', or 'ids 3, 7, ...' where more than the listed came again."""
    return (f"id{'s' if count > 1 else ''} {ids_text(ids, more=MORE_REST)}"
            + (", ..." if count > len(ids) else ""))
