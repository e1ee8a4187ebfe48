"""The object an asynchronous call returns: a ``torch.futures.Future`` backed by CUDA events.

A transfer is written as a generator (a *protocol*) that posts sends or
receives and yields the ``Work``-like objects the host must see done before it
can go on; it returns the call's result. :class:`Transfer` drives it: the first
step runs at once (so the call has posted its first messages when it returns),
the rest in :meth:`Transfer.wait` or :meth:`Transfer.done`, or on a thread that
drives it to its end.

Two clocks bound a transfer, and only the first can fail it:

- its own ``timeout``, given by its owner (a ``WeightSender`` or
  ``WeightReceiver``): the transfer is then driven from its start on a background
  thread (the owner's, or its own) and the deadline is kept by ``cudarecv-deadlines``
  (below), waited for or not. When it runs out the transfer fails with ``TimeoutError`` and is never advanced again; its works are left to
  run out (parked). No gloo wait is ever given a timeout: when one runs out gloo
  closes *every* link of the process group, not just the late peer's. Without
  an own timeout the process group's timeout applies, as for stock tensordict.
  ``timeout=math.inf`` drives it in the background the same way with no own
  deadline (a standing receive that may wait for as long as the peer likes). A
  protocol may also start its own clock late by yielding :class:`StartClock`
  among its works: a pull waits for a new version for as long as its caller
  likes, and its clock runs from the moment the version starts to arrive.
- a caller's ``wait(timeout)``: when it runs out first, ``wait`` raises
  ``TimeoutError`` and the transfer goes on, as in ``concurrent.futures``; wait
  again, or check :meth:`done`.

One thread, ``cudarecv-deadlines``, fails each transfer whose own time ran out
(it sleeps until the earliest deadline), so a receive nobody waits for never
holds up the link's later transfers.

A thread that waits in gloo's C++ code when the interpreter shuts down aborts
the process (``SIGABRT``, "terminate called without an active exception") once
that wait returns (the peer exiting at the same moment): CPython ends the
thread inside C++ frames. So at exit (an ``atexit`` hook registered when
cudarecv is imported, so it runs after every handler registered later) each
process group on which a thread still waits for a transfer (one that timed
out, was never waited for, or a standing receive) has its links closed (one
gloo wait of 1 ms on it: gloo closes all of a group's links at once, never one),
the waits end with an error, and their threads are joined; a transfer that
would start waiting once the hook has looked fails at once instead (a thread
between two waits then cannot block in gloo again). Groups with no such wait are
not touched; what is closed is logged (logger ``cudarecv``).

Every step of a protocol runs under ``torch.no_grad()``: the bytes cudarecv moves
never join an autograd graph, whatever the leaves require.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import heapq
import math
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, Callable, Generator, Sequence

import torch

from . import streams
from .checks import check_timeout
from .errors import Error, LinkError, TransferTimeout, WaitTimeout
from .link import Link
from .log import logger
from .tags import MAX_TAG
from .transport import park

Protocol = Generator[Sequence[Any], None, Any]
#: rewrites a transfer's error (e.g. to name the peer); gets the error and the seconds since the start
ErrorHook = Callable[[BaseException, float], BaseException]
#: hands a job to a thread its owner keeps (e.g. one per peer)
Submit = Callable[[Callable[[], None]], None]

WIRE, SHARED_MEMORY, CUDA_IPC = "wire", "shared memory", "cuda ipc"  # what carried a payload (Transfer.transport)
_UNBOUNDED = timedelta(days=3650)  # a gloo wait that never runs out (see the module docstring)
#: seconds the exit hook waits (at most, each time) for the waits it ended to leave gloo and for the threads it
#: stops (they end at once unless stuck: a wait that did not end then never will, and the process exits
#: without it; a thread between two waits is no risk, it fails at its next wait: see Transfer.settle)
_EXIT_GRACE = 5.0


class StartClock:
    """A work a protocol yields to start its transfer's own clock now, with ``seconds``.

    Until then a transfer created with ``timeout=math.inf`` has no deadline of its own.

    Example:
        >>> header = yield from read_bytes(...)      # may wait for as long as the caller likes
        >>> yield [StartClock(timeout)]              # the payload must come within timeout
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        return True


