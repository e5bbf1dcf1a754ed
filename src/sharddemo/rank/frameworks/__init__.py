"""The loaders that frameworks build, got through the frameworks' own code.

`sharddemo audit --trainer FILE:make_trainer` (transformers) and `--lightning
FILE:make_datamodule` (Lightning) hand each rank a list of `Audited` loaders, exactly as the
framework would iterate them; the audit then walks each one like any user loader. Nothing here
re-implements how a framework samples: the Trainer's `get_train_dataloader()` and Lightning's
sampler injection build the loaders, and the per-epoch step (`start_epoch`) is the framework's
own call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from sharddemo.errors import UsageError

@dataclass
class Audited:
    """One loader a framework builds, as a rank iterates it."""

    mode: str  # its key in the report: "trainer:train", "lightning:val", ...
    loader: Any
    epochs: int
    description: str
    role: str = "train"  # "train" (sharded, reshuffled) or "eval" (each sample counted once)
    start_epoch: Optional[Callable[[int], None]] = None  # the framework's call before each epoch
    settings: dict = field(default_factory=dict)  # the arguments that decide the split
    grad_accum: Optional[int] = None
    note: Optional[str] = None  # what the framework changed of the loader the user wrote


def call_factory(factory: Callable, target: str, *args: Any) -> Any:
    """Call the user's factory with `args`; what it raises is a failed run.

    make_loader(accelerator), make_trainer(), make_datamodule(); our own errors pass through."""
    from sharddemo.errors import RunFailed, describe_exception

    try:
        return factory(*args)
    except (UsageError, RunFailed):
        raise
    except Exception as exc:
        raise RunFailed(f"the factory {target} raised {describe_exception(exc)}") from exc
