"""Liveness of receivers that joined through a store, whatever they transfer: :class:`Heartbeat` (a receiver's
side) and :class:`Silence` (the sender's).

A receiver that asks for nothing (latest mode, an actor busy elsewhere) sends its sender nothing, so a stopped
one (SIGSTOP, a frozen node) would be served for good. Each joined receiver therefore beats: a thread of its own
adds one to ``g<N>/alive/<k>`` in the store every ``timeout / 4`` s (the sender's ``timeout``, from its record).
At each push the sender reads the counters of the receivers it serves (at most every ``timeout / 4`` s) and
drops one whose counter stood still for ``timeout`` s: logged, named in ``sender.dropped``, never raised. Every
receiver an elastic sender drops (for silence, or a failed transfer) is said in ``g<N>/dropped/<k>``: one that
goes on (it was stopped, then continued) reads that before its next pull and joins again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

from ...core.log import logger
from ...core.shutdown import start_thread
from .directory import Directory, own_client

if TYPE_CHECKING:
    from torch.distributed import Store

#: beats per ``timeout``: a receiver is dropped after about this many missed in a row
BEATS = 4
#: the shortest period between two beats, whatever the sender's record says (a tiny timeout must not spin)
SHORTEST_BEAT = 0.05


class Heartbeat:
    """A joined receiver's beats (see the module docstring): :attr:`dropped` once its sender said it dropped it."""

    def __init__(self, directory: Directory) -> None:
        self.directory = directory
        self.store = own_client(directory.store)
        self.dropped = threading.Event()
        self._joined: tuple[int, int, float] | None = None  # (generation, id, period) beating for
        self._beaten = 0.0  # when it last beat (monotonic)
        self._lock = threading.Lock()  # (a beat's word on a join, and a new join, one at a time)
        self._stop = threading.Event()
        self._thread = start_thread(self._beat_all, f"cudarecv-heartbeat-{directory.name}")

    def follow(self, generation: int, ident: int, timeout: float) -> None:
        """Beat for join ``ident`` of ``generation``, whose sender drops it after ``timeout`` s of no beat, from
        now on (a new join: not dropped)."""
        with self._lock:
            self._joined = (generation, ident, max(timeout / BEATS, SHORTEST_BEAT))
            self.dropped.clear()
        with contextlib.suppress(Exception):  # (a store that fails now: the thread beats again)
            self._beat()

    def said_dropped(self) -> bool:
        """Whether the sender said it dropped the join followed: read at every beat, and here (a pull's) only if
        the last beat is older than a period (this process was stopped: the thread has not beaten since)."""
        joined = self._joined
        if (
            not self.dropped.is_set()
            and joined is not None
            and time.monotonic() - self._beaten > joined[2]
        ):
            with contextlib.suppress(
                Exception
            ):  # (a store that fails: the pull says what became of the sender)
                self._beat(count=False)
        return self.dropped.is_set()

    def _beat_all(self) -> None:
        failing = False
        while not self._stop.wait(self._joined[2] if self._joined is not None else 1.0):
            try:
                self._beat()
            except Exception as error:  # noqa: BLE001 - the store failed (or holds garbage): the next beat tries again
                if not failing:  # (said once per run of failures)
                    logger.warning(
                        "weight receiver of %r: its heartbeat failed (the store?): %s",
                        self.directory.name,
                        error,
                    )
                failing = True
            else:
                failing = False

    def _beat(self, count: bool = True) -> None:
        joined = self._joined
        if joined is None:
            return
        generation, ident, _ = joined
        if count:
            self.store.add(self.directory.alive(generation, ident), 1)
        said = self.store.check([self.directory.dropped(generation, ident)])
        with self._lock:
            if said and self._joined == joined:
                self.dropped.set()
        if count:  # (only now: a pull that sees this beat as recent also sees what it read)
            self._beaten = time.monotonic()

    def close(self, timeout: float) -> None:
        """Stop beating (the thread ends within ``timeout``, or once its store call returns)."""
        self._stop.set()
        self._thread.join(timeout)


class Silence:
    """The sender's watch on its receivers' beats (see the module docstring)."""

    def __init__(self, directory: Directory, generation: int, timeout: float) -> None:
        self.directory, self.generation, self.timeout = directory, generation, timeout
        self._heard: dict[int, tuple[int, float]] = {}  # id -> (its counter, when it last moved)
        self._looked = 0.0

    def silent(self, idents: list[int]) -> list[int]:
        """Of the served receivers ``idents``, those whose beats stood still for ``timeout`` s (read at most
        every ``timeout / BEATS`` s; none in between)."""
        now = time.monotonic()
        if now - self._looked < self.timeout / BEATS:
            return []
        self._looked = now
        silent = []
        for ident in idents:
            count = self.directory.store.add(self.directory.alive(self.generation, ident), 0)
            last = self._heard.get(ident)
            if last is None or count != last[0]:
                self._heard[ident] = (count, now)
            elif now - last[1] > self.timeout:
                silent.append(ident)
        self._heard = {i: h for i, h in self._heard.items() if i in idents}
        return silent

    def said(self, ident: int, store: Store | None = None) -> None:
        """Tell receiver ``ident`` (at its next beat) that it was dropped (through ``store``, a client of the
        directory's store: a thread's own; None: the directory's)."""
        store = self.directory.store if store is None else store
        store.set(self.directory.dropped(self.generation, ident), "1")
