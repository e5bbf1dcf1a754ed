"""What a run is asked to do, checked before any process starts.

This package imports neither torch nor accelerate, so the CLI can validate input and
print help in a fraction of a second. Every option of `run`, `compare` and `audit` is declared
once, as a dataclass field; every name is imported from `sharddemo.options`, whichever module
below holds it:

- declare.py: how an option is declared once (option, command_line, from_dict);
- modes.py: the modes and the sources, their words (MODES, SOURCES, parse_modes);
- gather.py: how ids reach the main process, and what the count path holds;
- run.py: RunOptions, the options of `run` and `compare`;
- audit.py: AuditOptions, the options of `audit` (audit_target);
- resume.py: --resume-at's chain (ResumePlan, ResumeOptions) and the resume demo's scenarios;
- refusals.py: what needs several options to refuse (validate_compare, validate_audit);
- handoff.py: what a launch hands its ranks (the environment, the options file).
"""

from __future__ import annotations

from sharddemo.options.audit import EXPECTATIONS, AuditOptions, audit_target
from sharddemo.options.declare import command_line, from_dict, option
from sharddemo.options.gather import (BITS_FROM, COUNT_FROM, GATHER_STRATEGIES,
                                      PER_BATCH_GATHER_LIMIT, code_width, counted,
                                      counter_bytes)
from sharddemo.options.handoff import (EXPECT_ENV, NODE_ENV, PARENT_ENV, PROGRESS_ENV,
                                       STATUS_ENV, read_rank_options, write_rank_options)
from sharddemo.options.modes import (BASIC_MODES, MAP_SOURCES, MESH_MODES, MESH_PITFALL,
                                     MODE_GROUPS, MODE_HELP, MODES, PITFALL_MODES, SOURCE_HELP, SOURCES, WDS_MODES,
                                     mode_description, parse_modes)
from sharddemo.options.refusals import (COUNTED_NO_PLOT, NO_EPOCHS_TO_PLOT, validate_audit,
                                        validate_compare, validate_memory, parse_size,
                                        refuse_counted_plot)
from sharddemo.options.resume import (DEMO_WORKERS, LAST, STRATEGIES, ResumeOptions, ResumePlan,
                                      ResumeStop, demo_scenarios)
from sharddemo.options.run import (DEFAULT_BATCH_SIZE, DEFAULT_DATASET_SIZE, DEFAULT_EPOCHS,
                                   DEFAULT_SEED, DEFAULT_SHARDS, DEFAULT_TIMEOUT, RunOptions,
                                   mesh_of, mesh_world, per_rank_batch)

__all__ = [
    "AuditOptions", "BASIC_MODES", "BITS_FROM", "COUNTED_NO_PLOT", "COUNT_FROM",
    "DEFAULT_BATCH_SIZE", "DEFAULT_DATASET_SIZE", "DEFAULT_EPOCHS", "DEFAULT_SEED",
    "DEFAULT_SHARDS", "DEFAULT_TIMEOUT", "DEMO_WORKERS", "EXPECTATIONS", "EXPECT_ENV",
    "GATHER_STRATEGIES", "LAST", "MAP_SOURCES", "MESH_MODES", "MESH_PITFALL", "MODES", "MODE_GROUPS", "MODE_HELP", "NODE_ENV",
    "NO_EPOCHS_TO_PLOT", "PARENT_ENV", "PER_BATCH_GATHER_LIMIT", "PITFALL_MODES", "PROGRESS_ENV",
    "ResumeOptions", "ResumePlan", "ResumeStop", "RunOptions", "SOURCES", "SOURCE_HELP",
    "STATUS_ENV", "STRATEGIES", "WDS_MODES", "audit_target", "validate_audit", "validate_compare",
    "validate_memory", "code_width", "command_line", "counted", "counter_bytes", "demo_scenarios",
    "from_dict", "mesh_of", "mesh_world", "mode_description", "option", "parse_modes", "parse_size", "per_rank_batch",
    "read_rank_options", "refuse_counted_plot", "write_rank_options",
]
