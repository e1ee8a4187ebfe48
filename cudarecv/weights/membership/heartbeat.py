"""Liveness of receivers that joined through a store, whatever they transfer: :class:`Heartbeat` (a receiver's
side) and :class:`Silence` (the sender's).

A receiver that asks for nothing (latest mode, an actor busy elsewhere) sends its sender nothing, so a stopped
one (SIGSTOP, a frozen node) would be served for good. Each joined receiver therefore beats: a thread of its own
adds one to ``g<N>/alive/<k>`` in the store every ``timeout / 4`` s. At each push the sender reads the counters
of the receivers it serves (at most every ``timeout / 4`` s) and drops one whose counter stood still for
``timeout`` s: logged, named in ``sender.dropped``, never raised, and said in ``g<N>/dropped/<k>``. A dropped
receiver that goes on (it was stopped, then continued) reads that at its next beat and joins again on its next
pull.
"""

from __future__ import annotations

import threading
import time

from ...core.log import logger
from ...core.shutdown import start_thread
from .directory import Directory, own_client

#: beats per ``timeout``: a receiver is dropped after about this many missed in a row
BEATS = 4


class Heartbeat:
    """A joined receiver's beats (see the module docstring): :attr:`dropped` once its sender said it dropped it."""

    def __init__(self, directory: Directory, timeout: float) -> None:
        self.directory, self.period = directory, timeout / BEATS
        self.store = own_client(directory.store)
        self.joined: tuple[int, int] | None = None  # (generation, id) beating for
        self.dropped = threading.Event()
        self._stop = threading.Event()
        self._thread = start_thread(self._beat_all, f"cudarecv-heartbeat-{directory.name}")

    def follow(self, generation: int, ident: int) -> None:
        """Beat for join ``ident`` of ``generation`` from now on (a new join: not dropped)."""
        self.joined = (generation, ident)
        self.dropped.clear()
        self._beat()

    def _beat_all(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._beat()
            except Exception as error:  # noqa: BLE001 - the store is gone: the sender is, too; the pulls say so
                logger.info("weight receiver of %r: its heartbeat stops, the store failed: %s",
                            self.directory.name, error)
                return

    def _beat(self) -> None:
        joined = self.joined
        if joined is None:
            return
        self.store.add(self.directory.alive(*joined), 1)
        if self.store.check([self.directory.dropped(*joined)]) and self.joined == joined:
            self.dropped.set()

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

    def said(self, ident: int) -> None:
        """Tell receiver ``ident`` (at its next beat) that it was dropped."""
        self.directory.store.set(self.directory.dropped(self.generation, ident), "1")
