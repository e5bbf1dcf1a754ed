"""sharddemo.watch for the frameworks that run the loop for you.

    from sharddemo.integrations import TrainerWatch      # transformers: Trainer(..., callbacks=[TrainerWatch()])
    from sharddemo.integrations import LightningWatch    # Lightning: Trainer(callbacks=[LightningWatch()])

Each is imported on first use, with its framework: a missing framework is one ImportError line
naming the extra to install.
"""

from __future__ import annotations

_WHERE = {"TrainerWatch": ("sharddemo.watching.trainer", "transformers"),
          "LightningWatch": ("sharddemo.watching.lightning", "lightning")}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'sharddemo.integrations' has no attribute {name!r}")
    import importlib

    from sharddemo.extras import EXTRAS, available, install_hint

    module, what = _WHERE[name]
    if not available(what):
        raise ImportError(f"{name} needs {EXTRAS[what][2]}, which is not installed; install the "
                          f"extra: {install_hint(what)}")
    return getattr(importlib.import_module(module), name)


__all__ = ["TrainerWatch", "LightningWatch"]