class Stage:
    """A work a protocol yields to say what it waits for from now on (what its own timeout names).

    Example:
        >>> yield [Stage("drain of a mismatched payload")]  # a timeout then says so, not "the header"
    """

    def __init__(self, what: str) -> None:
        self.what = what

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        return True


class Transfer(torch.futures.Future):
    """A transfer in flight: a ``torch.futures.Future`` whose value is the received tensordict.

    Returned in a list by ``irecv(return_premature=True)`` and
    ``isend(return_early=True)``. ``wait()`` finishes the transfer; when the
    tensordict is on a GPU it then makes the caller's current stream wait for
    the transfer's CUDA :attr:`event` (the host does not wait for the GPU) and
    returns. ``event`` is ``None`` for transfers that touch no GPU.

    Example:
        >>> [transfer] = cudarecv.irecv(td, src=0, return_premature=True)
        >>> ...  # other work while the bytes travel
        >>> td = transfer.wait()  # the received tensordict (``None`` for a send)
        >>> other_stream.wait_event(transfer.event)  # on a GPU: order another stream too
    """

    def __init__(self, protocol: Protocol, stream: Any = None, on_error: ErrorHook | None = None,
                 timeout: float | None = None, driver: Submit | None = None, link: Link | None = None,
                 raise_first: bool = True, what: str | None = None, route: Any = None) -> None:
        super().__init__()
        self._route = route  # where the payload went, if a same-host transport may take it (:mod:`cudarecv.samehost.sides`)
        #: what the transfer does, for a caller's :class:`WaitTimeout` (e.g. ``"pull from rank 0"``)
        self.what = what or "the transfer" + (f" with rank {link.peer}" if link is not None else "")
        self._protocol = protocol
        self._link = link  # the link its works are on (to release an abandoned wait at exit)
        self._stream = stream
        self._on_error = on_error
        self._driver = driver
        self._works: Sequence[Any] = ()
        self._finished = False
        self.failed = False  # whether the transfer ended in an error
        self._error: BaseException | None = None  # its error (also the C++ future's), without frames
        self._expired = False  # whether it failed by its own timeout (its driver may still wait in gloo)
        self.stage: str | None = None  # what it waits for, if its protocol said (:class:`Stage`)
        self._driving = threading.Lock()  # one thread drives (waits on works) at a time
        self._state = threading.RLock()  # guards every step and the end
        self._settled = threading.Event()  # set once finished or failed
        self._helped = False  # whether a background thread was asked to drive it
        self._helper: threading.Thread | None = None  # the transfer's own thread, if it has one
        self.started = time.monotonic()
        #: the transfer's own time budget in seconds (None: the process group's timeout)
        self.timeout = timeout
        self.event: Any = None
        self._advance(first=True, raise_error=raise_first)
        if timeout is not None:
            self.settle_in_background()  # its clock runs from now: so must its progress

    def _advance(self, first: bool = False, raise_error: bool = False) -> None:
        with self._state:
            if self._finished:
                return  # it ended meanwhile (its own timeout ran out): never step it again
            try:
                with torch.no_grad():
                    self._works = next(self._protocol) if first else self._protocol.send(None)
                for work in self._works:
                    if isinstance(work, StartClock):
                        self.started, self.timeout = time.monotonic(), work.seconds
                        _DEADLINES.keep(self)
                    elif isinstance(work, Stage):
                        self.stage = work.what
            except StopIteration as stop:
                self._works, self._finished = (), True
                if self._stream is not None:
                    self.event = streams.record(self._stream)
                self.set_result(stop.value)
                self._end()
            except BaseException as error:
                self._fail(error)
        if raise_error and self._error is not None:
            raise _again(self._error)  # (not while handling the original: it is the copy's cause or itself)

    def _fail(self, error: BaseException) -> None:
        """End the transfer with ``error`` (as ``on_error`` rewrites it).

        The error is kept without its frames (:func:`_frameless`) and only copies of it are raised
        (:func:`_again`): torch's C++ future, which holds it, is invisible to gc, so a frame there
        would keep this transfer, its tensordict and its process group alive for good.
        """
        with self._state:
            if self._on_error is not None:
                rewritten = self._on_error(error, time.monotonic() - self.started)
                if rewritten is not error:
                    rewritten.__cause__ = error
                error = rewritten
            _frameless(error)
            self._error = error
            # works still in flight are never dropped (gloo would cancel them mid-stream), nor is the
            # protocol closed: its frame holds works posted earlier (a deferred header send)
            park((self._protocol, *self._works))
            self._works, self._finished, self.failed = (), True, True
            self.set_exception(error)
            self._end()

    def _end(self) -> None:
        self._settled.set()
        _BACKGROUND.discard(self)

    def deadline(self) -> float:
        """When the transfer's own time runs out (``time.monotonic()``; inf without one)."""
        timeout = self.timeout
        return math.inf if timeout is None else self.started + timeout

    def _expire(self) -> None:
        """Fail the transfer if its own time ran out (unless it ended just now)."""
        with self._state:
            if not self._finished and time.monotonic() >= self.deadline():
                self._expired = True
                error = TransferTimeout(f"{self.stage or 'the transfer'} did not finish within {self.timeout:g} s")
                error.stage = self.stage  # for an error hook that names what was waited for
                error.in_flight = not all(work.is_completed() for work in self._works)
                self._fail(error)

    @property
    def transport(self) -> str:
        """What carried the payload: ``"wire"`` (the process group's sockets or NCCL), ``"shared memory"``
        or ``"cuda ipc"`` (same-host transports); decided as the transfer runs (final once it ended)."""
        return WIRE if self._route is None else self._route.transport

    def done(self) -> bool:
        """Whether the transfer has finished, advancing it if its pending works report completion.

        As ``torch.futures.Future.done``: on a GPU the transfer's last copies may still run on its stream
        (:attr:`event`); :meth:`wait` orders the caller's stream after them. A receive into host memory has
        waited for its copies before it finished.

        gloo's send/recv works report completion only inside ``wait()``, so a
        multi-step transfer on gloo advances in :meth:`wait` or on a thread that
        drives it (``WeightReceiver.pull(wait=False)`` does so). For the same
        reason ``torch.futures.wait_all``/``collect_all``/``then`` see the
        transfer end only once something waits on it.
        """
        if self.timeout is not None and not self._settled.is_set():
            self.settle_in_background()  # driven there; the deadline is kept by cudarecv-deadlines
        elif self._driving.acquire(blocking=False):
            try:
                while not self._finished and all(w.is_completed() for w in self._works):
                    self._advance()
            finally:
                self._driving.release()
        return self._finished and super().done()

    is_completed = done

    def wait(self, timeout: float | None = None) -> Any:
        """Finish the transfer and return its result (the tensordict of a receive).

        Args:
            timeout: the most seconds this call waits. If it runs out before the
                transfer ends, ``TimeoutError`` is raised and the transfer goes on
                (driven to its end in the background); ``None`` waits for the end,
                which the transfer's own timeout (or the process group's) bounds.

        Raises:
            whatever the transfer raised (a header mismatch, its own timeout, a dead
            peer); a failed transfer raises the same error on every ``wait()``;
            :class:`ArgumentError` for a ``timeout`` that is no number of seconds
            from 0 to :data:`~cudarecv.core.checks.MAX_TIMEOUT` (nothing is waited for then).
        """
        timeout = check_timeout(timeout, or_none=True, or_zero=True)
        if not self._settled.is_set():
            if self.timeout is None and timeout is None:
                self.settle()  # here, bounded by the process group's timeout
            else:
                self._wait_settled(timeout)
        helper = self._helper
        if helper is not None and helper is not threading.current_thread() and not self._expired:
            # its last steps (after the result is set) run in torch's C++ code: a daemon thread still
            # there when the interpreter exits aborts the process, so it ends before wait() returns
            # (one whose time ran out may wait in gloo for good: the exit hook ends that wait)
            helper.join(1.0)
        if self._error is not None:
            raise _again(self._error)
        if self.event is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self.event)
        return super().wait()

    def value(self) -> Any:
        """The result of the ended transfer (as ``torch.futures.Future.value``); raises its error."""
        if self._error is not None:
            raise _again(self._error)
        return super().value()

    def _wait_settled(self, timeout: float | None) -> None:
        """Wait for the end while a background thread drives (its own deadline is kept by
        cudarecv-deadlines, which ends it then); raise :class:`WaitTimeout` past ``timeout``."""
        self.settle_in_background()
        if not self._settled.wait(timeout):
            raise WaitTimeout(f"{self.what} has not finished after {timeout:g} s; it goes on "
                              "(wait again, or check done())")

    @property
    def settled(self) -> bool:
        """Whether the transfer has ended (finished or failed), without advancing it."""
        return self._settled.is_set()

    def ended(self) -> "Ended":
        """A work that completes when this transfer ends, for another protocol to yield."""
        return Ended(self)

    def settle(self) -> None:
        """Drive the transfer to its end on this thread; never raises (the error is the future's)."""
        with self._driving:
            with _EXIT_LOCK:  # (atomic with the exit hook's look at what is driven)
                if _exiting:
                    self._fail_at_exit()
                    return
                _DRIVEN[self] = threading.current_thread()  # what the exit hook ends (see the module docstring)
            try:
                while not self._finished and self._waited():
                    # no frame of this thread holds a work now: the last step sets the result, the waiter
                    # may return and the interpreter exit, and a gloo work freed on a daemon thread after
                    # that re-takes the GIL during shutdown, which aborts the process (SIGABRT)
                    self._advance()
            finally:
                with _EXIT_LOCK:
                    del _DRIVEN[self]

    def _fail_at_exit(self) -> None:
        """The interpreter is shutting down and the exit hook has ended every wait on the process groups: a
        transfer that would start waiting now fails instead (a thread that returned from gloo after the
        interpreter's end would abort the process)."""
        with self._state:
            if not self._finished:
                self._fail(LinkError(f"{self.what} was still waiting when the process exited"))

    def _waited(self) -> bool:
        """Wait for the pending works; False if one failed (the transfer then failed with its error)."""
        try:
            for work in self._works:
                if self.timeout is None:
                    work.wait()
                else:  # the deadline is the waiter's to keep (see the module docstring)
                    work.wait(_UNBOUNDED)
        except BaseException as error:
            with self._state:
                if not self._finished:
                    self._fail(error)
            return False
        return True

    def settle_in_background(self) -> None:
        """Make sure a thread drives the transfer to its end: the owner's driver if it has
        one, else a daemon thread of its own. At most one is ever asked."""
        with self._state:
            if self._helped or self._finished:
                return
            self._helped = True
            _BACKGROUND.add(self)
        _DEADLINES.keep(self)
        if self._driver is not None:
            self._driver(self.settle)
        else:
            self._helper = threading.Thread(target=self.settle, name="cudarecv-transfer", daemon=True)
            self._helper.start()


