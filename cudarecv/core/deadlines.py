"""The one thread, ``cudarecv-deadlines``, that fails each transfer whose own time ran out, whether or not anyone
waits for it (so a receive nobody waits for never holds up the link's later transfers)."""

from __future__ import annotations

import heapq
import math
import threading
import time
import weakref
from typing import TYPE_CHECKING

from .log import logger

if TYPE_CHECKING:
    from .transfer import Transfer

#: seconds the exit hook waits for this thread to end
STOP_WAIT = 5.0
#: seconds the thread stays with nothing to watch before it ends (one timed wait, no polling): transfers one after
#: another (a pull every step) keep one thread, not one each
LINGER = 5.0

_PRUNE_MIN = 256


class Deadlines:
    """The thread that fails transfers whose own time ran out, whether or not anyone waits for them.

    It sleeps until the earliest deadline, or at most ``linger`` seconds (a ``Condition`` wait: no
    polling), and holds the transfers weakly. It starts with the first deadline kept, ends once every
    transfer it watches has ended (one collected unended is let go of at its deadline) and ``linger``
    seconds passed with nothing new to watch, and starts again at the next deadline kept; it stops for
    good at exit. Starting and ending are decided under one lock: a deadline kept while the thread is
    deciding to end is either seen by it (it goes on) or finds it gone (a new one starts).

    It is woken only when it must act sooner than it planned: a deadline earlier than the time it
    sleeps until. A transfer that ends does not wake it (it sees that at its next wake-up, within
    ``linger``; with ``linger=0`` an end that leaves nothing to watch wakes it, so that it ends at
    once). A pull or push every few milliseconds, each kept and ended, so costs this thread nothing: it
    was woken twice per transfer before, a scheduler slice each on a loaded machine.
    """

    def __init__(self, linger: float = LINGER) -> None:
        self.linger = linger
        self._heap: list[tuple[float, int, weakref.ref]] = []
        self._count = 0  # a tie-break, so the heap never compares transfers
        self._prune_at = (
            _PRUNE_MIN  # the heap's size at which entries of ended transfers are let go
        )
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._watched: weakref.WeakSet[Transfer] = (
            weakref.WeakSet()
        )  # kept transfers that have not ended
        self._stopped = False
        self._wake_at = (
            -math.inf
        )  # when the thread's wait ends (-inf: it is not waiting, it will look)

    @property
    def thread(self) -> threading.Thread | None:
        """The thread now running, if any (for tests and diagnostics)."""
        with self._cond:
            return self._thread

    def keep(self, transfer: Transfer) -> None:
        """Fail ``transfer`` when its own deadline passes (none: nothing to keep)."""
        deadline = transfer.deadline()
        if deadline == math.inf:
            return
        with self._cond:
            if self._stopped or transfer.settled:
                return  # (one that ended already: its ended() came first, nothing is left to watch)
            self._count += 1
            heapq.heappush(self._heap, (deadline, self._count, weakref.ref(transfer)))
            self._watched.add(transfer)
            if len(self._heap) >= self._prune_at:  # most transfers end long before their deadline
                self._heap = [
                    entry for entry in self._heap if (t := entry[2]()) is not None and not t.settled
                ]
                heapq.heapify(self._heap)
                self._prune_at = max(_PRUNE_MIN, 2 * len(self._heap))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="cudarecv-deadlines", daemon=True
                )
                self._thread.start()
            elif deadline < self._wake_at:
                self._cond.notify()  # the thread sleeps past this deadline

    def ended(self, transfer: Transfer) -> None:
        """``transfer`` has ended: its deadline need not be kept; the thread ends if nothing else is watched."""
        with self._cond:
            if transfer in self._watched:
                self._watched.discard(transfer)
                if not self._watched and self.linger <= 0:
                    self._cond.notify()  # (else it sees that at its next wake-up, within linger)

    def _run(self) -> None:
        while (transfer := self._next()) is not None:
            try:
                transfer.expire()
            except Exception:  # noqa: BLE001 - an error hook's failure must not stop the others' deadlines
                logger.exception("failing %s at its deadline raised", transfer.what)
            del transfer  # no reference from this thread while it sleeps

    def _next(self) -> Transfer | None:
        """The next transfer whose deadline has passed, once it has; None once stopped, or once nothing is watched
        (the thread then ends: under the lock, so that the next :meth:`keep` starts a new one)."""
        with self._cond:
            while not self._stopped:
                if not self._watched:
                    self._heap.clear()  # (entries of ended or collected transfers only)
                    kept = self._count
                    if (
                        self._sleep(self.linger)
                        or self._watched
                        or self._stopped
                        or self._count != kept  # (one kept and ended meanwhile, unwoken: not idle)
                    ):
                        continue  # (told: a deadline kept, or stopped; a spurious wake-up waits again)
                    break
                if not self._heap:
                    self._sleep(math.inf)
                    continue
                deadline, _, ref = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:  # (at most linger: it looks whether it still watches anything)
                    self._sleep(min(left, self.linger) if self.linger > 0 else left)
                    continue
                heapq.heappop(self._heap)
                transfer = ref()
                if transfer is not None and not transfer.settled:
                    return transfer
                if transfer is not None:
                    self._watched.discard(transfer)
            if self._thread is threading.current_thread():
                self._thread = None
            return None

    def _sleep(self, seconds: float) -> bool:
        """Wait (the lock held) up to ``seconds`` for a notify; whether one came."""
        self._wake_at = time.monotonic() + seconds
        try:
            return self._cond.wait(None if seconds == math.inf else seconds)
        finally:
            self._wake_at = -math.inf

    def stop(self) -> None:
        """End the thread (at exit); later deadlines are not kept."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_WAIT)


DEADLINES = Deadlines()
