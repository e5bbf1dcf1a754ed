"""A failed launch in one line: what each rank said of itself (its status file), and what
torchrun's stderr says of the ranks that said nothing (a signal, a native abort, a port taken)."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Optional

from sharddemo.launch.watchdog import progress_text

# torchrun's own report of a process that ended: a negative exit code is a signal. Only used to
# name the signal of a rank that died without leaving its status file.
TORCHRUN_EXIT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# torchrun's closing table: one entry per failed process; and the processes it closed itself
# (whose signal is torchrun's, not the cause).
TORCHRUN_ENTRY = re.compile(r"rank\s*:\s*\d+ \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+) "
                            r"\(pid: (\d+)\)")
TORCHRUN_CLOSED = re.compile(r"Sending process (\d+) closing signal")


def killed_by_signal(stderr: str, first_rank: int = 0) -> dict[int, int]:
    """{rank: signal number} for the ranks a signal ended, as torchrun reports them: its
    "failed" line names the first process it saw end; its closing table names every failed
    one. A rank that exits as soon as its peer dies can be the one torchrun sees first, so
    the table is read too, less the processes torchrun closed itself."""
    out = {first_rank + int(local): -int(code)
           for code, local in TORCHRUN_EXIT.findall(stderr) if int(code) < 0}
    closed = set(TORCHRUN_CLOSED.findall(stderr))
    for local, code, pid in TORCHRUN_ENTRY.findall(stderr):
        if int(code) < 0 and pid not in closed:
            out.setdefault(first_rank + int(local), -int(code))
    return out


# The port was taken between free_port() and the launcher's bind.
PORT_TAKEN = re.compile(r"EADDRINUSE|[Aa]ddress already in use")


def _by_message(lines: list) -> list[str]:
    """[(rank, message)] -> `rank 0, 1: message`, one entry per distinct message."""
    same: dict[str, list[int]] = {}
    for rank, message in lines:
        ranks = same.setdefault(message.strip(), [])
        if int(rank) not in ranks:
            ranks.append(int(rank))
    return [f"rank {', '.join(map(str, sorted(r)))}: {m}" for m, r in same.items()]


# What a native library prints as it aborts: a C++ exception nobody caught (gloo's enforce
# failures among them), glibc's heap checks.
NATIVE = re.compile(r"(terminate called.*|what\(\):.*|.*\[enforce fail at.*|"
                    r"(?:double free|free\(\)|malloc\(\)|corrupted).*|"
                    r"Fatal Python error: (?!Aborted$|Segmentation fault$).*)", re.MULTILINE)


def native_message(stderr: str, limit: int = 300) -> str:
    """The most telling line a native abort left in the launch's stderr, or ''."""
    found = [m.group(1).strip() for m in NATIVE.finditer(stderr)]
    for line in found:  # the exception's own text beats "terminate called ..."
        if line.startswith(("what():", "Fatal Python error")) or "enforce fail" in line:
            return line[:limit]
    return found[0][:limit] if found else ""


def read_status(folder: str) -> tuple[dict[int, dict], set[int]]:
    """What the ranks left in the status folder: {rank: {"kind", "message"}} for the ranks that
    failed and said so, and the set of ranks that started."""
    failed, started = {}, set()
    for name in os.listdir(folder):
        match = re.fullmatch(r"rank-(\d+)\.(started|json)", name)
        if not match:
            continue
        rank = int(match.group(1))
        if match.group(2) == "started":
            started.add(rank)
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                failed[rank] = json.load(handle)
        except (OSError, ValueError):
            continue
    return failed, started