def _frameless(error: BaseException) -> None:
    """Drop the tracebacks of ``error`` and of every error it was caused by or raised during; one not
    cudarecv's (a bug, gloo's) keeps where it was raised as a note, in text."""
    todo, seen = [error], set()
    while todo:
        item = todo.pop()
        if item is not None and id(item) not in seen:
            seen.add(id(item))
            if item.__traceback__ is not None and not isinstance(item, Error) and hasattr(item, "add_note"):
                frames = "".join(traceback.format_tb(item.__traceback__))
                item.add_note(f"raised at (in cudarecv's transfer):\n{frames}")
            item.__traceback__ = None
            todo += (item.__cause__, item.__context__)


def _again(error: BaseException) -> BaseException:
    """A copy of a transfer's stored ``error`` to raise (its type, message, attributes, cause and context),
    so the stored one never takes on the frames it is raised through."""
    again = copy.copy(error)
    again.__cause__, again.__context__ = error.__cause__, error.__context__
    again.__suppress_context__ = error.__suppress_context__
    return again


class Ended:
    """A work that completes when ``transfer`` ends (see :meth:`Transfer.ended`)."""

    def __init__(self, transfer: Transfer) -> None:
        self.transfer = transfer

    def is_completed(self) -> bool:
        return self.transfer.settled

    def wait(self, timeout: Any = None) -> bool:
        self.transfer.settle()  # drives it here if its own driver has not yet (it may be queued behind us)
        return True


