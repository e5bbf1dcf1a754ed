"""The analysis: pure Python (numpy, no torch). A trace of epoch records (sharddemo.record)
in, a report out. `build_report` is the entry; `analyse_epoch` reads one epoch through a view
(analysis.views) that hides whether ids or counts lie behind it."""

from sharddemo.analysis.report import REPORT_SCHEMA, build_report

__all__ = ["REPORT_SCHEMA", "build_report"]
