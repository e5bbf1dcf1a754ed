"""How the watch sees a loader without touching a batch.

A tap on the loader's own index sampler notes the indices it hands out (in the main process, as
the loader's iterator asks for them), the loader's class is swapped in place for a subclass
whose __iter__ hands each batch to the watch, and accelerate's prepare / skip_first_batches
return watched loaders for a watched one. Classes are kept for isinstance, and everything
pickles as it was."""

from __future__ import annotations

import collections
import os
import re
import sys

import torch


# -- noting the indices the loader's own index sampler hands out ------------------------------

class Tap:
    """The indices a loader's index sampler handed out, oldest first.

    Noted while that loader (not another built over the same sampler) is being iterated."""

    def __init__(self) -> None:
        self.fifo: collections.deque = collections.deque()
        self.active = None  # the pass (a token) now iterating the loader; None: no pass
        self.drop = 0  # indices to let pass unnoted: drawn and thrown away (_resume_skip)


class TapIter:
    """The index sampler's iterator, noting what it yields."""

    def __init__(self, inner, tap: Tap) -> None:
        self._inner, self._tap = inner, tap

    def __iter__(self):
        return self

    def __next__(self):
        index = next(self._inner)
        tap = self._tap
        if tap.active:
            if tap.drop:
                tap.drop -= 1
            else:
                tap.fifo.append(index)
        return index

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_inner"], name)


class StatefulTapIter(TapIter):
    """The same, for an iterator with a state of its own: the state passes through.

    torchdata's StatefulDataLoader saves and restores it. Only such an iterator gets these
    methods, since torchdata asks any iterator that has them for its state."""

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state) -> None:
        self._inner.load_state_dict(state)


def _set_class(obj, cls) -> None:
    """Set obj.__class__ = cls, also where a class answers __class__ with a property.

    accelerate's DataLoaderShard names the DataLoader it wraps with a property of its own."""
    object.__dict__["__class__"].__set__(obj, cls)


def _rebuild(cls, state: dict):
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _as_plain(cls, *ours: str):
    """Return __reduce_ex__ of a watched object: it pickles as the plain object it was.

    Pickled without the watch (accelerate's save_state pickles a sampler; a spawned worker, a
    dataset). A watched loader pickled for another process (not copied in this one: copy.copy
    and copy.deepcopy call this too) tells its watch, which says where it must be called."""
    def __reduce_ex__(self, protocol):
        watch = self.__dict__.get("_sharddemo_watch")
        if watch is not None and sys._getframe(1).f_globals.get("__name__") != "copy":
            watch.pickled()
        state = {k: v for k, v in self.__dict__.items() if k not in ours}
        return _rebuild, (cls, state)

    return __reduce_ex__


def tap_sampler(sampler) -> Tap:
    """Give `sampler` (the loader's batch sampler, or its sampler) a tap.

    Its class is kept for isinstance and every attribute (set_epoch, batch_size, state_dict) as
    it was."""
    tap = sampler.__dict__.get("_sharddemo_tap")
    if tap is not None:
        return tap
    cls = type(sampler)

    def __iter__(self):
        inner = iter(cls.__iter__(self))
        kind = StatefulTapIter if hasattr(inner, "state_dict") else TapIter
        return kind(inner, self.__dict__["_sharddemo_tap"])

    tapped = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                          "__reduce_ex__": _as_plain(cls, "_sharddemo_tap")})
    tap = Tap()
    sampler.__dict__["_sharddemo_tap"] = tap
    _set_class(sampler, tapped)
    return tap


# -- attaching to a loader -----------------------------------------------------------------

