"""The windows of steps within an epoch (watch's check_every): every so many steps the ranks
exchange one row each (their figures and the first ids of their window) in one all-gather,
started in the background and judged WINDOW_LAG batches later, the same on every rank
(analysis/entry_window.py), so that a replicated loader is named within the first steps of a
run rather than at the epoch's end. Not analysis/windows.py, which is about gradient
accumulation's windows.

StepWindows holds one watch's window state (its schedule, the open window's ids, the exchange
started and not yet judged, the epoch's first ids for the next epoch's order); it reads the
rest from its watch (watching/state.py's WatchState): the ranks, the recorder, the dataset's
length, the loader's description, and where a failing window is reported."""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from sharddemo.errors import ShardingViolation
from sharddemo.watching.output import publish

# The windows' schedule by default (watch's check_every="auto"): the first window ends at step
# FIRST_WINDOW, so that a replicated stream is named within the first 52 steps of a run (the
# window's exchange starts as the next batch arrives and is judged one batch later, WINDOW_LAG);
# each next window is twice as long as the one before, up to LONGEST_WINDOW steps, so that what
# the windows cost shrinks as the epoch goes on (a window costs about as much wherever it comes:
# measured, docs/benchmarks.md, "watch windows"): windows end at steps 50, 150, 350, 750, 1550,
# 3150, then every 1,600; each epoch starts the schedule again. An int check_every is a fixed
# number of steps between two windows.
CHECK_EVERY = "auto"
FIRST_WINDOW = 50
LONGEST_WINDOW = 1600
# A rank keeps its window's ids until the window is judged (each batch's id tensor, then one
# copy of them all): with "auto", a window after the first is shortened so that it holds at most
# WINDOW_KEEP_IDS ids on the rank that receives the most a step (4 MB of int64; read from the
# last window's exchange, where every rank says how many ids its window held, so every rank
# shortens it alike), never below FIRST_WINDOW steps. Batches of 64 never reach it (1,600 steps
# hold 102,400 ids); a stream of 8,192 ids a step has windows of 64 steps.
WINDOW_KEEP_IDS = 1 << 19

# Steps between starting a window's exchange (an all-gather started with async_op) and
# waiting for it to judge the window. Waited for at once, the exchange made the earlier rank
# wait for the later one, most of a window's cost (docs/benchmarks.md); one step of the loop's
# own work later the others have reached it. Every rank waits at the same step (the window's
# step + WINDOW_LAG), so every rank still judges the same exchange at the same step.
WINDOW_LAG = 1

# Ids each rank sends per window at most (the first ones of the window): a fixed width, the same
# on every rank whatever its batches (an all-gather needs equal sizes), 8 KB of int64. Enough to
# see replication (an unsplit loader shares every id) and, looked up in each rank's own counter,
# overlaps with what it received earlier.
WINDOW_IDS = 1024

# The figures ahead of the ids in a rank's window row: done (0 running, 1 at its epoch's end,
# 2 closing), steps so far, its dataset's length (-1: none), how many ids follow, the samples
# it found at the previous window that another rank received in an earlier one, the samples of
# its window it has received more than once so far this epoch, whether its window repeats the
# previous epoch's ids at the same steps (1 yes, 0 no, -1 not compared), whether what
# follows is its error (1: the UTF-8 bytes of a ValueError's message in place of ids), and how
# many ids its window held (all of them, not only those sent: WINDOW_KEEP_IDS), and on a mesh
# the chain of its steps' hashes so far (watching/mesh.py's PeerLog; 0 off a mesh), and the
# samples split across two of its packed rows so far this epoch (rank.ids.Packs: the epoch's
# entry sums the last exchange's), and with tokens= its tokens so far this epoch (-1 without;
# watching/tokens.py: its sums read once a window), and from a rank that is done, with
# tokens=, how many ints of its epoch's token part (TokenMeter.take, as part_ints writes it)
# follow its ids (-1: none, or one that does not fit): the epoch's end reads every rank's part
# from its last exchange, where every rank is done, instead of an exchange of its own; then
# REPEAT_EXAMPLES of its repeated ids.
WINDOW_HEAD = 13
REPEAT_EXAMPLES = 4

# Ids each rank keeps of an epoch's start (its first windows' ids, 32 KB of int64), for the next
# epoch's windows to compare their ids at the same steps with: a loader meant to shuffle that
# deals the previous epoch's order again is named in the next epoch's first window. Only for a
# loader meant to shuffle, with windows on.
ORDER_PREFIX = 4096


