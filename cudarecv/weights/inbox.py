"""A weight receiver's link to its sender, message by message: the sender's headers (on gloo a header receive
is always posted, so a sender that closes is heard at once, even between pulls; on NCCL, which runs a pair's
messages in order, a pull posts its own) and this receiver's words (ASK, GOT, FREED, BYE), kept until the
sender shows it took them."""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Generator, Sequence

from ..core.driver import Driver
from ..core.errors import OutOfStepError, UsageError
from ..core.lifecycle import Lifecycle
from ..core.protocol import Work
from ..core.transfer import Transfer
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

    def __init__(self, lane: Lane, tags: SessionTags, driver: Driver) -> None:
        self._lane: Lane | None = lane  # (None once :meth:`forget` let go of it)
        self.tags, self.driver = tags, driver
        self.asks = Unanswered(
            lane, tags.ask
        )  # this receiver's words, until the sender shows it took them
        self.answered = 0  # the mark of the last GOT: a sync sender's next push shows it took it
        self.farewell = Lifecycle(
            f"the link to weight sender rank {lane.link.peer}", Farewell.OPEN, MOVES
        )
        self._closed_why = ""  # (CLOSED: why no version comes any more)
        self.standing = self._listen() if rules(lane.link).standing else None

    @property
    def lane(self) -> Lane:
        """The lane to the sender, until :meth:`forget` lets go of it (the receiver closed)."""
        if self._lane is None:
            raise UsageError("this weight receiver is closed")
        return self._lane

    def _listen(self) -> Transfer:
        """Post the next header receive; its transfer waits as long as the sender likes (a wait still blocked at
        exit is ended by the exit hook, :mod:`cudarecv.core.shutdown`)."""
        lane = self.lane
        return Transfer(
            self._next_header(),
            lane.stream,
            timeout=math.inf,
            driver=self.driver.submit,
            link=lane.link,
            raise_first=False,
            on_error=naming(lane.link, "weight sync", math.inf, "sent nothing"),
            what=f"the next weight-sync header from rank {lane.link.peer}",
        )

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
        """A sub-protocol: the next header (the standing receive's, or one posted now on NCCL)."""
        if self.standing is None:
            raw = yield from read_bytes(
                self.lane, HEADER_SIZE, self.tags.header, "weight-push header", header_too_long
            )
            return PushHeader.unpack(raw)
        standing = self.standing
        yield [standing.ended()]
        yield ()  # (a failed transfer keeps its last works: not the standing receive, nor its group)
        header = standing.wait()  # raises what the standing receive met (a dead sender, a lie)
        if header.kind == PUSH:
            self.standing = self._listen()  # the next one, already
        return header

    def claim_bye(self) -> bool:
        """Whether this call is the one to send BYE (once: not after the sender's CLOSED, which it answered)."""
        return self.farewell.move_if(Farewell.BYE_SAID, frm={Farewell.OPEN})

    def tell(self, header: PushHeader, status: Got, freed: int = 0) -> None:
        """Relay fan-out, shared memory or delta (a header that asks for it): tell the sender what became of the push (its blocking push waits for
        every word; a shared snapshot is not written again before it). ``freed`` (zero-copy): the version whose
        snapshot this receiver let go of as it published this one, said with that word (or alone, without one)."""
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

    def forget(self) -> None:
        """At the end: let go of the link (what the sender never took stays with the group)."""
        self.asks.forget()
        self.standing, self._lane = None, None
