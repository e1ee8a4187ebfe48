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
  thread (the owner's, or its own) and the deadline is kept by whoever waits for it. When it runs out the transfer
  fails with ``TimeoutError`` and is never advanced again; its works are left to
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

A transfer that ran out of its own time leaves its driver thread waiting on gloo
(nothing can cancel a posted gloo send or receive). Were that wait to return
while the interpreter shuts down (the peer exiting at the same moment), CPython
would end the thread inside gloo's C++ frames and the process would abort
(``SIGABRT``). So at exit, before shutdown, the links of such transfers' groups
are closed (by one wait of 1 ms, which makes gloo close them) and the waits end
cleanly. The same holds for standing receives (:meth:`Transfer.release_at_exit`).

Every step of a protocol runs under ``torch.no_grad()``: the bytes cudarecv moves
never join an autograd graph, whatever the leaves require.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Generator, Sequence

import torch

from ._errors import TransferTimeout, WaitTimeout
from ._link import Link
from ._transport import MAX_TAG, park

Protocol = Generator[Sequence[Any], None, Any]
#: rewrites a transfer's error (e.g. to name the peer); gets the error and the seconds since the start
ErrorHook = Callable[[BaseException, float], BaseException]
#: hands a job to a thread its owner keeps (e.g. one per peer)
Submit = Callable[[Callable[[], None]], None]

WIRE, SHARED_MEMORY, CUDA_IPC = "wire", "shared memory", "cuda ipc"  # what carried a payload (Transfer.transport)
_UNBOUNDED = timedelta(days=3650)  # a gloo wait that never runs out (see the module docstring)
_SLICE = 0.1  # seconds between looks at a deadline that may start late (StartClock)


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
        self._route = route  # where the payload went, if a same-host transport may take it (:mod:`._same_host`)
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
            except StopIteration as stop:
                self._works, self._finished = (), True
                if self._stream is not None:
                    self.event = torch.cuda.Event()
                    self.event.record(self._stream)
                self.set_result(stop.value)
                self._settled.set()
            except BaseException as error:
                error = self._fail(error)
                if raise_error:
                    raise error

    def _fail(self, error: BaseException) -> BaseException:
        """End the transfer with ``error`` (as ``on_error`` rewrites it) and return it."""
        with self._state:
            if self._on_error is not None:
                rewritten = self._on_error(error, time.monotonic() - self.started)
                if rewritten is not error:
                    rewritten.__cause__ = error
                error = rewritten
            # works still in flight are never dropped (gloo would cancel them mid-stream), nor is the
            # protocol closed: its frame holds works posted earlier (a deferred header send)
            park((self._protocol, *self._works))
            self._works, self._finished, self.failed = (), True, True
            self.set_exception(error)
            self._settled.set()
            return error

    def _expire(self) -> None:
        """The transfer's own time ran out: fail it (unless it ended just now)."""
        with self._state:
            if not self._finished and time.monotonic() >= self.started + self.timeout:
                self._fail(TransferTimeout(f"the transfer did not finish within {self.timeout:g} s"))
                _abandon(self)

    @property
    def transport(self) -> str:
        """What carried the payload: ``"wire"`` (the process group's sockets or NCCL), ``"shared memory"``
        or ``"cuda ipc"`` (same-host transports); decided as the transfer runs (final once it ended)."""
        return WIRE if self._route is None else self._route.transport

    def done(self) -> bool:
        """Whether the transfer has finished, advancing it if its pending works report completion.

        gloo's send/recv works report completion only inside ``wait()``, so a
        multi-step transfer on gloo advances in :meth:`wait` or on a thread that
        drives it (``WeightReceiver.pull(wait=False)`` does so). For the same
        reason ``torch.futures.wait_all``/``collect_all``/``then`` see the
        transfer end only once something waits on it.
        """
        if self.timeout is not None and not self._settled.is_set():
            self.settle_in_background()  # driven there; the deadline is kept here
            if time.monotonic() >= self.started + self.timeout:
                self._expire()
        elif self._driving.acquire(blocking=False):
            try:
                while not self._finished and all(w.is_completed() for w in self._works):
                    self._advance()
            finally:
                self._driving.release()
        return self._finished and super().done() and (self.event is None or self.event.query())

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
            peer); a failed transfer raises the same error on every ``wait()``.
        """
        if not self._settled.is_set():
            if self.timeout is None and timeout is None:
                self.settle()  # here, bounded by the process group's timeout
            else:
                self._wait_settled(timeout)
        helper = self._helper
        if helper is not None and helper is not threading.current_thread() and self not in _ABANDONED:
            # its last steps (after the result is set) run in torch's C++ code: a daemon thread still
            # there when the interpreter exits aborts the process, so it ends before wait() returns
            helper.join(1.0)
        if self.event is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self.event)
        return super().wait()

    def _wait_settled(self, timeout: float | None) -> None:
        """Wait for the end while a background thread drives; keep the transfer's own deadline
        (looked at again every :data:`_SLICE` s while it may still start: :class:`StartClock`)."""
        self.settle_in_background()
        mine = math.inf if timeout is None else time.monotonic() + timeout
        while True:
            own = math.inf if self.timeout is None else self.started + self.timeout
            step = min(own, mine) - time.monotonic()
            if self.timeout == math.inf:
                step = min(step, _SLICE)
            if self._settled.wait(max(step, 0.0)):
                return
            now = time.monotonic()
            if self.timeout is not None and now >= self.started + self.timeout:
                self._expire()
                return
            if now >= mine:
                raise WaitTimeout(f"{self.what} has not finished after {timeout:g} s; it goes on "
                                  "(wait again, or check done())")

    @property
    def settled(self) -> bool:
        """Whether the transfer has ended (finished or failed), without advancing it."""
        return self._settled.is_set()

    def ended(self) -> "Ended":
        """A work that completes when this transfer ends, for another protocol to yield."""
        return Ended(self)

    def release_at_exit(self) -> None:
        """Have the exit hook end this transfer's gloo wait if it still blocks at interpreter exit
        (a standing receive: see the module docstring)."""
        _abandon(self)

    def settle(self) -> None:
        """Drive the transfer to its end on this thread; never raises (the error is the future's)."""
        try:
            self._settle()
        finally:
            _ABANDONED.discard(self)

    def _settle(self) -> None:
        with self._driving:
            while not self._finished and self._waited():
                # no frame of this thread holds a work now: the last step sets the result, the waiter
                # may return and the interpreter exit, and a gloo work freed on a daemon thread after
                # that re-takes the GIL during shutdown, which aborts the process (SIGABRT)
                self._advance()

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
        if self._driver is not None:
            self._driver(self.settle)
        else:
            self._helper = threading.Thread(target=self.settle, name="cudarecv-transfer", daemon=True)
            self._helper.start()


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

    Its gloo waits never time out (see the module docstring) and are released at exit.
    """
    transfer = Transfer(protocol, stream, on_error=on_error, timeout=math.inf, driver=_here, link=link,
                        raise_first=False)
    transfer.release_at_exit()
    transfer.settle()
    return transfer.wait()


def _here(job: Callable[[], None]) -> None:
    """The driver of :func:`run_standing`'s transfers: none, the caller drives them itself."""


_ABANDONED: set = set()  # transfers whose driver may still wait in gloo at exit (removed once settled)
_HOOKED = threading.Event()


def _abandon(transfer: Transfer) -> None:
    if transfer._link is None or transfer._link.backend != "gloo" or transfer._settled.is_set():
        return  # only a thread inside gloo's C++ wait aborts the process at shutdown
    if not _HOOKED.is_set():
        _HOOKED.set()
        atexit.register(_release_abandoned)
    _ABANDONED.add(transfer)


def _release_abandoned() -> None:
    """At exit: end the gloo waits still blocked on abandoned transfers (see the module docstring)."""
    stuck = [t for t in list(_ABANDONED) if t._driving.locked()]
    groups = {id(t._link.pg): t._link for t in stuck}
    for link in groups.values():  # a wait that times out makes gloo close every link of its group
        with contextlib.suppress(Exception):
            link.pg.recv([torch.zeros(1, dtype=torch.uint8)], link.peer, MAX_TAG).wait(timedelta(milliseconds=1))
    deadline = time.monotonic() + 1.0
    for transfer in stuck:
        if transfer._driving.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            transfer._driving.release()
