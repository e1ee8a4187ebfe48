"""Relay fan-out, the receiver's part: a push's chunks forwarded to the next receiver as they land.

With ``WeightSender(..., fanout="relay")`` the sender sends each push's payload
to the first receiver of a chain only; every receiver receives chunk i from the
hop before it while it forwards chunk i - 1 to the hop after it, so every host
sends and receives the model about once, whatever the number of receivers.
Each push's header (from the sender, to every receiver) names the two hops.

On each hop the chunks are followed by a *trailer*: ``INTACT``, or ``BROKEN``
naming the rank that failed upstream. A receiver whose upstream link fails
mid-push still sends the hop after it the chunks it owes (whatever its buffer
holds) and a ``BROKEN`` trailer, so every receiver downstream of a dead one
learns at once which rank failed, with its links in step. A receiver publishes
a version only once its own trailer says ``INTACT`` and its own checks passed.

:class:`Relay` tracks one push through this receiver: the pull's protocol
calls :meth:`Relay.landed` for each chunk (on the thread that receives), and
:meth:`Relay.forward` is the protocol that sends them on, on a thread of its
own (the receiver's forwarder), so forwarding goes on whatever the receiver's
caller does once ``pull()`` has returned. :class:`Hop` is the receiver's part in its chains.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from ..core import streams
from ..core.driver import Driver
from ..core.errors import OutOfStepError, PeerError, RelayLost, TransferTimeout, UsageError
from ..core.lifecycle import Lifecycle
from ..core.link import Link
from ..core.log import logger
from ..core.shutdown import start_thread
from ..core.transfer import Transfer
from ..core.transport import release
from ..wire.control import ROOM, read_bytes, wire_bytes
from ..wire.staging import (
    Landed,
    Lane,
    lane_for,
    recv_into,
    release_pair,
    send_from,
    wire_can_touch,
)
from .inbox import header_too_long
from .link import naming
from .wire import (
    BROKEN,
    INTACT,
    TRAILER_SIZE,
    PushHeader,
    SessionTags,
    Trailer,
    read_trailer,
    trailer_message,
)

if TYPE_CHECKING:
    from ..core.protocol import Protocol, Work


#: where a relayed patch lands (delta), for :meth:`Hop.receive` and :meth:`Hop.forward_of`: not an own slot
PATCH_BUFFER = -1


class Passage(enum.Enum):
    """One push on its way through a hop (:class:`Relay`); docs/design.md draws :data:`MOVES`."""

    #: chunks land and go on to the hop after as they do
    FORWARDING = "forwarding"
    #: every chunk landed: the trailer says INTACT
    LANDED = "landed"
    #: the push failed upstream (or this receiver closed mid-push): the chunks owed go on, the trailer says
    #: BROKEN naming the rank that failed
    BROKEN = "broken"


#: a push through a hop ends once, intact or broken (the first to end it wins: a pull that fails, a close)
MOVES: dict[Passage, frozenset[Passage]] = {
    Passage.FORWARDING: frozenset({Passage.LANDED, Passage.BROKEN}),
}


class Relay:
    """One push's chunks on their way through this receiver to ``down`` (see the module docstring); where it
    stands is a :class:`Passage`."""

    def __init__(
        self, down: Lane, pieces: Sequence[Tensor], tag: int, trailer_tag: int, version: int
    ) -> None:
        self.down = down
        self.pieces = pieces
        self.tag, self.trailer_tag, self.version = tag, trailer_tag, version
        self._cond = threading.Condition()
        #: per landed chunk: the CUDA event after which it is there (None: no stream, it is there)
        self._events: list[torch.cuda.Event | None] = []
        self._broken: int | None = None  # the rank that failed upstream (BROKEN)
        self.passage = Lifecycle(f"relay of version {version}", Passage.FORWARDING, MOVES)

    def landed(self, i: int) -> None:
        """Chunk ``i`` is in its piece (called in order, on the stream that wrote it, if any)."""
        stream = self.down.stream
        event = (
            streams.record(torch.cuda.current_stream(stream.device)) if stream is not None else None
        )
        with self._cond:  # the receive lands chunks in order: the i-th call is chunk i
            self._events.append(event)
            self._cond.notify_all()

    def end(self, broken: int | None = None) -> None:
        """Every chunk has landed (``broken=None``), or the push failed upstream at rank ``broken``."""
        with self._cond:
            if self.passage.move_if(Passage.LANDED if broken is None else Passage.BROKEN):
                self._broken = broken
            self._cond.notify_all()

    def forward(self) -> Protocol:
        """The protocol that sends every chunk on as it lands, then the trailer."""
        pending: list[dist.Work] = []
        for i, piece in enumerate(self.pieces):
            yield [_Landed(self, i)]
            with self._cond:
                event = self._events[i] if i < len(self._events) else None
            if event is not None:
                # the chunk's bytes (or a broken push's leftovers); an event: it landed on a CUDA stream
                self.down.cuda.wait_event(event)
            works = yield from send_from(self.down, [piece], [self.tag], defer=True)
            pending.extend(works or ())
        yield [_Landed(self, len(self.pieces))]  # the push has ended: intact, or broken upstream
        with self._cond:
            # (the rank that failed is known once BROKEN: the trailer names it)
            status, rank = (INTACT, -1) if self._broken is None else (BROKEN, self._broken)
        works = yield from send_from(
            self.down,
            [wire_bytes(self.down, trailer_message(self.version, status, rank))],
            [self.trailer_tag],
            defer=True,
        )
        pending.extend(works or ())
        if pending:
            yield pending


class _Landed:
    """A work that completes when chunk ``i`` has landed, or the push has ended (``i`` = the
    number of chunks: only then)."""

    def __init__(self, relay: Relay, i: int) -> None:
        self.relay, self.i = relay, i

    def _ready(self) -> bool:
        return (
            self.relay.passage.state is not Passage.FORWARDING or len(self.relay._events) > self.i
        )

    def is_completed(self) -> bool:
        with self.relay._cond:
            return self._ready()

    def wait(self, timeout: timedelta | None = None) -> bool:
        with self.relay._cond:
            self.relay._cond.wait_for(
                self._ready
            )  # the pull always ends the relay (landed or broken)
        return True


class Hop:
    """A receiver's part in relay chains: lanes to the other receivers of its chains, a forwarding thread per next
    hop and a receiving thread per hop before (so a hop that stops holds none of this receiver's later pulls), per
    slot the forward that may still read it, and while a relayed payload arrives, what it is (to say downstream
    and to the sender who failed if it breaks).

    ``connect``: how the link to another receiver forms, given its rank, the version of the push naming it and a
    time limit (a receiver that joined through a store: a pair of their own, formed on a thread of its own,
    :class:`cudarecv.weights.membership.edges.Edges`); None (the default): that rank in this receiver's group."""

    def __init__(
        self,
        lane: Lane,
        tags: SessionTags,
        device: torch.device,
        connect: Callable[[int, int, float], Link] | None = None,
    ) -> None:
        self._sender_lane: Lane | None = lane  # (None once closed: its link and staging let go of)
        self.tags, self.device = tags, device
        self.sender = lane.link.peer
        self.connect = connect
        self._peers: dict[int, Lane] = {}
        self._forwarders: dict[int, Driver] = {}
        self._receivers: dict[int, Driver] = {}
        self._forwards: dict[int, Transfer] = {}  # own slot -> the forward that may still read it
        self._last: dict[
            tuple[str, int], Transfer
        ] = {}  # ("forward" or "receive", rank) -> the last one
        self._forming: list[_Forming] = []  # pairs forming now (joined receivers)
        self.relaying: Relaying | None = None
        self.lost_at: int | None = None

    @property
    def lane(self) -> Lane:
        """The lane to the sender, until :meth:`close`."""
        if self._sender_lane is None:
            raise UsageError("this weight receiver is closed")
        return self._sender_lane

    def receive(
        self, header: PushHeader, pieces: Sequence[Tensor], index: int, version: int
    ) -> Protocol:
        """A sub-protocol: receive the payload from the hop before this one into ``pieces`` (the messages of own
        slot ``index``, or of the patch buffer: :data:`PATCH_BUFFER`) and forward each chunk to the hop after it as
        it lands (within as long as the hop after it waits: the header's ``wait_ms`` is this hop's); raises
        :class:`RelayLost` naming the rank that failed upstream if the push broke there (``version``: the one this
        receiver keeps)."""
        if header.down >= 0 and header.down == header.up:
            raise OutOfStepError(
                f"a relay header names rank {header.up} as both hops: the link is out of step"
            )
        wait = header.wait_ms / 1e3
        self.relaying, self.lost_at = (
            Relaying(None, header.up, header.version, time.monotonic(), wait, index),
            None,
        )
        up, down = yield from self._lanes(header, wait)
        if up is not self.lane and up.stream is not None and self.lane.stream is not None:
            # what the pull queued (the slot's earlier reads, the caller's work) comes before the receive
            up.cuda.wait_stream(self.lane.cuda)
        payload, trailer = self.tags.relay(header.version)
        relay = None
        if down is not None:
            relay = self.relaying.relay = Relay(down, pieces, payload, trailer, header.version)
            forward = Transfer(
                relay.forward(),
                down.stream,
                timeout=wait * (header.hop + 2) / (header.hop + 1),  # the next hop's
                driver=self._driver(self._forwarders, "forward", header.down).submit,
                link=down.link,
                on_error=_naming(
                    down.link,
                    f"forward of version {header.version}",
                    wait,
                    "took no complete version",
                ),
                raise_first=False,
                what=f"forward of version {header.version} to rank {header.down}",
            )
            self._forwards[index] = self._last["forward", header.down] = forward
        receiving = self._receive_from(up, header, pieces, relay, payload, trailer)
        if (
            up is self.lane or up.nccl
        ):  # the head of the chain (from the sender), or NCCL (a failed peer breaks
            (
                status,
                rank,
            ) = yield from receiving  # the communicator: no healing): on the pull's own thread
        else:  # on a thread of its own per hop before: one that stops holds no later pull of this receiver
            left = max(
                wait - (time.monotonic() - self.relaying.started), 0.0
            )  # (the pull's own deadline)
            transfer = self._last["receive", header.up] = Transfer(
                receiving,
                up.stream,
                timeout=left,
                driver=self._driver(self._receivers, "receive", header.up).submit,
                link=up.link,
                raise_first=False,
                what=f"receive of version {header.version} from rank {header.up}",
                on_error=_naming(
                    up.link,
                    f"receive of version {header.version}",
                    wait,
                    "sent no complete version",
                ),
            )
            yield [transfer.ended(drive=False)]
            status, rank = transfer.wait()
        if (
            up.stream is not None and up is not self.lane
        ):  # (landed on the hop's stream: the pull's follows it)
            self.lane.cuda.wait_stream(up.stream)
        if status == BROKEN:
            self.lost_at = rank
            raise RelayLost(
                f"pull of version {header.version}: rank {rank} before this receiver in the relay "
                f"chain failed during the push (did its process die?): version {version} stays "
                "published, and the next version comes through the chain healed"
            )
        self.relaying = None
        if relay is not None:
            relay.end()

    def _lanes(
        self, header: PushHeader, wait: float
    ) -> Generator[Sequence[Work], None, tuple[Lane, Lane | None]]:
        """A sub-protocol: the lanes to the hop before and (or None: none, or its pair never formed) the hop after.
        Pairs still to form (receivers that joined through a store) form at once, each on a thread of its own,
        within half the hop's time (the rest is the transfer's)."""
        for kind, rank, drivers in (
            ("receive", header.up, self._receivers),
            ("forward", header.down, self._forwarders),
        ):
            self._unjam(kind, rank, drivers)
        wanted = [
            r
            for r in (header.up, header.down)
            if r >= 0 and r != self.sender and r not in self._peers
        ]
        if wanted and self.connect is not None:
            forming = [_Forming(self.connect, r, header.version, wait / 2) for r in wanted]
            self._forming.extend(forming)
            yield forming
            for pair in forming:
                self._forming.remove(pair)
                with contextlib.suppress(
                    TransferTimeout
                ):  # (a pair that did form is kept, whatever the other did)
                    self._lane(pair.rank, pair.link())
        up = self._peer(header.up, "the hop before this receiver")
        down = None
        if header.down >= 0:
            try:
                down = self._peer(header.down, "the hop after this receiver")
            except (
                TransferTimeout
            ) as error:  # a pair of joined receivers that never formed: the next one is gone
                logger.warning(
                    "weight receiver: version %d is not forwarded: %s", header.version, error
                )
        return up, down

    def _unjam(self, kind: str, rank: int, drivers: dict[int, Driver]) -> None:
        """Before a transfer with ``rank``: if the last one failed, its thread may wait in gloo for good (a stopped
        hop; a send waits for its receive): the next goes on a new thread; a link that broke is let go of (formed
        again if it is named again)."""
        last = self._last.get((kind, rank))
        if last is None or not last.settled or not last.failed:
            return
        del self._last[kind, rank]
        try:
            last.value()
        except PeerError:
            self.forget(rank)
            return
        except Exception:  # noqa: BLE001 - it ran out of time (or failed otherwise): the link may still work
            pass
        driver = drivers.pop(rank, None)
        if driver is not None:
            driver.stop(0.0)

    def _receive_from(
        self,
        up: Lane,
        header: PushHeader,
        pieces: Sequence[Tensor],
        relay: Relay | None,
        payload: int,
        trailer: int,
    ) -> Generator[Sequence[Work], None, tuple[Trailer, int]]:
        """A sub-protocol: the payload from the hop before into ``pieces``, each chunk to ``relay`` as it lands;
        returns the trailer's (status, the rank that failed). On gloo the trailer's receive is posted first, so
        the hop's forward never waits on a receive this one never posts (if it runs out of time meanwhile)."""
        tags = [payload] * len(pieces)
        early = None
        if (
            not up.nccl
        ):  # (gloo matches by tag; NCCL in posting order: there it comes after the payload)
            early = torch.zeros(TRAILER_SIZE + ROOM, dtype=torch.uint8)
            posted = up.post(False, [early], [trailer])
        if (
            relay is not None and up.nccl and wire_can_touch(up, pieces)
        ):  # one chunk at a time: each forwarded
            for i, piece in enumerate(pieces):  # once its receive is on the stream
                yield from recv_into(up, [piece], tags[:1], landed=_landing(relay, i))
        else:
            yield from recv_into(
                up, pieces, tags, landed=relay.landed if relay is not None else None
            )
        if early is None:
            raw = yield from read_bytes(up, TRAILER_SIZE, trailer, "relay trailer", header_too_long)
        else:
            yield posted
            if early[TRAILER_SIZE:].any():
                raise header_too_long(
                    f"the relay trailer is longer than its {TRAILER_SIZE} bytes: the peer speaks "
                    "another protocol or version on this tag"
                )
            raw = early[:TRAILER_SIZE].numpy().tobytes()
        status, got, rank = read_trailer(raw)
        if got != header.version:
            raise OutOfStepError(
                f"the relay trailer is for version {got}, not {header.version}: out of step"
            )
        return status, rank

    def broken(self) -> Relaying | None:
        """A pull failed: if a relayed payload was arriving, tell the next hop who failed (the hop before, unless
        its trailer named another) and return what was arriving (``lost``: the rank that failed), else None."""
        relaying, self.relaying = self.relaying, None
        if relaying is None:
            return None
        relaying.lost = self.lost_at if self.lost_at is not None else relaying.up
        if relaying.relay is not None:
            relaying.relay.end(broken=relaying.lost)
        return relaying

    def forget(self, rank: int, timeout: float = 0.0) -> None:
        """The receiver ``rank`` is gone (its link broke): let go of the lane to it (a pair of its own, released)
        and of its threads (each ends once what it runs ends; waited for up to ``timeout`` s)."""
        for drivers in (self._forwarders, self._receivers):
            driver = drivers.pop(rank, None)
            if driver is not None:
                driver.stop(timeout)
        lane = self._peers.pop(rank, None)
        if lane is not None and self.connect is not None:
            release(lane.link.pg)
        elif lane is not None:
            release_pair(
                lane.wire
            )  # (a pair group of its own, on NCCL: the last end on it shuts it down)

    def forward_of(self, index: int) -> Transfer | None:
        """The forward that may still read own slot ``index`` (or the patch buffer: :data:`PATCH_BUFFER`; let go
        of here)."""
        return self._forwards.pop(index, None)

    def _peer(self, rank: int, what: str) -> Lane:
        """The lane to another receiver of the chain (the sender's own for the sender); a joined receiver's pair
        with ``rank`` must have formed (:class:`TransferTimeout` if it did not)."""
        if rank == self.sender:
            return self.lane
        lane = self._peers.get(rank)
        if lane is not None:
            return lane
        link = self.lane.link
        if self.connect is not None:
            raise TransferTimeout(f"the pair with receiver {rank}, {what}, did not form")
        if not 0 <= rank < link.pg.size() or rank == link.pg.rank():
            raise OutOfStepError(
                f"a relay header names rank {rank} as {what}, in a group of {link.pg.size()} "
                f"where this is rank {link.pg.rank()}: the link is out of step"
            )
        return self._lane(rank, Link(link.pg, rank, link.registered, link.backend))

    def _lane(self, rank: int, peer: Link) -> Lane:
        """The lane to receiver ``rank``: a stream of the link's own (a forward never waits for the receives
        from the sender, nor they for it, but for the chunk it forwards), on this receiver's device (a pull
        may run on a background thread, whose current device is 0, whatever the receiver's)."""
        on = self.lane.stream.device if self.lane.stream is not None else None
        lane = self._peers[rank] = lane_for(
            peer, self.device, None, streams.StagingPool(), peers_at_once=True, cuda=on
        )
        return lane

    @staticmethod
    def _driver(drivers: dict[int, Driver], what: str, rank: int) -> Driver:
        """The thread that forwards to (or receives from) ``rank``."""
        driver = drivers.get(rank)
        if driver is None:
            driver = drivers[rank] = Driver(f"cudarecv-{what}-{rank}")
        return driver

    def close(self, deadline: float) -> None:
        """At the receiver's close: a relay cut short says so downstream; the hops after this one get what is on
        its way (each forward waited for until ``deadline``); the forwarders stop; the lanes are let go of (the
        pairs of a receiver that joined through a store, released)."""
        if self.relaying is not None and self.relaying.relay is not None:
            self.relaying.relay.end(broken=self.relaying.up)
        self.relaying = None
        for forward in self._forwards.values():
            with contextlib.suppress(Exception):
                forward.wait(max(deadline - time.monotonic(), 0.0))
        for pair in self._forming:  # (a close during a pull: each ends within its own limit)
            pair.wait()
            with contextlib.suppress(TransferTimeout):
                release(pair.link().pg)
        for rank in {*self._peers, *self._forwarders, *self._receivers}:
            self.forget(rank, max(deadline - time.monotonic(), 0.0))
        self._forwards, self._last, self._forming, self._sender_lane = {}, {}, [], None


def _landing(relay: Relay, i: int) -> Landed:
    """``landed`` of a receive of chunk ``i`` alone: tells ``relay`` that chunk ``i`` of the push landed."""
    return lambda _: relay.landed(i)


@dataclass
class Relaying:
    """A relayed version on its way in: its relay on (if any), the rank before, since when (monotonic) for how
    long (s) it may take, and (once it broke) the rank that failed."""

    relay: Relay | None
    up: int
    version: int
    started: float
    wait: float
    #: where it lands: own slot ``index``, or the patch buffer (:data:`PATCH_BUFFER`)
    index: int
    lost: int = -1

    def overdue(self) -> bool:
        """Whether it failed far past its time: this receiver itself was stopped (its deadline fired late), not
        the hop before."""
        return time.monotonic() - self.started > 1.5 * self.wait


def _naming(
    link: Link, what: str, wait: float, silent: str
) -> Callable[[BaseException, float], BaseException]:
    """The error hook of a transfer with another receiver: the link's failures (gloo's, a timeout) name the peer;
    any other error (this receiver's own: out of memory, a bug) stays as it is."""
    hook = naming(link, what, wait, silent)

    def named(error: BaseException, elapsed: float) -> BaseException:
        if (
            isinstance(error, TimeoutError)
            or type(error) is RuntimeError
            or isinstance(error, dist.DistError)
        ):
            return hook(error, elapsed)
        return error

    return named


class _Forming:
    """A work that completes once the pair with receiver ``rank`` has formed or failed to, on a thread of its
    own (bounded by its ``limit``); :meth:`link` is it, or raises why not."""

    def __init__(
        self, connect: Callable[[int, int, float], Link], rank: int, version: int, limit: float
    ) -> None:
        self.rank = rank
        self._link: Link | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        start_thread(self._form, f"cudarecv-pair-{rank}", (connect, rank, version, limit))

    def _form(
        self, connect: Callable[[int, int, float], Link], rank: int, version: int, limit: float
    ) -> None:
        try:
            self._link = connect(rank, version, limit)
        except BaseException as error:  # noqa: BLE001 - raised by link(), on the pull's thread
            self._error = (
                error
                if isinstance(error, TransferTimeout)
                else TransferTimeout(
                    f"the pair with receiver {rank} did not form: {type(error).__name__}: {error}"
                )
            )
        finally:
            self._done.set()

    def link(self) -> Link:
        if self._error is not None:
            raise self._error
        assert self._link is not None
        return self._link

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._done.wait()  # (bounded by the pair's own limit)
        return True
