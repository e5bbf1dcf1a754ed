"""The fork guard every rank installs (sharddemo.rank.collect.guard_forks, docs/reliability.md).

The hang it prevents is a race (benchmarks/fork_after_collective.py reproduces it in about a
minute of back-to-back epochs), too slow and too random for the suite; what is tested here is
that the guard is really in place where it must be: a fork in a process that built sharddemo's
Accelerator waits first, and one in a process that did not, does not.
"""

import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import os, sys, time
    if sys.argv[1] == "guarded":
        from sharddemo.rank.session import make_accelerator
        make_accelerator("cpu", 30)
    waits = []
    for _ in range(5):
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        waits.append(time.perf_counter() - start)  # the parent's os.fork() call, hooks included
        os.waitpid(pid, 0)
    print(min(waits))
""")


def _fork_wait(how: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True,
                         timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython 3.12 fixed the fork race")
def test_a_rank_pauses_before_every_fork():
    # FORK_PAUSE_S is 5 ms: time.sleep never returns early, so every fork takes at least that.
    assert _fork_wait("guarded") >= 0.005


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython 3.12 fixed the fork race")
def test_a_process_that_watches_a_loader_pauses_before_every_fork():
    """sharddemo.watch in a user's training: its exchanges come at an epoch's end, right before
    the next epoch's iter() forks the loader's workers (a CI run hung there: 3 ranks, 2 workers,
    the second epoch's fork), so watch() installs the same pause."""
    # (counted, not timed: a fork of a process that imported torch can take 5 ms by itself)
    probe = textwrap.dedent("""
        import os, sys, time
        from torch.utils.data import DataLoader
        if sys.argv[1] == "watched":
            import sharddemo
            sharddemo.watch(DataLoader(range(4), batch_size=2))
        pauses = []
        time.sleep = pauses.append  # what the hook sleeps, noted instead
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        print(pauses)
    """)
    def pauses(how):
        return subprocess.run([sys.executable, "-c", probe, how], capture_output=True,
                              text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    assert pauses("watched") == "[0.005, 0.005, 0.005]"  # FORK_PAUSE_S before each of 3 forks
    assert pauses("plain") == "[]"


def test_a_plain_process_does_not():
    # Without the hook a fork of this small process takes well under 5 ms (about 1 ms here).
    assert _fork_wait("plain") < 0.005