def explain_failure(failed: dict[int, dict], started: set[int], stderr: str, code: int,
                    debug: bool, first_rank: int = 0,
                    seen: Optional[dict[int, tuple[dict, float]]] = None,
                    timeout: Optional[float] = None) -> tuple[str, bool]:
    """What went wrong, in one line, from what each rank said of itself (its status file:
    usage, error, timeout or peer, measured on the rank) and which ranks started but said
    nothing. Returns the message and whether it was a usage error (exit code 2).

    The root cause comes first: a rank's own exception, or a rank that died without a word
    (with the signal torchrun saw, when it names one), or a rank its peers waited the whole
    process-group timeout for. Ranks that only lost the connection to a failed peer come
    last, briefly.

    `seen`: {rank: (its last progress report, seconds from it to the first failure)}
    (Watchdog.last_seen), and `timeout` the process-group timeout: a rank its peers waited
    for is then said to have stopped making progress where it did, or, where it was still
    making progress within half the timeout of the failure, to have been too slow to reach
    the collective; never to have stopped when it was working.
    """
    import signal as _signal

    if debug:
        sys.stderr.write(stderr)
    usage = [(r, f["message"]) for r, f in sorted(failed.items()) if f.get("kind") == "usage"]
    if usage:
        return "; ".join(_by_message(usage)), True
    # The ranks compared notes and found they differ: the message names the ranks already.
    agreed = [f["message"] for _, f in sorted(failed.items()) if f.get("kind") == "mismatch"]
    if agreed:
        return agreed[0], False
    own = [(r, f["message"]) for r, f in sorted(failed.items()) if f.get("kind") == "error"]
    waited = sorted(r for r, f in failed.items() if f.get("kind") == "timeout")
    lost = sorted(r for r, f in failed.items() if f.get("kind") == "peer")
    silent = sorted(started - set(failed))
    signals = killed_by_signal(stderr, first_rank)
    causes = _by_message(own)
    if waited:
        stalled = [r for r in silent if r not in signals] or silent
        waiters = ", ".join(map(str, waited))
        causes.append(_waited_for(stalled, waiters, seen or {}, timeout))
        silent = [r for r in silent if r not in stalled]
    for rank in silent:
        if rank in signals:
            number = signals[rank]
            try:
                name = _signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            native = native_message(stderr)
            causes.insert(0, f"rank {rank} was killed by signal {number} ({name}) and said nothing"
                          + (f" (a native library said: {native})" if native else ""))
        elif not own and not lost:
            causes.append(f"rank {rank} ended without a word")
    if lost and not causes and started and started <= set(lost):
        # Every rank failed in a collective and none had failed before it: no peer was lost,
        # the collective itself failed (what it said is the cause).
        lost_messages = [(r, failed[r]["message"]) for r in lost]
        return ("every rank failed in the same collective, none before it: "
                + "; ".join(_by_message(lost_messages))), False
    if lost:
        ranks = ", ".join(map(str, lost))
        causes.append(f"rank {ranks} then lost the connection to the failed rank"
                      if causes else f"rank {ranks} lost the connection to a peer that failed "
                      "without a message")
    if causes:
        return "; ".join(dict.fromkeys(causes)), False
    tail = [line for line in stderr.strip().splitlines() if line.strip()][-3:]
    return f"the launch exited with code {code}: " + (" | ".join(tail) or "no output"), False


def _waited_for(stalled: list[int], waiters: str, seen: dict[int, tuple[dict, float]],
                timeout: Optional[float]) -> str:
    """The cause where rank(s) `waiters` gave up at the process-group timeout waiting for the
    ranks `stalled`: what each of those was last seen doing (its progress report)."""
    gave_up = (f"rank {waiters} gave up waiting for "
               f"{'it' if len(stalled) == 1 else 'them'} at the process-group timeout "
               "(--timeout)")
    if not stalled:
        return f"a rank never reached the collective: {gave_up}"
    known = [r for r in stalled if r in seen]
    if not known:
        return f"rank {', '.join(map(str, stalled))} stopped answering: {gave_up}"
    before = f"rank {waiters} gave up"
    working, parts = False, []
    for rank in stalled:
        if rank not in seen:
            parts.append(f"rank {rank} sent no progress report")
            continue
        report, ago = seen[rank]
        if (report.get("phase") == "walking" and timeout is not None
                and ago < timeout / 2):
            working = True
            parts.append(f"rank {rank} was still making progress ({report.get('where')}, "
                         f"step {report.get('step')}, {ago:.1f} s before {before}) but did "
                         "not reach the collective in time")
        elif report.get("phase") == "walking":
            parts.append(f"rank {rank} stopped making progress at {report.get('where')}, "
                         f"step {report.get('step')} ({ago:.1f} s before {before})")
        else:
            parts.append(progress_text(rank, report, ago, before))
    hint = ("; the work between two collectives must take less than --timeout: raise it"
            if working else "")
    return f"{', '.join(parts)}: {gave_up}{hint}"