def run_standing(protocol: Protocol, link: Link, stream: Any = None, on_error: ErrorHook | None = None) -> Any:
    """Drive ``protocol`` to its end on this thread with no deadline (a receive that may wait
    for as long as the peer likes) and return its result; raises its error.

    Its gloo waits never time out (see the module docstring) and are ended at exit.
    """
    transfer = Transfer(protocol, stream, on_error=on_error, timeout=math.inf, driver=_here, link=link,
                        raise_first=False)
    transfer.settle()
    return transfer.wait()


def _here(job: Callable[[], None]) -> None:
    """The driver of :func:`run_standing`'s transfers: none, the caller drives them itself."""


_PRUNE_MIN = 256


class _Deadlines:
    """The thread that fails transfers whose own time ran out, whether or not anyone waits for them.

    It sleeps until the earliest deadline (a ``Condition`` wait: no polling) and holds the
    transfers weakly; it starts with the first deadline and stops at exit.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, weakref.ref]] = []
        self._count = 0  # a tie-break, so the heap never compares transfers
        self._prune_at = _PRUNE_MIN  # the heap's size at which entries of ended transfers are let go
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._stopped = False

    def keep(self, transfer: Transfer) -> None:
        """Fail ``transfer`` when its own deadline passes (none: nothing to keep)."""
        deadline = transfer.deadline()
        if deadline == math.inf:
            return
        with self._cond:
            if self._stopped:
                return
            self._count += 1
            heapq.heappush(self._heap, (deadline, self._count, weakref.ref(transfer)))
            if len(self._heap) >= self._prune_at:  # most transfers end long before their deadline
                self._heap = [entry for entry in self._heap if (t := entry[2]()) is not None and not t.settled]
                heapq.heapify(self._heap)
                self._prune_at = max(_PRUNE_MIN, 2 * len(self._heap))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cudarecv-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][1] == self._count:
                self._cond.notify()  # the new deadline is the earliest

    def _run(self) -> None:
        while (transfer := self._next()) is not None:
            try:
                transfer._expire()
            except Exception:  # noqa: BLE001 - an error hook's failure must not stop the others' deadlines
                logger.exception("failing %s at its deadline raised", transfer.what)
            del transfer  # no reference from this thread while it sleeps

    def _next(self) -> Transfer | None:
        """The next transfer whose deadline has passed, once it has (None once stopped)."""
        with self._cond:
            while not self._stopped:
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, _, ref = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
                transfer = ref()
                if transfer is not None and not transfer.settled:
                    return transfer
            return None

    def stop(self) -> None:
        """End the thread (at exit); later deadlines are not kept."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_EXIT_GRACE)