def attach(loader, state):
    """Make `loader` hand its batches to `state` as they reach the loop.

    In place, its class kept for isinstance; the epoch ends when it is exhausted."""
    from sharddemo.rank.describe import base_loader

    if "_sharddemo_watch" in loader.__dict__:
        loader.__dict__["_sharddemo_watch"] = state
        return loader
    state.describe(loader)
    tap = None
    if state.id_field is None:
        base = base_loader(loader)
        if isinstance(getattr(base, "dataset", None), torch.utils.data.IterableDataset):
            raise ValueError("sharddemo.watch: this loader reads an IterableDataset, whose "
                             "samples have no index: pass id_field= (the batch's field that "
                             "holds each sample's id, or '.' for a batch that is the ids)")
        if state.description.get("dispatcher"):
            raise ValueError("sharddemo.watch: this loader dispatches batches (rank 0 reads "
                             "them all and slices them to the ranks), so a rank's own sampler "
                             "does not say what reached it: pass id_field=")
        # the loader's index sampler, as torch's iterator draws from it (_index_sampler)
        tap = tap_sampler(index_sampler(loader))
    cls = type(loader)

    def __iter__(self):
        """Start a watched pass, as eager as the loader's own __iter__.

        A torch DataLoader draws its sampler's order (and starts its workers) when iter() is
        called, so a set_epoch after iter() and before the first batch must not reach this pass
        here either (a watch that deferred it would change what the training receives, and hide
        a framework's late set_epoch)."""
        watch_state = self.__dict__["_sharddemo_watch"]
        my_tap = self.__dict__.get("_sharddemo_loader_tap")
        this_pass = object()
        if my_tap is not None:
            my_tap.fifo.clear()
            my_tap.drop = resume_skip(self)
            my_tap.active = this_pass
        watch_state.start_pass(self)
        watch_state.closed = False
        return watched_pass(self, own_pass(cls, self), watch_state, my_tap, this_pass)

    def close(self):
        """End the watched run, on every rank at the same point.

        The epoch the loop left open (a `break`, max_steps) is reported as partial
        (docs/watch.md)."""
        self.__dict__["_sharddemo_watch"].close()
        if hasattr(cls, "close"):
            return cls.close(self)
        return None

    def __enter__(self):
        if hasattr(cls, "__enter__"):
            cls.__enter__(self)
        return self

    def __exit__(self, kind, value, traceback):
        watch_state = self.__dict__["_sharddemo_watch"]
        if kind is None:
            watch_state.close()
        else:
            # an exception: the other ranks may not come to a collective; the main process
            # reports what it has of an open epoch alone
            watch_state.close_alone(f"an exception left the with block: {kind.__name__}")
        if hasattr(cls, "__exit__"):
            return cls.__exit__(self, kind, value, traceback)
        return None

    methods = {"__iter__": __iter__, "__module__": cls.__module__, "close": close,
               "__enter__": __enter__, "__exit__": __exit__,
               "__reduce_ex__": _as_plain(cls, "_sharddemo_watch", "_sharddemo_loader_tap",
                                          INSIDE)}
    if callable(getattr(cls, "state_dict", None)) and callable(getattr(cls, "load_state_dict",
                                                                            None)):
        methods.update(carried_state(cls))
    watched = type(cls.__name__, (cls,), methods)
    loader.__dict__["_sharddemo_watch"] = state
    loader.__dict__["_sharddemo_loader_tap"] = tap
    _set_class(loader, watched)
    if tap is not None:
        drop_untapped_iterator(loader)
    return loader


def carried_state(cls) -> dict:
    """state_dict / load_state_dict for a watched loader that has its own (torchdata's
    StatefulDataLoader, accelerate's stateful DataLoaderShard, any loader with both): the
    watch's state rides in the loader's, under WATCH_KEY, so that any checkpointer that saves
    the loader (torch.save, DCP, torchtitan's, Lightning's) carries it.

    state_dict() is the loader's own state plus the watch's part (a collective for the watch:
    every rank asks at the same point); load_state_dict() gives the loader its own part and
    the watch its part (a state saved before the watch, without one, loads: the watch says the
    part of the epoch before the stop is unknown). The loader's own state is made and loaded
    first, exactly as without the watch."""
    from collections.abc import Mapping

    from sharddemo.watching.checkpointing import WATCH_KEY

    def state_dict(self, *args, **kwargs):
        own = cls.state_dict(self, *args, **kwargs)
        if not isinstance(own, Mapping) or self.__dict__.get(INSIDE):
            # (a state the watch cannot ride in, or the loader asking itself while it makes a
            # batch: left as it is)
            return own
        part = self.__dict__["_sharddemo_watch"].loader_part()
        return own if part is None else {**own, WATCH_KEY: part}

    def load_state_dict(self, state, *args, **kwargs):
        part, own = None, state
        if isinstance(state, Mapping) and WATCH_KEY in state:
            part = state[WATCH_KEY]
            own = {k: v for k, v in state.items() if k != WATCH_KEY}
        result = cls.load_state_dict(self, own, *args, **kwargs)
        if isinstance(state, Mapping) and not self.__dict__.get(INSIDE):
            self.__dict__["_sharddemo_watch"].load_loader_part(part)
        return result

    return {"state_dict": state_dict, "load_state_dict": load_state_dict}


