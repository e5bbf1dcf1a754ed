"""The analysis: a trace of epoch records in, a report out, in pure Python (numpy, no torch).

The records are sharddemo.record's. `build_report` is the entry; `analyse_epoch` reads one
epoch through a view (analysis.views) that hides whether ids or counts lie behind it.
`build_report` and `REPORT_SCHEMA` are imported here on first use, so that a light module of
the analysis (analysis.idtext, which the renderer reads) costs no numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sharddemo.analysis.report import REPORT_SCHEMA, build_report

__all__ = ["REPORT_SCHEMA", "build_report"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from sharddemo.analysis import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