_DEADLINES = _Deadlines()
_DRIVEN: dict = {}  # transfer -> the thread driving it now (in Transfer.settle)
_EXIT_LOCK = threading.Lock()  # guards _DRIVEN's entries and _exiting
_exiting = False  # set by the exit hook: no transfer starts waiting after it looked
_BACKGROUND: set = set()  # transfers handed to a background thread, until they end
_STOPS: list[Callable[[], Callable[[float], None] | None]] = []  # at_exit's, each behind a (weak) reference


def at_exit(stop: Callable[[float], None]) -> None:
    """Have the exit hook call ``stop(seconds)`` once the waits it ends have ended: it ends a thread
    of the caller's (e.g. a driver: ``Driver.stop``) within ``seconds``, so that no thread is left in
    torch's C++ code at shutdown. A bound method is held weakly (its object may go first)."""
    _STOPS[:] = [ref for ref in _STOPS if ref() is not None]
    _STOPS.append(weakref.WeakMethod(stop) if hasattr(stop, "__self__") else lambda: stop)


def _at_exit() -> None:
    """End the gloo waits other threads still block in or are about to, and let those threads
    leave torch's C++ code, before the interpreter shuts down (see the module docstring)."""
    global _exiting
    _DEADLINES.stop()
    me = threading.current_thread()
    with _EXIT_LOCK:  # from now on a transfer that would start waiting fails (Transfer.settle)
        _exiting = True
        stuck = {t for t, thread in _DRIVEN.items() if thread is not me} | set(_BACKGROUND)
    groups: dict[int, list[Transfer]] = {}
    for transfer in stuck:
        if transfer._link is not None and transfer._link.backend == "gloo":
            groups.setdefault(id(transfer._link.pg), []).append(transfer)
    for waiting in groups.values():
        _close_links(waiting)
    end = time.monotonic() + _EXIT_GRACE
    for transfer in stuck:
        if not _left(transfer, end, me):
            logger.warning("at exit: %s still waits after %g s; the process may abort (SIGABRT)",
                           transfer.what, _EXIT_GRACE)
    end = time.monotonic() + _EXIT_GRACE
    for ref in _STOPS:
        stop = ref()
        if stop is not None:
            try:
                stop(max(end - time.monotonic(), 0.0))
            except Exception:  # noqa: BLE001 - the other threads must still be stopped
                logger.exception("at exit: stopping a thread raised")