class StepWindows:
    """One watch's windows of steps: when the next one ends, the ids of the open one on this
    rank, the exchange started and not yet judged, and what the epoch's windows found."""

    def __init__(self, watch, check_every: Union[int, str, None]) -> None:
        self.watch = watch  # the WatchState these windows belong to
        # "auto" (growing, see CHECK_EVERY) or a fixed number of steps; 0 or None: none
        self.check_every = check_every or 0
        self.pending: Optional[dict] = None  # a window's exchange started, not yet judged
        self.split: list[int] = []  # each rank's samples split across rows, at the last exchange
        self.previous_prefix: Optional[np.ndarray] = None  # (ORDER_PREFIX)
        # every rank's token part (TokenMeter.take) from the last exchange, where every rank
        # sent one (every rank done: the drain's last); else None
        self.parts: Optional[list[dict]] = None
        self.reset()

    def reset(self) -> None:
        """The epoch's window state, empty (at the start of each epoch)."""
        # the ids of this window's batches on this rank (tensors, or numpy arrays where the
        # ids were made on the host: Recording.note_batches's blocks)
        self.ids: list = []
        self.first = 1  # the window's first step
        self.checked_at = 0  # the step count the last window was checked at
        self.found_earlier = 0  # sent at the next window (see WINDOW_HEAD)
        self.reported: set = set()  # verdicts a window of this epoch reported already
        self.offset = 0  # ids this rank received before the window (this epoch)
        self.prefix: list = []  # the epoch's first ids (ORDER_PREFIX), for the next epoch
        self.prefix_size = 0
        # the length of the next window and the step it ends at (0: no windows); the schedule
        # is a function of the step count alone, so every rank keeps the same one
        self.length = FIRST_WINDOW if self.check_every == "auto" else self.check_every
        self.due = self.length

    def on(self) -> bool:
        """Whether there are windows: check_every set, and more than one rank."""
        ranks = self.watch.ranks
        return bool(self.check_every) and ranks.num_processes > 1

    def at_batch(self, steps: int) -> None:
        """A batch arrives after `steps` steps of the open epoch on this rank: the window whose
        exchange was started WINDOW_LAG batches ago is judged, and a window that has just
        ended is started. (It acts only where `steps` is `due`, or a started exchange's due
        step is reached: the common batch's path, Recording.add, calls it at those steps alone.)"""
        if self.pending is not None and steps >= self.pending["due"]:
            self.finish()  # the window started WINDOW_LAG batches ago
        if (steps and steps == self.due and self.checked_at != steps
                and self.watch.ranks.num_processes > 1):
            # a batch after a full window: the window held no rank's last batch (padding and
            # fill come there), so it can be judged; every rank reaches this step alike, and a
            # rank out of data answers from its epoch's end (drain)
            self.checked_at = steps
            self.schedule_next(steps)
            self.start()

    def next_epoch(self, resumed: bool) -> None:
        """The epoch ended: its first ids are kept for the next epoch's windows (not where it
        resumed mid-way, `resumed`: its first steps are not the epoch's), and the window
        state starts empty."""
        self.previous_prefix = (np.concatenate(self.prefix) if self.prefix and not resumed
                                else None)
        self.parts = None
        self.reset()

    def schedule_next(self, steps: int) -> None:
        """A window ends at `steps`: when the next one ends (CHECK_EVERY: "auto" doubles the
        length up to LONGEST_WINDOW; an int is fixed)."""
        if self.check_every == "auto":
            self.length = min(2 * self.length, LONGEST_WINDOW)
        self.due = steps + self.length

    def keep_within(self, heads: list[dict], first: int, last: int) -> None:
        """The window of steps `first`..`last` was exchanged: with "auto", the next window
        (already scheduled) is shortened where it would hold more than WINDOW_KEEP_IDS ids on
        the rank that received the most a step in this one (never below FIRST_WINDOW). From
        the exchanged rows alone: every rank judging this exchange makes the same choice, at
        the same step (before the next window's end: FIRST_WINDOW > WINDOW_LAG)."""
        if self.check_every != "auto":
            return
        most = max(-(-int(h["kept"]) // (last - first + 1)) for h in heads)  # ids a step
        if most and self.length * most > WINDOW_KEEP_IDS:
            self.length = max(FIRST_WINDOW, WINDOW_KEEP_IDS // most)
            self.due = last + self.length

    # -- the exchange: one row per rank, one all-gather
    def row(self, done: int) -> tuple[torch.Tensor, np.ndarray]:
        """This rank's row of a window's exchange (its figures, then the first WINDOW_IDS ids
        of its window; none from a rank that is done), on the ranks' device, and all the ids
        of its window."""
        watch = self.watch
        watch.note_batches()
        steps = watch.open_steps()
        mine = np.empty(0, dtype=np.int64)
        # the ids the window held, sent or not (a rank at its end sends none: its last batch
        # holds padding and fill)
        held = sum(t.size if isinstance(t, np.ndarray) else t.numel() for t in self.ids)
        if not done and self.ids:
            mine = host_ids(self.ids)
        repeats, examples, order = 0, [], -1
        if watch.field_error is not None:  # its message in place of ids
            sent = np.frombuffer(watch.field_error.encode()[:WINDOW_IDS], dtype=np.uint8).astype(
                np.int64)
        else:
            sent = mine[:WINDOW_IDS]
            if not done:  # (a rank at its end holds its last batch: padding, fill)
                repeats, examples = self.repeats(mine)
                order = self.order(mine)
                self.offset += mine.size
        start = WINDOW_HEAD + REPEAT_EXAMPLES
        row = np.full(start + WINDOW_IDS, -1, dtype=np.int64)
        part, taken = None, None  # (a rank that is done: its epoch's token part, after its ids)
        if done and watch.meter is not None and watch.field_error is None:
            taken = watch.meter.take(keep=True)
            part = part_ints(taken)
            if part is not None and sent.size + len(part) > WINDOW_IDS:
                part = None
        row[:WINDOW_HEAD] = (done, steps, -1 if watch.n is None else watch.n, sent.size,
                             self.found_earlier, repeats, order,
                             int(watch.field_error is not None), held,
                             watch.peer_log.chain() if watch.peer_log is not None else 0,
                             watch.packs.split, self.tokens_so_far(taken),
                             -1 if part is None else len(part))
        row[WINDOW_HEAD:WINDOW_HEAD + len(examples)] = examples
        row[start:start + sent.size] = sent
        if part is not None:
            row[start + sent.size:start + sent.size + len(part)] = part
        return torch.from_numpy(row).to(watch.ranks.device), mine

    def tokens_so_far(self, part: Optional[dict] = None) -> int:
        """This rank's tokens so far this epoch (watch's tokens=), -1 where none are counted
        (no tokens=, or a mesh's peer: its group's first rank counts them). `part`: the
        meter's sums as this row carries them (TokenMeter.take), read from there."""
        meter = self.watch.meter
        if meter is None or not meter.token_fields or not self.watch.speaks:
            return -1
        return part["tokens"] if part is not None else meter.so_far()

    def gather_rows(self, row: torch.Tensor, wait: bool = True):
        """ONE collective (an all-gather of one row per rank, the same width on every rank).
        `wait=False`: started in the background (async_op), returns (work, rows): rows holds
        every rank's row once work.wait() returns."""
        from sharddemo.rank.collect import all_gather_flat, collective

        ranks = self.watch.ranks
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            # (torch's own all-gather: accelerate's gather of the same row costs several
            # times more on gloo; docs/benchmarks.md, "Figures behind design choices")
            rows = row.new_empty(ranks.num_processes * row.numel())
            work = collective(all_gather_flat(), rows, row, async_op=not wait)
            return rows if wait else (work, rows)
        rows = collective(ranks.gather, row)
        return rows if wait else (None, rows)

    def read_rows(self, rows: torch.Tensor, done: int, mine: np.ndarray,
                  recent: Optional[np.ndarray] = None) -> tuple[list[dict], list[np.ndarray]]:
        """Every rank's figures and window ids from the exchanged rows; sets what this rank
        found earlier (said at the next window). `recent`: ids this rank received after the
        window (the exchange was judged WINDOW_LAG batches later): not earlier ones."""
        ranks, recorder = self.watch.ranks, self.watch.recorder
        world = ranks.num_processes
        start = WINDOW_HEAD + REPEAT_EXAMPLES
        rows = rows.to("cpu").view(world, start + WINDOW_IDS).numpy()
        heads = [{"done": r[0], "steps": r[1], "n": r[2], "count": r[3], "earlier": r[4],
                  "repeats": r[5], "order": r[6], "error": r[7], "kept": r[8], "chain": r[9],
                  "split": r[10], "tokens": r[11], "parts": r[12],
                  "examples": r[WINDOW_HEAD:WINDOW_HEAD + min(r[5], REPEAT_EXAMPLES)]}
                 for r in rows[:, :start].tolist()]
        ids = [rows[r, start:start + h["count"]] for r, h in enumerate(heads)]
        self.parts = ([part_from_ints(rows[r, start + h["count"]:start + h["count"]
                                          + h["parts"]].tolist()) for r, h in enumerate(heads)]
                      if all(h["parts"] >= 0 for h in heads) else None)
        self.split = [h["split"] for h in heads]  # (each rank's, as of this exchange)
        self.watch.sizes = [h["n"] for h in heads]  # (each rank's dataset length)
        self.found_earlier = 0
        if not done and recorder is not None:
            # which of the others' window ids this rank received in an earlier window (it
            # holds them, and not in this window): said at the next window, to every rank
            me = ranks.process_index
            others = [part for r, part in enumerate(ids)
                      if r != me and len(part) and not heads[r]["error"]]
            if others:
                others = np.sort(np.concatenate(others))
                others = others[np.concatenate(([True], others[1:] != others[:-1]))]
                held = recorder.holds(others)
                if held is not None and held.any():  # (a sharded loader: none, no look-up)
                    later = np.isin(others, mine)
                    if recent is not None and recent.size:
                        # (held now, but maybe only from the batches after the window)
                        later |= np.isin(others, recent)
                    self.found_earlier = int(np.count_nonzero(held & ~later))
        return heads, ids

    def repeats(self, mine: np.ndarray) -> tuple[int, list[int]]:
        """The samples of this rank's window that it has received more than once so far this
        epoch (its counter, on the host), or, where it keeps none (ids counted on a device, a
        stream with no dataset length), more than once within the window; a few of them."""
        recorder = self.watch.recorder
        if recorder is None or not mine.size:
            return 0, []
        copies = recorder.copies(mine)
        if copies is None:
            ordered = np.sort(mine)
            again = ordered[1:][ordered[1:] == ordered[:-1]]
        else:
            again = mine[copies > 1]
        # distinct (a sort: np.unique costs more, and its first call imports numpy.ma;
        # docs/benchmarks.md, "Figures behind design choices")
        again = np.sort(again)
        again = again[np.concatenate(([True], again[1:] != again[:-1]))] if again.size else again
        return int(again.size), again[:REPEAT_EXAMPLES].tolist()

    def order(self, mine: np.ndarray) -> int:
        """Whether this rank's window repeats the previous epoch's ids at the same steps (1),
        differs (0), or cannot be compared (-1: a loader not meant to shuffle, the first epoch,
        steps past the kept prefix). Keeps this epoch's first ORDER_PREFIX ids for the next."""
        if not (self.watch.description or {}).get("shuffled"):
            return -1
        if self.prefix_size < ORDER_PREFIX and mine.size:
            part = mine[:ORDER_PREFIX - self.prefix_size]
            self.prefix.append(part)
            self.prefix_size += part.size
        previous, offset = self.previous_prefix, self.offset
        if previous is None or offset >= previous.size or not mine.size:
            return -1
        size = min(mine.size, previous.size - offset)
        return int(np.array_equal(mine[:size], previous[offset:offset + size]))

    # -- a window's life: started in the background, judged later; or exchanged and waited for
    def exchange(self, done: int) -> tuple[list[dict], list[np.ndarray]]:
        """ONE collective, waited for: every rank's figures and the ids of its window."""
        row, mine = self.row(done)
        return self.read_rows(self.gather_rows(row), done, mine)

    def start(self) -> None:
        """A running rank's window, at the step after it: its exchange is started in the
        background and judged WINDOW_LAG batches later (finish); the next window starts
        empty."""
        row, mine = self.row(0)
        work, rows = self.gather_rows(row, wait=False)
        first, last = self.first, self.watch.open_steps()
        self.ids, self.first = [], last + 1
        self.pending = {"work": work, "rows": rows, "row": row, "mine": mine, "first": first,
                        "last": last, "due": last + WINDOW_LAG}

    def finish(self) -> None:
        """Wait for the window's exchange started by start, if any, and judge it."""
        from sharddemo.rank.collect import collective

        pending, self.pending = self.pending, None
        if pending is None:
            return
        self.watch.note_batches()
        if pending["work"] is not None:
            collective(pending["work"].wait)
        recent = None
        if self.ids:  # the batches after the window, received while it was exchanged
            recent = host_ids(self.ids)
        heads, ids = self.read_rows(pending["rows"], 0, pending["mine"], recent)
        self.keep_within(heads, pending["first"], pending["last"])
        self.judge(heads, ids, pending["first"], pending["last"])

    def meet(self, done: int) -> list[dict]:
        """A window's exchange, waited for, and its judgement (analysis.entry_window), the
        same on every rank: a failing window prints its line at once and is a report entry
        (each failing verdict once an epoch); with on_violation="raise" every rank raises
        here."""
        heads, ids = self.exchange(done)
        first, last = self.first, self.watch.open_steps()
        if not done:
            self.ids, self.first = [], last + 1
        self.judge(heads, ids, first, last)
        return heads

    def judge(self, heads: list[dict], ids: list, first: int, last: int) -> None:
        """Judge one exchange (the same heads and ids on every rank). Checked at: the step
        after the last any rank took, plus WINDOW_LAG where a rank was still running (its
        exchange was started in the background and waited for that many batches later)."""
        from sharddemo.analysis.entry_window import judge_window

        watch = self.watch
        errors = [r for r, h in enumerate(heads) if h["error"]]
        if errors:  # a rank could not read id_field: every rank raises its message, here
            watch.raise_field_error(bytes(ids[errors[0]].tolist()).decode(errors="replace"),
                                    errors)
        if not any(h["steps"] for h in heads):
            return  # (no rank received a batch: close() meeting after the epoch's end)
        lag = WINDOW_LAG if any(not h["done"] for h in heads) else 0
        at = max(h["steps"] for h in heads) + 1 + lag
        mesh = peers = reps = None
        if watch.mesh is not None:
            # a mesh: peers compared (their chains; an exchange of hashes only where they
            # differ, once an epoch), then the groups judged, each by its first rank
            from sharddemo.mesh import PEER_VERDICT

            if PEER_VERDICT not in self.reported:
                peers = watch.compare_peers(chains=[h["chain"] for h in heads])
            mesh = watch.mesh.describe()
            reps = watch.mesh.representatives()
            heads, ids = [heads[r] for r in reps], [ids[r] for r in reps]
        # every rank judges with the same N: the shortest of the ranks' lengths where they
        # differ (each rank's own would let ranks judge one exchange apart, and raise apart)
        known = [h["n"] for h in heads if h["n"] >= 0]
        n = min(known) if known and len({h["n"] for h in heads}) > 1 else watch.n
        entry = judge_window(epoch=watch.epoch, name=watch.name, first=first, last=last,
                             at=at, heads=heads, ids=ids,
                             earlier=sum(h["earlier"] for h in heads), n=n,
                             loader=watch.description, id_field=watch.id_field, mesh=mesh,
                             peers=peers, speakers=reps)
        failed = {v["verdict"] for v in entry["verdicts"] if not v["ok"]}
        if failed - self.reported:
            self.reported |= failed
            watch.entries.append(entry)
            if watch.ranks.is_main_process:
                publish(entry, watch.on_violation, watch.report)
            if watch.on_violation == "raise":
                watch.retire()  # (every rank raises here: nothing more to close)
                raise ShardingViolation(entry["line"], entry)

    def drain(self, done: int) -> list[dict]:
        """This rank is done with the epoch (1: its loader ran out or the epoch ended; 2: the
        run closes): it answers the others' window exchanges until every rank is done, so that
        no rank still iterating is left waiting in a collective. Returns the last heads."""
        while True:
            heads = self.meet(done)
            if all(h["done"] for h in heads):
                return heads


def host_ids(parts: list) -> np.ndarray:
    """A window's ids (tensors, on any device, or numpy arrays) as one new int64 array on the
    host (never a view of a batch: the epoch's prefix keeps a part of it): the numpy arrays
    read with no call into torch."""
    return np.concatenate([part.reshape(-1) if isinstance(part, np.ndarray)
                           else part.reshape(-1).to("cpu", torch.int64).numpy()
                           for part in parts]).astype(np.int64, copy=False)


def part_ints(part: dict) -> Optional[list[int]]:
    """A rank's token part (TokenMeter.take: tokens, slots, supervised, sources) as ints for a
    window's row: tokens, slots (-1: none), supervised (-1: none), the sources' count (-1:
    none), then each source's index, samples and tokens, in the part's order. None where a
    source's name is no index (names go by the epoch's own exchange of objects)."""
    sources = part["sources"]
    out = [part["tokens"], -1 if part["slots"] is None else part["slots"],
           -1 if part["supervised"] is None else part["supervised"],
           -1 if sources is None else len(sources)]
    for name, (samples, tokens) in (sources or {}).items():
        if not (name.isdigit() and str(int(name)) == name):
            return None
        out += [int(name), samples, tokens]
    return out


def part_from_ints(values: list[int]) -> dict:
    """part_ints' ints, the part again."""
    count = values[3]
    return {"tokens": values[0], "slots": None if values[1] < 0 else values[1],
            "supervised": None if values[2] < 0 else values[2],
            "sources": None if count < 0 else {
                str(values[i]): [values[i + 1], values[i + 2]]
                for i in range(4, 4 + 3 * count, 3)}}
