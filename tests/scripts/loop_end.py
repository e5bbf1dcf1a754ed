"""What the loop scripts here share (imported from the scripts' own folder, which Python puts
first on the path of a script it runs)."""

from __future__ import annotations


def end_loader(loader) -> None:
    """A case's end: the watched loader closed (the epoch stopped in is reported, partial), and
    the workers of a pass left open ended here, not in a later case's forked worker (where the
    iterator's __del__ would test a process that is not its child)."""
    loader.close()
    iterator = loader.__dict__.get("_iterator")
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
