"""Where a run stops and how it resumes: `audit --resume-at`'s chain of stops (ResumePlan,
from ResumeOptions as the command line gives them), and the resume demo's scenarios."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from sharddemo.errors import UsageError
from sharddemo.options.declare import option

# --resume-at: where a run stops, how it resumes (sharddemo audit; the resume demo's scenarios)
STRATEGIES = ("skip", "stateful", "restart")
LAST = -1  # a stop's step for `E:last`: after the epoch's last step, inside the loop


@dataclass(frozen=True)
class ResumeStop:
    """One stop of a chain: after `step` steps (batches per rank, as the loop counts them) of
    `epoch` (LAST: after the epoch's last step), the state saved and the launch ended; the next
    launch resumes from it on `num_processes` ranks (None: as many as the launch that saved)."""
    epoch: int
    step: int
    num_processes: Optional[int] = None

    def text(self) -> str:
        return f"{self.epoch}:{'last' if self.step == LAST else self.step}"

    def key(self) -> tuple:
        """Its place in the run: E:last comes after every step of E (and is E+1:0's place)."""
        return (self.epoch, float("inf") if self.step == LAST else self.step)


@dataclass(frozen=True)
class ResumePlan:
    """A chain of one or more stops and restarts, each restart resuming as `strategy` says."""
    stops: tuple[ResumeStop, ...]
    strategy: str = "skip"

    @staticmethod
    def at(epoch: int, step: int, strategy: str = "skip",
           num_processes: Optional[int] = None) -> "ResumePlan":
        """One stop and one restart."""
        return ResumePlan((ResumeStop(epoch, step, num_processes),), strategy)

    @property
    def first(self) -> ResumeStop:
        return self.stops[0]

    def text(self) -> str:
        return ",".join(stop.text() for stop in self.stops)

    @staticmethod
    def from_dict(data: dict) -> "ResumePlan":
        return ResumePlan(tuple(ResumeStop(**s) for s in data["stops"]), data["strategy"])

    @staticmethod
    def parse(text: str, strategy: str, epochs: int,
              num_processes: Optional[str]) -> "ResumePlan":
        """`--resume-at E:S[,E:S...]` (S an integer or `last`) and `--resume-num-processes
        M[,M...]` (one world size per restart) -> the plan; one UsageError naming the
        argument for anything it cannot run."""
        stops = []
        for part in text.split(","):
            epoch_text, sep, step_text = part.strip().partition(":")
            try:
                epoch = int(epoch_text)
                step = LAST if step_text.strip() == "last" else int(step_text)
            except ValueError:
                epoch, step, sep = -1, -1, ""
            if not sep or epoch < 0 or (step < 0 and step != LAST):
                raise UsageError(f"--resume-at {text!r}: {part.strip()!r} is not EPOCH:STEP "
                                 "(0-based, STEP = batches per rank completed before the stop, "
                                 "or `last` for after the epoch's last step), e.g. --resume-at "
                                 "0:3 or --resume-at 0:3,0:7,1:last")
            if epoch >= epochs:
                raise UsageError(f"--resume-at {text}: {part.strip()} stops in epoch {epoch}, "
                                 f"beyond --epochs {epochs} (epochs 0..{epochs - 1}); pass "
                                 f"--epochs {epoch + 1} or an earlier epoch")
            stops.append(ResumeStop(epoch, step))
        for before, after in zip(stops, stops[1:]):
            if after.key() < before.key():
                raise UsageError(f"--resume-at {text}: the stops are out of order ({after.text()} "
                                 f"comes before {before.text()} in the run); list them in the "
                                 "order the run reaches them")
        if strategy not in STRATEGIES:
            raise UsageError(f"--resume-strategy must be one of {', '.join(STRATEGIES)}, "
                             f"got {strategy!r}")
        if num_processes is not None:
            try:
                sizes = [int(s) for s in str(num_processes).split(",")]
            except ValueError:
                sizes = [0]
            if any(size < 1 for size in sizes):
                raise UsageError(f"--resume-num-processes {num_processes}: each world size must "
                                 "be an integer of at least 1, e.g. --resume-num-processes 3")
            if len(sizes) != len(stops):
                raise UsageError(f"--resume-num-processes {num_processes} gives {len(sizes)} "
                                 f"world size(s) for {len(stops)} restart(s) (--resume-at "
                                 f"{text}); give one per restart, e.g. --resume-num-processes "
                                 + ",".join(["3"] * len(stops)))
            stops = [dataclasses.replace(stop, num_processes=size)
                     for stop, size in zip(stops, sizes)]
        return ResumePlan(tuple(stops), strategy)


@dataclass(frozen=True)
class ResumeOptions:
    """`audit`'s resume options, as the command line gives them (ResumePlan.parse reads them)."""
    resume_at: Optional[str] = option(
        None, "--resume-at",
        "Also stop after STEP steps (batches per rank, as the loop counts them) of EPOCH "
        "(0-based; STEP `last`: after the epoch's last step), save the state, restart in fresh "
        "processes, resume, and compare with the uninterrupted run (verdict resume-exact). A "
        "comma-separated list is a chain of stops and restarts, in the order the run reaches "
        "them (e.g. 0:3,0:7,1:last).", type=str, metavar="EPOCH:STEP[,EPOCH:STEP...]")
    resume_strategy: str = option(
        "skip", "--resume-strategy",
        "How the restarted run resumes: accelerator.skip_first_batches, the stateful loader's "
        "own state (use_stateful_dataloader), or the epoch from its start.", choices=STRATEGIES)
    resume_num_processes: Optional[str] = option(
        None, "--resume-num-processes",
        "Resume on this many ranks instead (a world size that changed): one size per stop of "
        "--resume-at, e.g. 3,2.", type=str, metavar="M[,M...]")

    def plan(self, epochs: int) -> Optional[ResumePlan]:
        """The chain to run (None without --resume-at); one UsageError naming the argument
        for anything it cannot run."""
        if self.resume_at is None:
            return None
        return ResumePlan.parse(self.resume_at, self.resume_strategy, epochs,
                                self.resume_num_processes)


DEMO_WORKERS = (0, 2)


def demo_scenarios(steps: int, stateful: bool = True) -> list[dict]:
    """The 12 scenarios for an epoch of `steps` steps per rank: stop in the middle of epoch 0
    and at the start of epoch 1; skip, stateful, restart; 0 and 2 workers. Without `stateful`
    (torchdata not installed) the 8 that need no StatefulDataLoader."""
    stops = [(0, steps // 2), (1, 0)]
    strategies = [s for s in STRATEGIES if stateful or s != "stateful"]
    return [{"workers": w, "epoch": e, "step": s, "strategy": strategy}
            for w in DEMO_WORKERS for e, s in stops for strategy in strategies]

