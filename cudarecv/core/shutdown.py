"""The exit hook: before the interpreter shuts down, end the gloo waits cudarecv's threads still block in,
and let those threads leave torch's C++ code.

A thread that waits in gloo's C++ code when the interpreter shuts down aborts the process (``SIGABRT``,
"terminate called without an active exception") once that wait returns (the peer exiting at the same
moment): CPython ends the thread inside C++ frames. So at exit (an ``atexit`` hook registered when cudarecv is
imported, so it runs after every handler registered later) each process group on which a thread still waits
for a transfer (one that timed out, was never waited for, or a standing receive) has its links closed (one
gloo wait of 1 ms on it: gloo closes all of a group's links at once, never one), the waits end with an
error, and their threads are joined; a transfer that would start waiting once the hook has looked fails at
once instead (:func:`driving`). Groups with no such wait are not touched; what is closed is logged.

Then every thread cudarecv started (:func:`start_thread`) is joined, whether or not its owner still exists (a
sender never closed is often collected before exit while its listeners run): a thread that still runs Python
code when the interpreter finalizes aborts the process the moment it frees a gloo work (torch releases the GIL
in that destructor, and re-taking it then ends the thread inside C++).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .deadlines import DEADLINES
from .log import logger
from .tags import MAX_TAG

if TYPE_CHECKING:
    from .transfer import Transfer

#: seconds the exit hook waits (at most, each time) for the waits it ended to leave gloo and for the threads it
#: stops (they end at once unless stuck: a wait that did not end then never will, and the process exits
#: without it; a thread between two waits is no risk, it fails at its next wait: :func:`driving`)
GRACE = 5.0
_DRIVEN: dict = {}  # transfer -> the thread driving it now (in Transfer.settle)
_LOCK = threading.Lock()  # guards _DRIVEN's entries and _exiting
_exiting = False  # set by the exit hook: no transfer starts waiting after it looked
_BACKGROUND: set = set()  # transfers handed to a background thread, until they end
_STOPS: list[
    Callable[[], Callable[[float], None] | None]
] = []  # at_exit's, each behind a (weak) reference
_THREADS: weakref.WeakSet[threading.Thread] = (
    weakref.WeakSet()
)  # start_thread's (a running one is referenced)


@contextlib.contextmanager
def driving(transfer: Transfer) -> Iterator[bool]:
    """While ``transfer`` is driven on this thread (its gloo waits are the exit hook's to end); yields False
    once the hook has looked (the transfer must not start waiting: it fails instead)."""
    with _LOCK:  # (atomic with the exit hook's look at what is driven)
        if _exiting:
            yield False
            return
        _DRIVEN[transfer] = threading.current_thread()
    try:
        yield True
    finally:
        with _LOCK:
            del _DRIVEN[transfer]


def exiting() -> bool:
    """Whether the exit hook has looked: from then on nothing may start waiting on a link (a thread that wakes
    then, e.g. from a doorbell the hook's closing of the links rang, must fail instead of starting a transfer that
    no driver will run any more)."""
    return _exiting


def in_background(transfer: Transfer) -> None:
    """``transfer`` is handed to a background thread (the hook waits for it at exit)."""
    _BACKGROUND.add(transfer)


def ended(transfer: Transfer) -> None:
    """``transfer`` has ended: no background thread drives it any more."""
    _BACKGROUND.discard(transfer)


def at_exit(stop: Callable[[float], None]) -> None:
    """Have the exit hook call ``stop(seconds)`` once the waits it ends have ended: it ends a thread of the
    caller's (e.g. a driver: ``Driver.stop``) within ``seconds``, so that no thread is left in torch's C++ code
    at shutdown. A bound method is held weakly (its object may go first)."""
    _STOPS[:] = [ref for ref in _STOPS if ref() is not None]
    _STOPS.append(weakref.WeakMethod(stop) if hasattr(stop, "__self__") else lambda: stop)


def start_thread(target: Callable[..., object], name: str, args: tuple = ()) -> threading.Thread:
    """Start a daemon thread running ``target(*args)`` that cudarecv's exit hook joins (bounded) once it has
    ended the gloo waits still blocked: for a thread of yours that calls cudarecv (e.g. one that pulls every
    next version), so that it does not free a gloo work while the interpreter finalizes (see the module
    docstring). Every thread cudarecv itself starts is one.

    Example:
        >>> def take_versions():
        ...     while True:
        ...         receiver.pull()
        >>> start_thread(take_versions, "actor-weights")  # from cudarecv.core.shutdown
    """
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    _THREADS.add(thread)
    thread.start()
    return thread


def _at_exit() -> None:
    """End the gloo waits other threads still block in or are about to, and let those threads leave torch's
    C++ code, before the interpreter shuts down (see the module docstring)."""
    global _exiting
    DEADLINES.stop()
    me = threading.current_thread()
    with _LOCK:  # from now on a transfer that would start waiting fails (driving)
        _exiting = True
        stuck = {t for t, thread in _DRIVEN.items() if thread is not me} | set(_BACKGROUND)
    groups: dict[int, list[Transfer]] = {}
    for transfer in stuck:
        if transfer.link is not None and transfer.link.backend == "gloo":
            groups.setdefault(id(transfer.link.pg), []).append(transfer)
    for waiting in groups.values():
        _close_links(waiting)
    end = time.monotonic() + GRACE
    for transfer in stuck:
        if not transfer.left_by(end, me):
            logger.warning(
                "at exit: %s still waits after %g s; the process may abort (SIGABRT)",
                transfer.what,
                GRACE,
            )
    end = time.monotonic() + GRACE
    for ref in _STOPS:
        stop = ref()
        if stop is not None:
            try:
                stop(max(end - time.monotonic(), 0.0))
            except Exception:  # noqa: BLE001 - the other threads must still be stopped
                logger.exception("at exit: stopping a thread raised")
    end = time.monotonic() + GRACE
    for thread in list(_THREADS):
        if thread is not me and thread.is_alive():
            thread.join(max(end - time.monotonic(), 0.0))
            if thread.is_alive():
                logger.warning(
                    "at exit: thread %s still runs after %g s; the process may abort (SIGABRT)",
                    thread.name,
                    GRACE,
                )


def _close_links(waiting: list[Transfer]) -> None:
    """Close every link of the gloo group the ``waiting`` transfers wait on (a wait of 1 ms that runs out makes
    gloo close them all), so their waits end with an error."""
    link = waiting[0].link
    assert link is not None  # (grouped by their links' group)
    logger.warning(
        "at exit: closing every link of process group %s, where %d transfer(s) still wait: %s",
        _group_name(link.pg),
        len(waiting),
        "; ".join(t.what for t in waiting),
    )
    with contextlib.suppress(Exception):  # the wait runs out: that is the point
        link.pg.recv([torch.zeros(1, dtype=torch.uint8)], link.peer, MAX_TAG).wait(
            timedelta(milliseconds=1)
        )


def _group_name(pg: dist.ProcessGroup) -> str:
    """The group's name and this process's rank in it, as far as a group (perhaps destroyed) says."""
    name = type(pg).__name__
    with contextlib.suppress(Exception):
        name = repr(pg.group_name)
    with contextlib.suppress(Exception):
        name += f" (rank {pg.rank()} of {pg.size()})"
    return name


atexit.register(_at_exit)  # at import, so it runs after every handler registered later
