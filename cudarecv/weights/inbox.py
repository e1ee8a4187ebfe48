"""A weight receiver's link to its sender, message by message: the sender's headers (on gloo a header receive
is always posted, so a sender that closes is heard at once, even between pulls; on NCCL, which runs a pair's
messages in order, a pull posts its own) and this receiver's words (ASK, GOT, FREED, BYE), kept until the
sender shows it took them.

A receiver that reads the sender's shared snapshots offers a doorbell (:mod:`cudarecv.samehost.doorbell`); once a
header on the link says the sender rings it (``bell``), the next pushes' headers come by the doorbell and their
words go back by it, while the link carries the rest (the sender's CLOSED and RELEASED, this receiver's ASK,
FREED and BYE). From then on the standing header receive has a thread of its own, which wakes a pull asleep on
the doorbell when the link speaks."""

from __future__ import annotations

import contextlib
import enum
import math
import threading
import time
from collections.abc import Callable, Generator, Sequence
from datetime import timedelta

from ..core.driver import Driver
from ..core.errors import OutOfStepError, UsageError
from ..core.lifecycle import Lifecycle
from ..core.protocol import Work
from ..core.transfer import Transfer
from ..samehost.doorbell import Mailbox
from ..wire.control import read_bytes
from ..wire.staging import Lane
from .link import Unanswered, naming
from .transports.wire import rules
from .wire import (
    BYE,
    CLOSED,
    FREED,
    GOT,
    HEADER_SIZE,
    PUSH,
    RELEASED,
    Got,
    PushHeader,
    SessionTags,
    ask_message,
)


def header_too_long(text: str) -> OutOfStepError:
    return OutOfStepError(f"{text} (not drained, the link is out of step)")


class Farewell(enum.Enum):
    """The last words on a receiver's link, as the receiver sees them (docs/design.md draws :data:`MOVES`; the
    sender's view is :class:`~cudarecv.weights.session.Standing`)."""

    #: nobody said a last word yet
    OPEN = "open"
    #: this receiver said BYE (its close()): the sender's RELEASED, after what it still had in flight, to come
    BYE_SAID = "bye said"
    #: the sender said CLOSED: no version comes any more; this receiver answered BYE (unless it had said it)
    CLOSED = "closed"
    #: the sender answered this receiver's BYE: it took it and every word before
    RELEASED = "released"


#: the moves of a receiver's last words: each side says one (CLOSED may cross this receiver's BYE)
MOVES: dict[Farewell, frozenset[Farewell]] = {
    Farewell.OPEN: frozenset({Farewell.BYE_SAID, Farewell.CLOSED}),
    Farewell.BYE_SAID: frozenset({Farewell.RELEASED, Farewell.CLOSED}),
}


