"""The library's own exceptions. The CLI turns them into one `Error:` line and an exit code."""

import re


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
    """Raised by sharddemo.watch on every rank, at the same point (the end of the epoch's
    exchange), when a watched epoch fails a verdict and `on_violation="raise"`. `entry` is the
    report entry (docs/watch.md) that failed."""

    def __init__(self, message: str, entry: dict) -> None:
        super().__init__(message)
        self.entry = entry


class CollectiveFailed(RunFailed):
    """A collective (gather, exchange) failed on this rank. `kind` says how, measured on the
    rank rather than read from the message: `timeout` (it waited the whole process-group
    timeout: a peer stopped answering) or `peer` (it failed sooner: a peer went away)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class Disagreement(RunFailed):
    """The ranks compared what they hold and found they differ: every rank stops with the
    same message, which names the ranks and the field."""

    kind = "mismatch"


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
    """`Type: message` on one line. An exception a DataLoader worker raised carries the
    worker's whole traceback in its message (torch's ExceptionWrapper): it is cut to the
    worker's own first line and the error it ended with. A known library error gets its
    meaning (KNOWN_CAUSES)."""
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
