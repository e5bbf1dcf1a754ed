"""What a mode promises and the sizes it runs at, as the trace states them."""

from __future__ import annotations

from sharddemo.analysis.types import Trace

# What each mode promises: sharded modes split the dataset, replicated ones repeat it.
SHARDED = "sharded"
REPLICATED = "replicated"
MODE_KIND = {"replicated": REPLICATED}  # every other mode claims to shard

# Audit modes: "audit" (a make_loader factory) and the loaders a framework builds.
FRAMEWORK_PREFIXES = ("trainer:", "lightning:")


def is_audit_mode(mode: str) -> bool:
    return mode == "audit" or mode.startswith(FRAMEWORK_PREFIXES)


def mode_kind(mode: str, trace: Trace) -> str:
    if is_audit_mode(mode):
        return REPLICATED if expect(trace) == "replicated" else SHARDED
    return MODE_KIND.get(mode, SHARDED)


def opts(trace: Trace) -> dict:
    return trace.get("options", {})


def expect(trace: Trace) -> str:
    return opts(trace).get("audit", {}).get("expect", "sharded")


def global_batch(trace: Trace) -> int:
    """Samples per step over all ranks, as the trace states it."""
    return int(trace.get("global_batch") or trace["batch_size"] * trace["world_size"])
