"""sharddemo: see, on real ranks, how torch and accelerate split a dataset across processes.

`from sharddemo import watch` checks the sharding of your own training loop as it trains
(sharddemo.watching, docs/watch.md). It is imported on first use, so that the command line
starts without torch."""

__version__ = "0.1.0"

_LAZY = {"watch": "sharddemo.watching", "ShardingViolation": "sharddemo.errors",
         "Recorder": "sharddemo.rank.recorder"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sharddemo' has no attribute {name!r}")


__all__ = ["__version__", "watch", "ShardingViolation", "Recorder"]
