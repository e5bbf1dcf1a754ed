"""Write files whole or not at all."""

from __future__ import annotations

import os
import tempfile


def write_atomic(path: str, text) -> None:
    """Write `text` (str, or bytes) beside `path`, then rename it into place.

    Written to a temporary file first: a reader sees the old file, or the whole new one, never a
    half-written report.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".sharddemo-", suffix=".tmp", dir=directory)
    data = text.encode("utf-8") if isinstance(text, str) else text
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # what a plain open() would have given
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def validate_writable(path: str) -> None:
    """Raise OSError now, before any rank starts, if `path` could not be written later."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise PermissionError(f"directory {directory} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise PermissionError(f"{path} is not writable")
