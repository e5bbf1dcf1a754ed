"""What a launch hands its ranks: the environment variables it sets for them, and their
options as one JSON file beside the trace (launch.run_launch writes it, each rank command
reads it)."""

from __future__ import annotations

from sharddemo.errors import UsageError
from sharddemo.options.audit import AuditOptions
from sharddemo.options.declare import from_dict
from sharddemo.options.resume import ResumePlan
from sharddemo.options.run import RunOptions

# Set by `sharddemo compare` for the ranks it launches: the world size it asked for.
EXPECT_ENV = "SHARDDEMO_EXPECT_WORLD_SIZE"
# Set by `sharddemo compare` for its ranks: the machine rank of this node.
NODE_ENV = "SHARDDEMO_MACHINE_RANK"
# Set by `sharddemo compare` / `audit` when a person watches: the main rank reports progress.
PROGRESS_ENV = "SHARDDEMO_PROGRESS"
# Set by `sharddemo compare` / `audit`: where each rank leaves its status (rank/session.py).
STATUS_ENV = "SHARDDEMO_STATUS_DIR"
# Set by `sharddemo compare` / `audit` for their launch: their own pid, which each rank checks
# is still its ancestor as it starts (sharddemo.lifeline).
PARENT_ENV = "SHARDDEMO_PARENT_PID"


def write_rank_options(path: str, payload: dict) -> None:
    import json

    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle)


def read_rank_options(path: str) -> dict:
    """The options file a launch wrote -> its parts as objects: `run` (RunOptions), `audit`
    (AuditOptions), `plan` (ResumePlan), and the plain values beside them (phase, checkpoint,
    stateful, allow_alone)."""
    import json

    try:
        with open(path, encoding="utf-8") as handle:
            payload = json.load(handle)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--options {path}: cannot read the options a launch wrote ({exc}); "
                         "rank commands are started by sharddemo compare / audit") from None
    if "run" in payload:
        payload["run"] = from_dict(RunOptions, payload["run"]).validate()
    if "audit" in payload:
        payload["audit"] = from_dict(AuditOptions, payload["audit"]).validate()
    if "plan" in payload:
        payload["plan"] = ResumePlan.from_dict(payload["plan"])
    return payload
