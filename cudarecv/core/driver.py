"""A thread of its own per peer that runs the jobs handed to it, in order (weight sync, same-host links)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from .log import logger
from .shutdown import at_exit, start_thread


class Driver:
    """One thread, started once per peer, that runs what is handed to it, in order.

    gloo reports a receive complete only inside ``Work.wait()``, and a pull has
    steps (header, then payload): a pull hands its transfer here so it progresses
    while the caller acts; a fan-out push hands each receiver's transfer to that
    receiver's driver, so none waits for another. A job is let go of once it ran
    (an idle driver holds no transfer, tensordict or group); one that raises is a
    bug (a transfer keeps its own error): it is logged, and the next job runs.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = start_thread(self._loop, name)
        at_exit(self.stop)  # no thread left inside gloo at interpreter shutdown

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while self._run_next():
            pass

    def _run_next(self) -> bool:
        """Run the next job (its reference ends with this frame); False once told to stop."""
        job = self._jobs.get()
        if job is None:
            return False
        try:
            job()
        except BaseException:  # noqa: BLE001 - logged: the thread goes on with the next job
            logger.exception("%s: a background job failed", self.thread.name)
        return True

    def stop(self, timeout: float) -> None:
        """Let the thread end after what it runs now (waiting up to ``timeout`` s for it; not when called
        on the thread itself). A thread still inside gloo then ends once that wait returns."""
        self._jobs.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)
        if self.thread.is_alive():
            logger.debug("%s still runs a job after stop(%g)", self.thread.name, timeout)