# Set in a watched loader's __dict__ while its own code makes a batch (own_batches): a
# state_dict() or load_state_dict() it calls on itself then is its own bookkeeping, not the
# loop's checkpoint (litdata's StreamingDataLoader over a cycling ParallelStreamingDataset calls
# load_state_dict(state_dict()) as each pass begins, to go on where the last one stopped: taken
# for a resume, each epoch was called restarted, and the watch's collective ran inside it)
INSIDE = "_sharddemo_inside"


def own_batches(loader, batches):
    """Yield `batches`, with the loader marked INSIDE while it makes each one."""
    made = iter(batches)
    attrs = loader.__dict__
    while True:
        attrs[INSIDE] = True
        try:
            batch = next(made)
        except StopIteration:
            return
        finally:
            attrs[INSIDE] = False
        yield batch


def watched_pass(loader, batches, watch_state, my_tap, this_pass):
    """The batches of one pass, each noted by the watch; the epoch closes at their end."""
    # (only a loader with its own state reads INSIDE: carried_state; a plain DataLoader's
    # batches are not wrapped a second time on the watch's per-batch path)
    if callable(getattr(loader, "load_state_dict", None)):
        batches = own_batches(loader, batches)
    try:
        for batch in batches:
            watch_state.add(batch, my_tap)
            yield batch
    finally:
        # (a pass left unfinished and collected late must not switch off a newer one)
        if my_tap is not None and my_tap.active is this_pass:
            my_tap.active = None
    watch_state.close_epoch(loader)


def own_pass(cls, loader):
    """Yield one pass of `loader` as its class makes it.

    A loader that is its own iterator (Ray Train's _WrappedDataLoader: __iter__ sets up an inner
    iterator and returns self, __next__ yields) is driven through its class's __next__ until
    StopIteration: iterating the returned object again would call the watched __iter__ once
    more, without end."""
    made = cls.__iter__(loader)
    if made is not loader:
        return made
    return next_until_exhausted(cls, loader)


def next_until_exhausted(cls, loader):
    while True:
        try:
            batch = cls.__next__(loader)
        except StopIteration:
            return
        yield batch


def stateful_loaders(loader) -> list:
    """Return the torchdata StatefulDataLoader(s) behind `loader`.

    Itself, or the one accelerate's stateful DataLoaderShard wraps (base_dataloader)."""
    found = []
    for candidate in (loader, loader.__dict__.get("base_dataloader")):
        if candidate is not None and "_initial_iter_for_state_dict" in candidate.__dict__:
            found.append(candidate)
    return found


def drop_untapped_iterator(loader) -> None:
    """Drop the first iterator a StatefulDataLoader built before the tap.

    A StatefulDataLoader's state_dict() builds its first iterator ahead of time (accelerate
    calls it as it prepares one), and the first pass reuses it: built before the tap, it would
    draw the first epoch's indices unnoted (and, with workers, it has drawn some already).
    Dropped, so that the first pass builds its own through the tap, as every later pass does;
    the state it would have given is the fresh state a new one gives."""
    for base in stateful_loaders(loader):
        built = base.__dict__.get("_iterator")
        if base.__dict__.get("_initial_iter_for_state_dict") and built is not None:
            if not isinstance(getattr(built, "_sampler_iter", None), TapIter):
                base.__dict__["_iterator"] = None
                base.__dict__["_initial_iter_for_state_dict"] = False
                if hasattr(built, "_shutdown_workers"):
                    built._shutdown_workers()


