"""Waits on another process of a test (a rank): until it is gone, until it is stopped; how long a subprocess may run."""

from __future__ import annotations

import os
import select
import signal
import time

#: a subprocess's bound (a command the test runs whole: demo, compare, an example): a hang's, not a speed's, just under
#: pytest's own 300 s (pyproject.toml), so that a hang reports the command's output
HANG = 280.0


def stop_here(sig: signal.Signals) -> None:
    """Send this process ``sig`` (SIGKILL or SIGSTOP, from one of its threads, mid-protocol) and never return: the
    kernel stops or kills the process's threads a moment after ``os.kill`` returns (seen: a SIGSTOPped rank's
    thread went on for a pull's whole rest first), and a test that means "stopped here" must not go on meanwhile.
    Once stopped, the test kills it (a SIGCONT would leave it sleeping here until then)."""
    os.kill(os.getpid(), sig)
    while True:
        time.sleep(60)


def wait_gone(pid: int) -> None:
    """Until process ``pid`` has died (its pidfd says so: no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], 60)[0], f"rank pid {pid} did not die within 60 s"
    finally:
        os.close(fd)


def wait_stopped(pid: int) -> None:
    """Until process ``pid`` is stopped (state T in /proc: no event says so, so it is read until then)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"rank pid {pid} never stopped")
