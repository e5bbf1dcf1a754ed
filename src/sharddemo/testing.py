"""Audit a DataLoader factory from a test suite, on real CPU ranks.

    from sharddemo.testing import assert_shards

    def test_my_loader_shards():
        assert_shards("my_project.data:make_train_loader", num_processes=2)

`assert_shards` launches the factory on `num_processes` gloo ranks exactly as
`sharddemo audit` does and raises AssertionError naming every failed verdict. A function
object works too, when its module can be imported by path (a test file, a package).
`framework="trainer"` / `"lightning"` audits a make_trainer / make_datamodule factory:

    assert_shards("my_project.train:make_trainer", framework="trainer")
"""

from __future__ import annotations

import inspect
import os
from typing import Callable, Optional, Union

from sharddemo.options import AuditOptions

__all__ = ["audit", "assert_shards"]


def _target(factory: Union[str, Callable]) -> str:
    if isinstance(factory, str):
        return factory
    path = inspect.getsourcefile(factory)
    if path is None or factory.__qualname__ != factory.__name__:
        raise ValueError("pass a module-level function, or a 'module:name' / 'file.py:name' string")
    return f"{os.path.abspath(path)}:{factory.__name__}"


def audit(factory: Union[str, Callable], *, num_processes: int = 2, epochs: int = 2,
          id_field: Optional[str] = None, expect: str = "sharded", set_epoch: bool = False,
          dataset_size: Optional[int] = None, timeout: float = 60.0,
          max_time: float = 600.0, framework: Optional[str] = None,
          grad_accum: Optional[int] = None) -> dict:
    """Run the audit on `num_processes` CPU ranks (gloo) and return its report.

    The report is the JSON `sharddemo audit --format json` prints. It refuses what `sharddemo
    audit` refuses, with the same one line (sharddemo.errors.UsageError), before any rank
    starts.

    Args:
        factory: "pkg.module:make_loader", "path/to/file.py:make_loader", or a module-level
            function make_loader(accelerator) -> DataLoader.
        num_processes: ranks to launch.
        epochs, id_field, expect, set_epoch, dataset_size, timeout, grad_accum: as the
            options of `sharddemo audit` of the same names.
        max_time: seconds the whole audit may take.
        framework: "trainer" or "lightning": the factory is make_trainer() /
            make_datamodule(), as `audit --trainer` / `--lightning`.

    Raises sharddemo.errors.ShardDemoError when the factory cannot be run.

    Example::

        report = audit("examples/good.py:make_loader", num_processes=3)
        assert all(v["ok"] for v in report["modes"]["audit"]["verdicts"])
    """
    from sharddemo.commands.audit import audit_run
    from sharddemo.config import CPU_CONFIG, shipped_config_path
    from sharddemo.launch import LaunchSettings

    if framework is not None:
        from sharddemo.extras import FRAMEWORKS

        if framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, "
                             f"got {framework!r}")
    opts = AuditOptions(target=_target(factory), epochs=epochs, id_field=id_field, expect=expect,
                        set_epoch=set_epoch, dataset_size=dataset_size, timeout=timeout,
                        max_time=max_time, framework=framework, grad_accum=grad_accum).validate()
    # CPU ranks on gloo: a test suite's audit must not need GPUs.
    config = shipped_config_path(CPU_CONFIG)
    return audit_run(opts, LaunchSettings(config_file=config, num_processes=num_processes))


def assert_shards(factory: Union[str, Callable], **kwargs) -> dict:
    """Audit the factory; raise AssertionError listing failed verdicts, else return the report.

    Takes audit()'s keyword arguments."""
    report = audit(factory, **kwargs)
    failed = [f"{v['verdict']} (epoch {v['epoch']}): {v['detail']}"
              for mode in report["modes"].values() for v in mode.get("verdicts", []) if not v["ok"]]
    if failed:
        raise AssertionError(f"{_target(factory)} does not shard correctly on "
                             f"{report['world_size']} ranks:\n  " + "\n  ".join(failed))
    return report
