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
  thread (the owner's, or its own) and the deadline is kept by ``cudarecv-deadlines``,
  waited for or not. When it runs out the transfer fails with ``TimeoutError`` and is never advanced again; its works are left to
  run out (parked). No gloo wait is given a timeout (when one runs out gloo
  closes *every* link of the process group, not just the late peer's), except on a
  bounded pair (an elastic sender's with one receiver), where the wait ends a little past the deadline. Without
  an own timeout the process group's timeout applies, as for stock tensordict.
  ``timeout=math.inf`` drives it in the background the same way with no own
  deadline (a standing receive that may wait for as long as the peer likes). A
  protocol may also start its own clock late by yielding :class:`StartClock`
  among its works: a pull waits for a new version for as long as its caller
  likes, and its clock runs from the moment the version starts to arrive.
- a caller's ``wait(timeout)``: when it runs out first, ``wait`` raises
  ``TimeoutError`` and the transfer goes on, as in ``concurrent.futures``; wait
  again, or check :meth:`done`.

Each transfer whose own time ran out is failed by one thread (:mod:`cudarecv.core.deadlines`), so a
receive nobody waits for never holds up the link's later transfers; the waits still blocked at interpreter
exit are ended by :mod:`cudarecv.core.shutdown`.

Every step of a protocol runs under ``torch.no_grad()``: the bytes cudarecv moves
never join an autograd graph, whatever the leaves require.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import typing
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch

from . import shutdown, streams
from .checks import check_timeout
from .deadlines import DEADLINES
from .errors import LinkError, TransferTimeout, WaitTimeout
from .groups import bounded
from .link import Link
from .log import logger
from .protocol import ErrorHook, Protocol, Stage, StartClock, Submit, Work, again, frameless
from .transport import park

#: what carried a payload (:attr:`Transfer.transport`): the process group's sockets or NCCL, or a same-host
#: transport
Route = Literal["wire", "shared memory", "cuda ipc"]
WIRE: Route = "wire"
SHARED_MEMORY: Route = "shared memory"
CUDA_IPC: Route = "cuda ipc"


class Carrier(typing.Protocol):
    """Where a transfer's payload went, as a same-host transport decides while it runs
    (:class:`cudarecv.samehost.policy.Carried`)."""

    transport: Route


_UNBOUNDED = timedelta(days=3650)  # a gloo wait that never runs out (see the module docstring)
BOUNDED_GRACE = 1.0  # seconds a gloo wait on a bounded pair lasts past its transfer's deadline


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

    def __init__(
        self,
        protocol: Protocol,
        stream: torch.cuda.Stream | None = None,
        on_error: ErrorHook | None = None,
        timeout: float | None = None,
        driver: Submit | None = None,
        link: Link | None = None,
        raise_first: bool = True,
        what: str | None = None,
        route: Carrier | None = None,
        lazy: bool = False,
        on_end: Callable[[Transfer], None] | None = None,
    ) -> None:
        """``on_end``: called with the transfer once it has ended (finished or failed), on the thread that ended it,
        whichever that is, holding the transfer's own lock (it may take locks that are never held while taking
        that one); what it raises is logged.

        ``lazy``: after its first step (run here, as always) nothing drives the transfer until something needs
        its end: a ``wait()`` or ``done()`` (which finish it on the caller's thread once its works have completed,
        else hand it to ``driver``), a done-callback or ``then()`` (handed to ``driver`` at once), or its deadline
        (finished then if its works have completed, else failed). For a transfer whose last step only reads a word
        that comes by itself (a doorbell's): no thread is woken for it while its caller computes."""
        if lazy and timeout is None:
            raise ValueError(
                "a lazy transfer needs a timeout: its deadline ends it if nothing else does"
            )
        super().__init__()
        self._route = route  # where the payload went, if a same-host transport may take it (:mod:`cudarecv.samehost.sides`)
        #: what the transfer does, for a caller's :class:`WaitTimeout` (e.g. ``"pull from rank 0"``)
        self.what = what or "the transfer" + (f" with rank {link.peer}" if link is not None else "")
        self._protocol = protocol
        self._link = link  # the link its works are on (to release an abandoned wait at exit)
        self._stream = stream
        self._on_error = on_error
        self._on_end = on_end
        self._driver = driver
        self._works: Sequence[Work] = ()
        self._finished = False
        self.failed = False  # whether the transfer ended in an error
        self._error: BaseException | None = (
            None  # its error (also the C++ future's), without frames
        )
        self._expired = (
            False  # whether it failed by its own timeout (its driver may still wait in gloo)
        )
        #: what it waits for, if its protocol said (:class:`Stage`: a string, or an object whose ``str()`` says it
        #: as the transfer goes on, e.g. which payload message); a failure names it
        self.stage: object = None
        self._driving = threading.Lock()  # one thread drives (waits on works) at a time
        self._state = threading.RLock()  # guards every step and the end
        self._settled = threading.Event()  # set once finished or failed
        self._helped = False  # whether a background thread was asked to drive it
        self._lazy = lazy  # nothing drives it until its end is needed (see above)
        self._helper: threading.Thread | None = None  # the transfer's own thread, if it has one
        self.started = time.monotonic()
        #: the transfer's own time budget in seconds (None: the process group's timeout)
        self.timeout = timeout
        self.event: torch.cuda.Event | None = None
        self._advance(first=True, raise_error=raise_first)
        if timeout is not None and lazy:
            DEADLINES.keep(self)  # its clock runs from now: its deadline finishes or fails it
        elif timeout is not None:
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
                        self.started, self.timeout = time.monotonic(), work.timeout
                        DEADLINES.keep(self)
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
            raise again(
                self._error
            )  # (not while handling the original: it is the copy's cause or itself)

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
            frameless(error)
            self._error = error
            # works still in flight are never dropped (gloo would cancel them mid-stream), nor is the
            # protocol closed: its frame holds works posted earlier (a deferred header send)
            park((self._protocol, *self._works), None if self._link is None else self._link.pg)
            self._works, self._finished, self.failed = (), True, True
            self.set_exception(error)
            self._end()

    def _end(self) -> None:
        self._settled.set()
        shutdown.ended(self)
        if self.timeout is not None:
            DEADLINES.ended(self)  # (its thread ends once it watches nothing)
        if self._on_end is not None:
            # (a bug in the hook is said, never raised into whoever ended the transfer)
            try:
                self._on_end(self)
            except Exception:
                logger.exception("cudarecv: the end hook of %s failed", self.what)

    def deadline(self) -> float:
        """When the transfer's own time runs out (``time.monotonic()``; inf without one)."""
        timeout = self.timeout
        return math.inf if timeout is None else self.started + timeout

    def expire(self) -> None:
        """Fail the transfer if its own time ran out (unless it ended just now); a lazy one whose works have all
        completed is finished instead (what it waited for came, and nobody asked for its end yet)."""
        if self._catch_up():
            return
        with self._state:
            if not self._finished and time.monotonic() >= self.deadline():
                self._expired = True
                stage = None if self.stage is None else str(self.stage)  # (as it stands now)
                error = TransferTimeout(
                    f"{stage or 'the transfer'} did not finish within {self.timeout:g} s"
                )
                error.stage = stage  # for an error hook that names what was waited for
                error.in_flight = not all(work.is_completed() for work in self._works)
                self._fail(error)

    def abort(self, error: BaseException) -> None:
        """Fail the transfer now with ``error`` (unless it ended already): another thread found its link dead, so
        its works may never complete (gloo does not always fail a posted send when its peer dies). As when its own
        time runs out, its works are parked and a thread still waiting in one is left there; ``on_error`` rewrites
        ``error``."""
        with self._state:
            if not self._finished:
                self._expired = True  # (its driver may still wait in gloo: wait() does not join it)
                self._fail(error)

    @property
    def transport(self) -> Route:
        """What carried the payload: ``"wire"`` (the process group's sockets or NCCL), ``"shared memory"``
        or ``"cuda ipc"`` (same-host transports); decided as the transfer runs (final once it ended)."""
        return WIRE if self._route is None else self._route.transport

    def done(self) -> bool:
        """Whether the transfer has finished (as ``torch.futures.Future.done``: on a GPU its last copies may still
        run on its stream, :attr:`event`; a receive into host memory waited for them), advancing it if its works
        report completion. gloo reports a send or receive complete only inside ``wait()``: a multi-step transfer
        on gloo advances in :meth:`wait` or on a thread that drives it, and ``torch.futures.wait_all``,
        ``collect_all`` and ``then`` see it end only once something waits on it."""
        if self._settled.is_set() or self._helped:
            pass  # ended, or driven by the thread it was handed to (which keeps its link's order): never here
        elif self._lazy:
            self._catch_up()  # here, if what it waits for came (no thread is asked: a poll stays a poll)
        elif self.timeout is not None:
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

        ``timeout``: the most seconds this call waits (0 to :data:`~cudarecv.core.checks.MAX_TIMEOUT`, else
        :class:`ArgumentError`); past it :class:`WaitTimeout` is raised and the transfer goes on (driven to its end
        in the background); ``None`` waits for the end, which its own timeout (or the group's) bounds. Raises what
        the transfer raised (a header mismatch, its own timeout, a dead peer), the same on every ``wait()``.
        A transfer handed to a thread (its own, or its link's: a same-host link takes its transfers one at a time,
        in call order) is only waited for here, never driven: driven here it would post out of its turn.
        """
        timeout = check_timeout(timeout, or_none=True, or_zero=True)
        # (a wait that lasts at least until the transfer's own deadline drives it here: bounded by that deadline)
        self._catch_up(waiting=timeout is None or self.deadline() <= time.monotonic() + timeout)
        if not self._settled.is_set():
            if self.timeout is None and timeout is None and not self._helped:
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
            raise again(self._error)
        if (
            self.event is not None and self._stream is not None
        ):  # (an event: recorded on the stream)
            torch.cuda.current_stream(self._stream.device).wait_event(self.event)
        return super().wait()

    def value(self) -> Any:
        """The result of the ended transfer (as ``torch.futures.Future.value``); raises its error."""
        if self._error is not None:
            raise again(self._error)
        return super().value()

    def _catch_up(self, waiting: bool = False) -> bool:
        """A lazy transfer nobody drives yet whose works have all completed: finish it on this thread (its last
        step only reads what came: it does not block); ``waiting`` (a wait that lasts until the transfer's
        deadline): also one still waiting, here rather than on another thread (bounded by its works' own
        deadline). Not waiting, it leaves one another thread drives now alone. Whether it drove it."""
        if not self._lazy:
            return False
        with self._state:
            ready = (
                not self._helped
                and not self._finished
                and (waiting or all(w.is_completed() for w in self._works))
            )
        if not ready:
            return False
        if not waiting:
            if not self._driving.acquire(blocking=False):
                return False  # (another thread drives it: its end is that thread's)
            self._driving.release()
        self.settle()
        return True

    def finish_lazy(self) -> None:
        """A lazy transfer nothing drove yet: drive it to its end on this thread (bounded by its own deadline);
        any other transfer: nothing (its own driver ends it)."""
        self._catch_up(waiting=True)

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        """As ``torch.futures.Future``'s; a lazy transfer is then handed to its driver, so the callback runs when
        it ends, not when something next waits for it."""
        if self._lazy:
            self.settle_in_background()
        super().add_done_callback(callback)

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
        """As ``torch.futures.Future``'s (a lazy transfer is handed to its driver, as for a done-callback)."""
        if self._lazy:
            self.settle_in_background()
        return super().then(callback)

    def _wait_settled(self, timeout: float | None) -> None:
        """Wait for the end while a background thread drives (its own deadline is kept by
        cudarecv-deadlines, which ends it then); raise :class:`WaitTimeout` past ``timeout``."""
        self.settle_in_background()
        if not self._settled.wait(timeout):
            raise WaitTimeout(
                f"{self.what} has not finished after {timeout:g} s; it goes on "
                "(wait again, or check done())"
            )

    @property
    def settled(self) -> bool:
        """Whether the transfer has ended (finished or failed), without advancing it."""
        return self._settled.is_set()

    @property
    def decided(self) -> bool:
        """Whether the transfer's end is decided (its result or error set), without advancing it. Its
        done-callbacks run after that and :attr:`settled` after them: a callback that wakes a thread which
        then looks at the transfer sees it decided, not necessarily settled."""
        return self._finished

    @property
    def link(self) -> Link | None:
        """The link its works are on (the exit hook closes it if the transfer still waits at exit)."""
        return self._link

    def left_by(self, end: float, me: threading.Thread) -> bool:
        """Wait until ``end`` (``time.monotonic()``) for the transfer to end and its driver (if not ``me``) to
        leave it; whether both did (the exit hook's wait)."""

        def left() -> float:
            return max(end - time.monotonic(), 0.0)

        if not self._settled.wait(left()) or not self._driving.acquire(timeout=left()):
            return False
        self._driving.release()
        helper = self._helper
        if helper is not None and helper is not me:
            helper.join(left())
        return True

    def turn(self) -> Turn:
        """A work that completes when this transfer ends, for the next transfer on its :class:`~cudarecv.core.turns.Line`
        to wait on before it posts anything."""
        return Turn(self)

    def ended(self, drive: bool = True) -> Ended:
        """A work that completes when this transfer ends, for another protocol to yield (``drive=False``: its
        wait never drives it on the waiter's thread, so a wait in gloo that outlives its deadline holds only
        the transfer's own driver)."""
        return Ended(self, drive)

    def settle(self) -> None:
        """Drive the transfer to its end on this thread; never raises (the error is the future's)."""
        with (
            self._driving,
            shutdown.driving(self) as may_wait,
        ):  # (its waits are the exit hook's to end)
            if (
                not may_wait
            ):  # the exit hook has ended the waits: a thread back from gloo after it would abort
                with self._state:
                    if not self._finished:
                        self._fail(
                            LinkError(f"{self.what} was still waiting when the process exited")
                        )
                return
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
                    work.wait(self._gloo_bound())
        except BaseException as error:
            with self._state:
                if not self._finished:
                    _note_stage(error, self.stage)
                    self._fail(error)
            return False
        return True

    def _gloo_bound(self) -> timedelta:
        """How long a gloo wait of this transfer may last: for ever (when a wait runs out gloo closes every link of
        the group, not just the late peer's), except on a bounded pair (:func:`~.groups.bounded`): there, until a
        little past the transfer's own deadline, by when it has failed anyway. gloo may leave a send to a peer that
        died waiting for good (its links closed, the group aborted or not); that bound frees the thread, which
        nothing else can."""
        deadline = self.deadline()
        if self._link is None or not math.isfinite(deadline) or not bounded(self._link.pg):
            return _UNBOUNDED
        return timedelta(seconds=max(deadline - time.monotonic(), 0.0) + BOUNDED_GRACE)

    def settle_in_background(self) -> None:
        """Make sure a thread drives the transfer to its end: the owner's driver if it has
        one, else a daemon thread of its own. At most one is ever asked."""
        with self._state:
            if self._helped or self._finished:
                return
            self._helped = True
            shutdown.in_background(self)
        DEADLINES.keep(self)
        if self._driver is not None:
            self._driver(self.settle)
        else:
            self._helper = shutdown.start_thread(self.settle, "cudarecv-transfer")


class Ended:
    """A work that completes when ``transfer`` ends (see :meth:`Transfer.ended`)."""

    def __init__(self, transfer: Transfer, drive: bool = True) -> None:
        self.transfer, self.drive = transfer, drive

    def is_completed(self) -> bool:
        return self.transfer.settled

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.drive:
            self.transfer.settle()  # drives it here if its own driver has not yet (it may be queued behind us)
        else:
            self.transfer._settled.wait()  # (its driver drives it; its deadline ends it)
        return True


class Turn:
    """A work that completes when ``transfer`` ends (see :meth:`Transfer.turn`).

    Its wait drives the transfer on the waiter's thread while no thread was asked to (it may have been posted on
    this thread and not waited for yet: waiting for it there would wait for good); a transfer handed to a thread is
    only waited for, as that thread keeps its link's order (a same-host link's one thread takes its receives in call
    order). Its own deadline, or the process group's timeout, bounds either wait."""

    def __init__(self, transfer: Transfer) -> None:
        self.transfer = transfer

    def is_completed(self) -> bool:
        return self.transfer.settled

    def wait(self, timeout: timedelta | None = None) -> bool:
        transfer = self.transfer
        if not transfer._helped:
            transfer.settle()  # (waits for the lock while another thread drives it)
        transfer._settled.wait()
        return True


def _note_stage(error: BaseException, stage: object) -> None:
    """Say on a failed wait's ``error`` (the backend's) the stage it struck in, as ``error.stage`` (a string), for
    the transfer's error hook: a peer that died mid-payload is then named there, not at the header."""
    if stage is None or getattr(error, "stage", None) is not None:
        return
    # (an exception type that takes no attributes: the hook names the call)
    with contextlib.suppress(AttributeError, TypeError):
        error.stage = str(stage)  # type: ignore[attr-defined]


def run_standing(
    protocol: Protocol,
    link: Link,
    stream: torch.cuda.Stream | None = None,
    on_error: ErrorHook | None = None,
) -> Any:
    """Drive ``protocol`` to its end on this thread with no deadline (a receive that may wait
    for as long as the peer likes) and return its result; raises its error.

    Its gloo waits never time out (see the module docstring) and are ended at exit.
    """
    transfer = Transfer(
        protocol,
        stream,
        on_error=on_error,
        timeout=math.inf,
        driver=here,
        link=link,
        raise_first=False,
    )
    transfer.settle()
    return transfer.wait()


def here(job: Callable[[], None]) -> None:
    """The driver of a transfer that its creator drives itself, on its own thread, with :meth:`Transfer.settle`
    (:func:`run_standing`'s; a latest-mode reply on its receiver's thread): none is asked to."""
