"""The library's own exceptions. The CLI turns them into one `Error:` line and an exit code."""


class ShardDemoError(Exception):
    """Base class. `exit_code` is what the CLI exits with."""

    exit_code = 1


class UsageError(ShardDemoError):
    """Bad input from the user: exit code 2."""

    exit_code = 2


class RunFailed(ShardDemoError):
    """A launch or a rank failed: exit code 1."""

    exit_code = 1


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