def _left(transfer: Transfer, end: float, me: threading.Thread) -> bool:
    """Wait until ``end`` for ``transfer`` to end and its driver to leave it; whether both did."""
    def left() -> float:
        return max(end - time.monotonic(), 0.0)

    if not transfer._settled.wait(left()) or not transfer._driving.acquire(timeout=left()):
        return False
    transfer._driving.release()
    helper = transfer._helper
    if helper is not None and helper is not me:
        helper.join(left())
    return True


def _close_links(waiting: list[Transfer]) -> None:
    """Close every link of the gloo group the ``waiting`` transfers wait on (a wait of 1 ms that
    runs out makes gloo close them all), so their waits end with an error."""
    link = waiting[0]._link
    logger.warning("at exit: closing every link of process group %s, where %d transfer(s) still wait: %s",
                   _group_name(link.pg), len(waiting), "; ".join(t.what for t in waiting))
    with contextlib.suppress(Exception):  # the wait runs out: that is the point
        link.pg.recv([torch.zeros(1, dtype=torch.uint8)], link.peer, MAX_TAG).wait(timedelta(milliseconds=1))


def _group_name(pg: Any) -> str:
    """The group's name and this process's rank in it, as far as a group (perhaps destroyed) says."""
    name = type(pg).__name__
    with contextlib.suppress(Exception):
        name = repr(pg.group_name)
    with contextlib.suppress(Exception):
        name += f" (rank {pg.rank()} of {pg.size()})"
    return name


atexit.register(_at_exit)  # at import, so it runs after every handler registered later
