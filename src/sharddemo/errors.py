"""The library's own exceptions. The CLI turns them into one `Error:` line and an exit code."""

import os
import re
import sysconfig
from typing import Optional

# The environment variable that shows the traceback and every rank's full output with an
# `Error:` line, where set to "1" (`sharddemo --debug` sets it; the launch passes it on to the
# ranks, whose CLI reads it too).
DEBUG_ENV = "SHARDDEMO_DEBUG"


class ShardDemoError(Exception):
    """Base class. `exit_code` is what the CLI exits with."""

    exit_code = 1


class UsageError(ShardDemoError):
    """Bad input from the user: exit code 2."""

    exit_code = 2


class RunFailed(ShardDemoError):
    """A launch or a rank failed: exit code 1."""

    exit_code = 1


class ShardingViolation(ShardDemoError):
    """Raised by sharddemo.watch on every rank when a watched epoch fails a verdict.

    At the same point on every rank (the end of the epoch's exchange), with
    `on_violation="raise"`. `entry` is the report entry (docs/watch.md) that failed."""

    def __init__(self, message: str, entry: dict) -> None:
        super().__init__(message)
        self.entry = entry

    def __reduce__(self):
        # pickled whole (Ray Train sends a worker's error to the driver pickled)
        return type(self), (str(self), self.entry)


