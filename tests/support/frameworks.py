"""The Trainer and Lightning tests' shared pieces: the examples imported as modules, and a
Trainer built in this process whose loaders accelerate's own prepare_data_loader deals for one
rank of W."""

from __future__ import annotations

from support.launch import ROOT

EXAMPLES = ROOT / "examples"
W = 2


def example(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trainer_for_rank(make_trainer, rank, monkeypatch):
    """The Trainer built here, its DataLoaders dealt by accelerate's own prepare_data_loader
    for rank `rank` of W (every other argument is the Trainer's Accelerator's own)."""
    import accelerate.accelerator as acc_module
    from accelerate.data_loader import prepare_data_loader as real

    def for_rank(*args, **kwargs):
        kwargs.update(num_processes=W, process_index=rank)
        return real(*args, **kwargs)

    monkeypatch.setattr(acc_module, "prepare_data_loader", for_rank)
    return make_trainer()
