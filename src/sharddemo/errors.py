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
