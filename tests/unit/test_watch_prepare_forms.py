"""A watched loader pickled outside a process group (Ray's driver shipping it to its workers)
says once where watch() belongs. watch() written inside accelerator.prepare(...) on real ranks:
tests/ranks/test_watch_prepare_forms.py."""

from __future__ import annotations


def test_a_watched_loader_pickled_outside_a_process_group_says_once_where_watch_belongs():
    """A watched loader pickled for another process (Ray's driver shipping it to its workers)
    arrives there unwatched: the process that pickles it, no rank of a process group, says so
    once; a copy within the process (copy.deepcopy) says nothing. The pickle is the plain
    loader (its batches unchanged)."""
    import copy
    import pickle
    import warnings

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from sharddemo import watch

    loader = watch(DataLoader(TensorDataset(torch.arange(8)), batch_size=4), report=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        copy.deepcopy(loader)
        assert not [w for w in caught if "pickled" in str(w.message)]
        shipped = [pickle.loads(pickle.dumps(loader)) for _ in range(3)]
    said = [w for w in caught if "is being pickled in a process that is no rank" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "_sharddemo_watch" not in shipped[0].__dict__
    assert [b[0].tolist() for b in shipped[0]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