class CollectiveFailed(RunFailed):
    """A collective (gather, exchange) failed on this rank.

    `kind` says how, measured on the rank rather than read from the message: `timeout` (it
    waited the whole process-group timeout: a peer stopped answering) or `peer` (it failed
    sooner: a peer went away)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):
        return type(self), (str(self), self.kind)


class Disagreement(RunFailed):
    """The ranks compared what they hold and found they differ.

    Every rank stops with the same message, which names the ranks and the field."""

    kind = "mismatch"


class LoaderRaised(ShardDemoError):
    """The loader raised inside a library on every rank, and every rank knows it.

    A library such as accelerate, torch, datasets or WebDataset; rank.walk settles it with one
    exchange at the point of failure: the mode's or the audited loader's finding, not a failed
    run. `raised`: [{"rank", "epoch", "step", "error", "frame"}] in rank order, the same on
    every rank."""

    def __init__(self, raised: list) -> None:
        first = raised[0]
        super().__init__(f"epoch {first['epoch']} of the loader raised on every rank: "
                         f"{first['error']}")
        self.raised = raised


class PeerRaised(RunFailed):
    """This rank's loader did not raise, but a peer's did (not on every rank).

    This rank stops too. The launcher names the rank that raised; this one is left out of the
    line."""

    kind = "stopped"


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")

# What a library's own error means, where its words do not say (the text it raises -> why).
KNOWN_CAUSES = {
    "you need to add an explicit nodesplitter": (
        "WebDataset's default nodesplitter (single_node_only) refuses to run on more than one "
        "rank, since every rank would then read every shard: pass "
        "nodesplitter=wds.split_by_node (and workersplitter=wds.split_by_worker), not "
        "nodesplitter=lambda src: src, which silences it and replicates the data"),
    "No samples found in dataset; perhaps you have fewer shards than workers": (
        "a DataLoader worker of WebDataset's got no shard: split_by_node gives rank r shards r, "
        "r+W, ... and split_by_worker gives its worker k every K-th of those, so write at least "
        "ranks x workers shards (sharddemo compare: a larger --shards), or fewer workers"),
}


def describe_exception(exc: BaseException) -> str:
    """Return `Type: message` on one line.

    An exception a DataLoader worker raised carries the worker's whole traceback in its message
    (torch's ExceptionWrapper): it is cut to the worker's own first line and the error it ended
    with. A known library error gets its meaning (KNOWN_CAUSES)."""
    text = str(exc)
    if "Original Traceback" in text:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        # the error the worker ended with, whole: its `Type: message` line and any lines of
        # message after it (WebDataset's empty_check error has two)
        last = max((k for k, line in enumerate(lines) if _ERROR_LINE.match(line)),
                   default=len(lines) - 1)
        text = " ".join([lines[0]] + lines[max(last, 1):])
    else:
        text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    for words, why in KNOWN_CAUSES.items():
        if words in text:
            text += f" ({why})"
    return f"{type(exc).__name__}: {text}"


# ---------------------------------------------------------------------------------------------
# Where an exception came from: a library's own code, or the user's (or sharddemo's).

_STDLIB = tuple(os.path.realpath(p) + os.sep for p in
                {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")} if p)
_INSTALLED = ("site-packages", "dist-packages")
_FILE_LINE = re.compile(r'File "([^"]+)", line \d+, in (\S+)')


def _installed_module(path: str) -> Optional[str]:
    """Return the module of an installed package's file, else None.

    `accelerate.utils.operations` for .../site-packages/accelerate/utils/operations.py; None for
    a file outside an installed package (the user's, sharddemo's own source)."""
    parts = os.path.normpath(path).split(os.sep)
    where = max((k for k, part in enumerate(parts) if part in _INSTALLED), default=None)
    if where is None or where + 1 >= len(parts):
        return None
    rest = parts[where + 1:]
    rest[-1] = os.path.splitext(rest[-1])[0]
    if rest[-1] == "__init__":
        rest = rest[:-1]
    if not rest or rest[0] == "sharddemo":
        return None
    return ".".join(rest)


def _frames(exc: BaseException) -> list[tuple[str, str]]:
    """Return (file, function) of the frames the exception went through, innermost last.

    An error a DataLoader worker raised is re-raised in the main process by torch; its message
    holds the worker's traceback, whose frames are innermost."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    text = str(exc)
    if "Original Traceback" in text:
        frames += _FILE_LINE.findall(text.split("Original Traceback", 1)[1])
    return frames


def library_frame(exc: BaseException) -> Optional[str]:
    """Return `module:function` of the innermost frame, where that frame is a library's.

    An installed library's (accelerate, torch, datasets, webdataset ...): the standard library's
    frames are passed over (a library calls it; so does a user), and a frame of the user's own
    code or of sharddemo's, innermost, means the library did not raise it (None). An exception
    raised inside accelerate's dispatcher: `accelerate.utils.operations:recursively_apply`."""
    for path, function in reversed(_frames(exc)):
        real = os.path.realpath(path)
        if real.startswith(_STDLIB) and not any(part in real for part in _INSTALLED):
            continue
        module = _installed_module(real)
        return None if module is None else f"{module}:{function}"
    return None


def _dispatch_cause(text: str, facts: dict) -> Optional[str]:
    """Explain accelerate's dispatcher refusing an epoch that drop_last empties, else None.

    accelerate's DataLoaderDispatcher with drop_last: rank 0 reads the epoch's first global
    batch (W batches of B, or one batch of B with split_batches); where the dataset holds fewer
    samples than that, drop_last leaves nothing, the dispatcher broadcasts None and accelerate's
    broadcast refuses it on every rank at the first next() (accelerate 1.16). Said only where
    the loader's own numbers show it."""
    if "NoneType" not in text or "_gpu_broadcast_one" not in text:
        return None
    n, b, w = facts.get("dataset_size"), facts.get("batch_size"), facts.get("world")
    if not (facts.get("dispatcher") and facts.get("drop_last")) or n is None or b is None \
            or w is None:
        return None
    split = bool(facts.get("split_batches"))
    need = b if split else w * b
    if n >= need:
        return None
    how = (f"N = {n} < the global batch {b} (split_batches) with drop_last" if split
           else f"N = {n} < {w} ranks x {b} with drop_last")
    return (f"accelerate's dispatcher cannot dispatch an epoch with no full global batch: "
            f"{how}; use at least {need} samples, drop_last=False, or "
            "dispatch_batches=False")


# Causes that need the loader's numbers to be told (what it raised, the loader's facts) ->
# the cause with its arithmetic, or None where the numbers do not show it.
ARITHMETIC_CAUSES = (_dispatch_cause,)


def library_error(exc: BaseException, facts: Optional[dict] = None) -> Optional[dict]:
    """Word an exception a library raised inside a loader for the report: {"error", "frame"}.

    `error` is describe_exception's line with its cause where one is known (KNOWN_CAUSES, or
    ARITHMETIC_CAUSES from `facts`: the loader's world, dataset_size, batch_size, drop_last,
    dispatcher, split_batches), else with the library frame it came from. None where the
    innermost frame is not a library's (the user's own code raised)."""
    frame = library_frame(exc)
    if frame is None:
        return None
    line = describe_exception(exc)
    known = any(words in line for words in KNOWN_CAUSES)
    for cause in ARITHMETIC_CAUSES:
        why = cause(line, facts or {})
        if why:
            line, known = f"{line} ({why})", True
    if not known:
        line = f"{line} (raised in {frame})"
    return {"error": line, "frame": frame}