class Inbox:
    """What this receiver hears from its sender and says to it (see the module docstring)."""

    def __init__(
        self, lane: Lane, tags: SessionTags, driver: Driver, mailbox: Mailbox | None = None
    ) -> None:
        self._lane: Lane | None = lane  # (None once :meth:`forget` let go of it)
        self.tags, self.driver = tags, driver
        #: the doorbell this receiver offered (None: it offered none)
        self.mailbox = mailbox
        #: the standing receive's own thread, once the sender rings the doorbell (None until then)
        self._listener: Driver | None = None
        #: whether the header in hand came by the doorbell (its word goes back by it)
        self.by_bell = False
        self.asks = Unanswered(
            lane, tags.ask
        )  # this receiver's words, until the sender shows it took them
        self.answered = 0  # the mark of the last GOT: a sync sender's next push shows it took it
        self.farewell = Lifecycle(
            f"the link to weight sender rank {lane.link.peer}", Farewell.OPEN, MOVES
        )
        self._closed_why = ""  # (CLOSED: why no version comes any more)
        #: held while the standing receive answers the sender's CLOSED with BYE, and while :meth:`forget` lets go of
        #: the link: a close() that saw CLOSED (and so says no BYE of its own) cannot let go of the link between the
        #: standing receive's move to CLOSED and its BYE, which would then never be sent (the sender's listener
        #: waited for it until its close() timed out, and was left running)
        self._answering = threading.Lock()
        self.standing = self._listen() if rules(lane.link).standing else None

    @property
    def lane(self) -> Lane:
        """The lane to the sender, until :meth:`forget` lets go of it (the receiver closed)."""
        if self._lane is None:
            raise UsageError("this weight receiver is closed")
        return self._lane

    @property
    def ringing(self) -> bool:
        """Whether the sender rings this receiver's doorbell (a header on the link said so)."""
        return self._listener is not None

    def _listen(self) -> Transfer:
        """Post the next header receive; its transfer waits as long as the sender likes (a wait still blocked at
        exit is ended by the exit hook, :mod:`cudarecv.core.shutdown`). Driven on the receiver's driver, or, once the
        doorbell rings, on a thread of its own that wakes a pull asleep on the doorbell as it ends."""
        lane = self.lane
        standing = Transfer(
            self._next_header(),
            lane.stream,
            timeout=math.inf,
            driver=(self.driver if self._listener is None else self._listener).submit,
            link=lane.link,
            raise_first=False,
            on_error=naming(lane.link, "weight sync", math.inf, "sent nothing"),
            what=f"the next weight-sync header from rank {lane.link.peer}",
        )
        mailbox = self.mailbox
        if self._listener is not None and mailbox is not None:
            standing.add_done_callback(lambda _: mailbox.kick())
        return standing

    def _next_header(self) -> Generator[Sequence[Work], None, PushHeader]:
        lane = self.lane  # bound now: close() lets go of it
        raw = yield from read_bytes(
            lane, HEADER_SIZE, self.tags.header, "weight-push header", header_too_long
        )
        header = PushHeader.unpack(raw)
        if header.kind == CLOSED:
            self._closed_why = (
                f"the sender (rank {lane.link.peer}) closed after version {header.version}"
            )
            with self._answering:
                if self.farewell.move_if(Farewell.CLOSED, frm={Farewell.OPEN}):
                    self.asks.post(ask_message(BYE))  # its listener ends
                else:  # (it crossed this receiver's BYE)
                    self.farewell.move_if(Farewell.CLOSED)
        elif header.kind == RELEASED:
            self.farewell.move_if(Farewell.RELEASED)
        return header

    @property
    def sender_closed(self) -> str | None:
        """Why no version comes any more (the sender said CLOSED), or None."""
        return self._closed_why if self.farewell.state is Farewell.CLOSED else None

    @property
    def released(self) -> bool:
        """Whether the sender answered this receiver's BYE."""
        return self.farewell.state is Farewell.RELEASED

    def header(self) -> Generator[Sequence[Work], None, PushHeader]:
        """A sub-protocol: the next header (the doorbell's, the standing receive's, or one posted now on NCCL)."""
        self.by_bell = False
        if self.standing is None:
            raw = yield from read_bytes(
                self.lane, HEADER_SIZE, self.tags.header, "weight-push header", header_too_long
            )
            return PushHeader.unpack(raw)
        if self.ringing:
            yield [Rung(self)]
            rung = self._rung()
            if rung is not None:
                return rung
        standing = self.standing
        yield [standing.ended()]
        yield ()  # (a failed transfer keeps its last works: not the standing receive, nor its group)
        header = standing.wait()  # raises what the standing receive met (a dead sender, a lie)
        if header.kind == PUSH:
            if header.bell and self.mailbox is not None and self._listener is None:
                # the next headers come by the doorbell: from now on the standing receive has a thread of its own;
                # the sender has mapped the page, so its descriptor goes (nothing names the memory any more)
                self._listener = Driver(f"cudarecv-headers-{self.lane.link.peer}")
                self.mailbox.close()
            self.standing = self._listen()  # the next one, already
        return header

    def _rung(self) -> PushHeader | None:
        """The header the doorbell brought, if it rang (it comes before what the link brought: the sender rings
        before it says CLOSED or RELEASED on the link, and rings no more after)."""
        mailbox = self.mailbox
        if mailbox is None or not mailbox.rung():
            return None
        header = PushHeader.unpack(mailbox.take()[:HEADER_SIZE])
        if header.kind != PUSH or not header.shared:
            raise header_too_long(
                f"the doorbell brought a header of kind {header.kind} (shared: {header.shared}), not a "
                "shared push"
            )
        self.by_bell = True
        return header

    def wait_rung(self, timeout: float, stop: Callable[[], bool]) -> bool:
        """Wait on this thread, up to ``timeout`` s, until the doorbell rings or the link speaks, or ``stop()``
        (looked at after each wake: :meth:`wake` wakes it); whether one of them did."""
        return Rung(self).wait_for(timeout, stop)

    def wake(self) -> None:
        """Wake a thread asleep in :meth:`wait_rung` (it looks at its ``stop`` again)."""
        if self.mailbox is not None:
            self.mailbox.kick()

    def ask_by_bell(self, floor: int) -> bool:
        """Latest mode: ask by the doorbell for a version newer than ``floor``, if it rings; whether the ask stands
        (False: ask on the link, the sender has one already, or no doorbell rings; :meth:`Mailbox.ask`)."""
        return self.ringing and self.mailbox is not None and self.mailbox.ask(floor)

    def rung(self) -> bool:
        """Whether the doorbell rang with a header not taken yet."""
        return self.mailbox is not None and self.mailbox.rung()

    def claim_bye(self) -> bool:
        """Whether this call is the one to send BYE (once: not after the sender's CLOSED, which it answered)."""
        return self.farewell.move_if(Farewell.BYE_SAID, frm={Farewell.OPEN})

    def tell(self, header: PushHeader, status: Got, freed: int = 0) -> None:
        """Relay fan-out, shared memory or delta (a header that asks for it): tell the sender what became of the push (its blocking push waits for
        every word; a shared snapshot is not written again before it). ``freed`` (zero-copy): the version whose
        snapshot this receiver let go of as it published this one, said with that word (or alone, without one).
        A header that came by the doorbell is answered by it."""
        if self.by_bell and self.mailbox is not None:
            self.mailbox.answer(ask_message(GOT, header.version, status, freed=freed))
            return
        if header.relayed or header.shared or header.ack:
            self.answered = self.asks.post(ask_message(GOT, header.version, status, freed=freed))
        elif freed:
            self.freed(freed)

    def freed(self, version: int) -> None:
        """(Zero-copy:) this receiver no longer reads the snapshot of ``version``."""
        if self._lane is not None:
            with contextlib.suppress(Exception):  # a sender gone: nothing is written there any more
                self.asks.post(ask_message(FREED, version))

    def bye(self) -> int:
        """Say BYE; returns its mark (the sender's answer shows it took it and every word before)."""
        return self.asks.post(ask_message(BYE))

    def taken_mark(self, mark: int) -> int:
        """The mark of this receiver's words the sender has taken: ``mark``, or past it what its listener says it
        read (a doorbell's count: its words on the link are then never proved taken by a GOT on the link)."""
        return mark if self.mailbox is None else max(mark, self.mailbox.taken())

    def forget(self, timeout: float) -> None:
        """At the end: let go of the link (what the sender never took stays with the group), the doorbell and the
        standing receive's thread (waiting up to ``timeout`` s for it to end: one still in gloo ends once that
        wait returns)."""
        with self._answering:  # (a BYE that answers CLOSED is posted before, or never owed)
            self.asks.forget()
        self.standing, self._lane = None, None
        if self._listener is not None:
            self._listener.stop(timeout)
        if self.mailbox is not None:
            self.mailbox.close()


#: how long a thread asleep on a doorbell sleeps before it looks again by itself (it is woken when the doorbell
#: rings or the link speaks; this bounds the wait when both ends moved the wake word at once and one move was lost)
NAP = 0.2


class Rung:
    """A work that completes when the doorbell rang or the standing header receive ended (see :class:`Inbox`).

    Its wait sleeps on the doorbell's futex: a ring or the standing receive's end wakes it."""

    def __init__(self, inbox: Inbox) -> None:
        assert inbox.mailbox is not None and inbox.standing is not None
        self.mailbox, self.standing = inbox.mailbox, inbox.standing

    def is_completed(self) -> bool:
        # (decided, not settled: the standing receive's done-callback wakes this before it is settled, and a wake
        # seen before settled would leave this asleep a NAP)
        return self.mailbox.rung() or self.standing.decided

    def wait_for(self, timeout: float, stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait up to ``timeout`` s, or until ``stop()``; whether it completed (or stopped)."""
        deadline = time.monotonic() + timeout
        while True:
            mark = self.mailbox.wakes()
            if self.is_completed() or stop():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.mailbox.sleep(mark, min(left, NAP))

    def wait(self, timeout: timedelta | None = None) -> bool:
        while not self.wait_for(NAP):
            pass
        return True