def resume_skip(loader) -> int:
    """Return how many indices a resuming StatefulDataLoader draws and throws away.

    A StatefulDataLoader resuming from a loaded state (torchdata) draws them from its index
    sampler before its first batch: where the sampler has no state of its own it is
    fast-forwarded past what was drawn before the save (itertools.islice over
    `_sampler_iter_yielded`; a sampler, or a sampler's iterator, that saved a state is restored
    from it instead, drawing nothing through the tap), and a loader with workers also fetches
    and drops the batches made since its last snapshot (`_steps_since_snapshot`). 0 for a pass
    that does not resume."""
    for base in stateful_loaders(loader):
        state = base.__dict__.get("next_iter_state")
        if not state:
            continue
        snapshot = state.get("_snapshot")
        main = snapshot.get("_main_snapshot", {}) if snapshot else state
        sampler = index_sampler(base)
        restored = ((hasattr(sampler, "state_dict") and hasattr(sampler, "load_state_dict"))
                    or main.get("_index_sampler_state") is not None
                    or main.get("_sampler_iter_state") is not None)
        skip = 0 if restored else int(main.get("_sampler_iter_yielded", 0) or 0)
        return skip + int(state.get("_steps_since_snapshot", 0) or 0)
    return 0


def follow(accelerator, state) -> None:
    """Watch the loaders that accelerate prepares or skips from a watched one.

    Instance attributes: this Accelerator only, nothing global.

    The hook is on `prepare_data_loader`, which `accelerator.prepare` calls for each DataLoader
    when it runs, not on `prepare` itself: in `accelerator.prepare(model, watch(loader,
    accelerator))` Python looks `accelerator.prepare` up before watch() runs, so a patched
    `prepare` would come too late and the watch would be lost without a word."""
    if accelerator.__dict__.get("_sharddemo_follows"):
        return
    prepare_loader, skip = accelerator.prepare_data_loader, accelerator.skip_first_batches

    def watched_prepare_loader(data_loader, *args, **kwargs):
        made = prepare_loader(data_loader, *args, **kwargs)
        mine = getattr(data_loader, "__dict__", {}).get("_sharddemo_watch")
        if mine is not None and made is not data_loader:
            attach(made, mine)
        return made

    def watched_skip(loader, num_batches: int = 0):
        made = skip(loader, num_batches)
        mine = getattr(loader, "__dict__", {}).get("_sharddemo_watch")
        if mine is not None and made is not loader:
            attach(made, mine)
        return made

    accelerator.prepare_data_loader = watched_prepare_loader
    accelerator.skip_first_batches = watched_skip
    accelerator.__dict__["_sharddemo_follows"] = True


def checkpoint(accelerator, state) -> None:
    """Save and load the watch with accelerate's own checkpoint (save_state / load_state).

    As a file of its own beside accelerate's (state_file), written and read by save_state's and
    load_state's pre-hooks, which accelerate runs on every rank. Not an object registered for
    checkpointing: accelerate's load_state refuses a folder whose count of such objects differs
    from the run's, so a checkpoint saved before the watch was added could not be loaded with
    it, nor one saved with it after it was removed, and the user's own registered objects would
    be numbered differently with and without the watch. Here a checkpoint without the watch's
    file loads, and the watch says the part before the stop is unknown (resumed_without_state);
    a run without the watch ignores the file."""

    def save(models, weights, output_dir) -> None:
        payload = state.state_dict()  # (a collective: every rank, at the same point)
        each_node = getattr(getattr(accelerator, "project_configuration", None),
                            "save_on_each_node", False)
        writer = (accelerator.is_local_main_process if each_node
                  else accelerator.is_main_process)
        if writer:
            torch.save(payload, state_file(output_dir, state.name))

    def load(models, input_dir) -> None:
        path = state_file(input_dir, state.name)
        if not os.path.exists(path):
            state.resumed_without_state(f"{input_dir} holds no {os.path.basename(path)}: it was "
                                        "saved before the watch was added")
            return
        state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def state_file(folder: str, name: str) -> str:
    """Return the watch's file in an accelerate checkpoint: sharddemo_watch-<name>.pt.

    One a watched loader, by its name."""
    return os.path.join(folder, "sharddemo_watch-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name)
                        + ".pt")


def index_sampler(loader):
    """Return the sampler a DataLoader's iterator draws indices from, as torch picks it.

    DataLoader._index_sampler: its batch sampler, or its sampler where batch_size=None."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    return batch_sampler if batch_sampler is not None else loader.sampler
