"""A device mesh as the data sees it, in one process: each rank's data group from the mesh's
own layout (worked by hand), accelerate's own BatchSamplerShard where its assumptions hold, and
the mesh text refused in one line."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from sharddemo.mesh import layout_of, parse_mesh


class FakeMesh:
    """What accelerate's prepare_data_loader reads of a mesh: its dim names, each dim's size."""

    def __init__(self, dims, sizes):
        self.mesh_dim_names, self.sizes = dims, dict(zip(dims, sizes))

    def __getitem__(self, name):
        size = self.sizes[name]
        return type("Dim", (), {"size": lambda self: size})()

    def __bool__(self):
        return True


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_data_rank_is_accelerates_where_its_assumptions_hold(data):
    """Meshes laid out as accelerate assumes (data dims named dp_replicate / dp_shard first, tp
    and cp last): every rank's data group and the groups' count are those of the
    BatchSamplerShard that accelerate's prepare_data_loader(torch_device_mesh=) builds."""
    from accelerate.data_loader import prepare_data_loader

    data_dims = data.draw(st.lists(st.sampled_from(["dp_replicate", "dp_shard"]), unique=True,
                                   max_size=2))
    replica = data.draw(st.lists(st.sampled_from(["cp", "tp"]), unique=True, max_size=2))
    replica = [d for d in ("cp", "tp") if d in replica]  # (accelerate: tp innermost)
    dims = tuple(data_dims + replica)
    if not dims:
        return
    sizes = tuple(data.draw(st.integers(1, 3)) for _ in dims)
    world = 1
    for s in sizes:
        world *= s
    layout = layout_of(dims, sizes, list(range(world)))
    for rank in range(world):
        loader = prepare_data_loader(DataLoader(range(40), batch_size=2), num_processes=world,
                                     process_index=rank, torch_device_mesh=FakeMesh(dims, sizes),
                                     put_on_device=False)
        shard = loader.batch_sampler  # (one data group: accelerate leaves it unsharded)
        assert (getattr(shard, "process_index", 0), getattr(shard, "num_processes", 1)) == (
            layout.data_index(rank), layout.data_size)


def test_a_mesh_listing_tp_first_reads_its_own_coordinates():
    """torch lays a (tp, dp) = (2, 2) mesh out as [[0, 1], [2, 3]]: rank 1 is (tp=0, dp=1), so
    the data groups are {0, 2} and {1, 3} (worked by hand), where rank // tp would say {0, 1}."""
    layout = layout_of(("tp", "dp"), (2, 2), [0, 1, 2, 3])
    assert layout.groups() == [[0, 2], [1, 3]]
    assert [layout.data_index(r) for r in range(4)] == [0, 1, 0, 1]
    assert layout.representatives() == [0, 1]
    # a mesh whose ranks are laid out in another order: [[3, 2], [1, 0]] on (dp, tp)
    shuffled = layout_of(("dp", "tp"), (2, 2), [3, 2, 1, 0])
    assert shuffled.groups() == [[3, 2], [1, 0]] and shuffled.representatives() == [3, 1]


@pytest.mark.parametrize("text,error", [("dp=2,tp", "not a mesh"), ("dp=0", "not a mesh"),
                                        ("dp=2,dp=2", "names a dim twice")])
def test_a_mesh_that_is_not_one_is_refused_in_one_line(text, error):
    with pytest.raises(ValueError, match=error):
        parse_mesh(text)


def test_data_dims_default_to_the_data_names_in_the_mesh():
    """Whatever the dims' order, the data dim is the one named dp_shard (size 2 here): 2
    groups of 3 peers; a mesh with no data dim is one group."""
    size = {"dp_shard": 2, "cp": 1, "tp": 3}
    for dims in itertools.permutations(size):
        layout = layout_of(dims, tuple(size[d] for d in dims), list(range(6)))
        assert layout.data_dims == ("dp_shard",)
        assert (layout.data_size, layout.replica_size) == (2, 3)
        assert sorted(len(g) for g in layout.groups()) == [3, 3]
    assert layout_of(("tp",), (4,), [0, 1, 2, 3]).data_size == 1


def test_the_watch_takes_the_accelerators_own_mesh(tmp_path, fresh_accelerate_state):
    """An Accelerator whose state holds a device mesh (what accelerate's ParallelismConfig
    sets; set here by hand, as ParallelismConfig refuses a CPU run): watch(loader, accelerator)
    with no mesh= reads that one. One process, a gloo group of 1, a (dp, tp) = (1, 1) mesh."""
    import json

    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh

    from sharddemo import watch

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        accelerator = Accelerator(cpu=True)
        accelerator.state.device_mesh = mesh
        assert accelerator.torch_device_mesh is mesh
        report = tmp_path / "w.jsonl"
        loader = watch(DataLoader(range(8), batch_size=4), accelerator, report=str(report))
        for _ in loader:
            pass
        loader.close()
        (entry,) = [json.loads(line) for line in report.read_text().splitlines()]
        assert entry["mesh"]["dims"] == {"dp": 1, "tp": 1} and entry["ok"]
    finally:
        dist.destroy_process_group()
