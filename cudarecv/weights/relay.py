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
import threading
import time
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ..core import streams
from ..core.driver import Driver
from ..core.errors import OutOfStepError, RelayLost, TransferTimeout
from ..core.link import Link
from ..core.log import logger
from ..core.transfer import Transfer
from ..core.transport import release
from ..wire.control import read_bytes, wire_bytes
from ..wire.staging import Lane, lane_for, recv_into, send_from, wire_can_touch
from .inbox import header_too_long
from .wire import BROKEN, INTACT, TRAILER_SIZE, read_trailer, trailer_message


class Relay:
    """One push's chunks on their way through this receiver to ``down`` (see the module docstring)."""

    def __init__(self, down: Lane, pieces: Sequence[Tensor], tag: int, trailer_tag: int, version: int) -> None:
        self.down = down
        self.pieces = pieces
        self.tag, self.trailer_tag, self.version = tag, trailer_tag, version
        self._cond = threading.Condition()
        self._events: list[Any] = []  # per landed chunk: the CUDA event after which it is there (or None)
        self._broken: int | None = None  # the rank that failed upstream, once known
        self._ended = False

    def landed(self, i: int) -> None:
        """Chunk ``i`` is in its piece (called in order, on the stream that wrote it, if any)."""
        stream = self.down.stream
        event = streams.record(torch.cuda.current_stream(stream.device)) if stream is not None else None
        with self._cond:  # the receive lands chunks in order: the i-th call is chunk i
            self._events.append(event)
            self._cond.notify_all()

    def end(self, broken: int | None = None) -> None:
        """Every chunk has landed (``broken=None``), or the push failed upstream at rank ``broken``."""
        with self._cond:
            self._ended = True
            if broken is not None and self._broken is None:
                self._broken = broken
            self._cond.notify_all()

    def forward(self) -> Any:
        """The protocol that sends every chunk on as it lands, then the trailer."""
        pending: list[Any] = []
        for i, piece in enumerate(self.pieces):
            yield [_Landed(self, i)]
            with self._cond:
                event = self._events[i] if i < len(self._events) else None
            if event is not None:
                self.down.stream.wait_event(event)  # the chunk's bytes (or a broken push's leftovers)
            works = yield from send_from(self.down, [piece], [self.tag], defer=True)
            pending.extend(works or ())
        yield [_Landed(self, len(self.pieces))]  # the push has ended: intact, or broken upstream
        with self._cond:
            status, rank = (INTACT, -1) if self._broken is None else (BROKEN, self._broken)
        works = yield from send_from(self.down, [wire_bytes(self.down, trailer_message(self.version, status, rank))],
                                     [self.trailer_tag], defer=True)
        pending.extend(works or ())
        if pending:
            yield pending


class _Landed:
    """A work that completes when chunk ``i`` has landed, or the push has ended (``i`` = the
    number of chunks: only then)."""

    def __init__(self, relay: Relay, i: int) -> None:
        self.relay, self.i = relay, i

    def _ready(self) -> bool:
        return self.relay._ended or len(self.relay._events) > self.i

    def is_completed(self) -> bool:
        with self.relay._cond:
            return self._ready()

    def wait(self, timeout: Any = None) -> bool:
        with self.relay._cond:
            self.relay._cond.wait_for(self._ready)  # the pull always ends the relay (landed or broken)
        return True


class Hop:
    """A receiver's part in relay chains: lanes to the other receivers of its chains, a forwarding thread per next
    hop and a receiving thread per hop before (so a hop that stops holds none of this receiver's later pulls), per
    slot the forward that may still read it, and while a relayed payload arrives, its relay and the
    rank before it (to say downstream and to the sender who failed if it breaks).

    ``connect``: how the link to another receiver forms (a receiver that joined through a store: a pair of its
    own, :class:`cudarecv.weights.membership.edges.Edges`); by default that rank in this receiver's group."""

    def __init__(self, lane: Lane, tags: Any, device: torch.device) -> None:
        self.lane, self.tags, self.device = lane, tags, device
        self.connect: Callable[[int, int], Link] | None = None  # (rank, version of the push naming it) -> link
        self._peers: dict[int, Lane] = {}
        self._forwarders: dict[int, Driver] = {}
        self._receivers: dict[int, Driver] = {}
        self._forwards: dict[int, Transfer] = {}
        self.relaying: tuple[Relay | None, int, int] | None = None
        self.lost_at: int | None = None

    def receive(self, header: Any, slot: Any, index: int, version: int) -> Any:
        """A sub-protocol: receive the payload from the hop before this one into ``slot`` (own slot ``index``) and
        forward each chunk to the hop after it as it lands (within as long as the hop after it waits: the header's
        ``wait_ms`` is this hop's); raises :class:`RelayLost` naming the rank that failed upstream if the push
        broke there (``version``: the one this receiver keeps)."""
        if header.down >= 0 and header.down == header.up:
            raise OutOfStepError(f"a relay header names rank {header.up} as both hops: the link is out of step")
        self.relaying, self.lost_at = (None, header.up, header.version), None
        payload, trailer = self.tags.relay(header.version)
        relay = None
        down = None
        if header.down >= 0:  # (formed before the hop before: if that one cannot be reached, the next is told)
            try:
                down = self._peer(header.down, "the hop after this receiver", header.version)
            except TransferTimeout as error:  # a pair of joined receivers that never formed: the next one is gone
                logger.warning("weight receiver: version %d is not forwarded: %s", header.version, error)
        if down is not None:
            relay = Relay(down, slot.pieces, payload, trailer, header.version)
            self._forwards[index] = Transfer(
                relay.forward(), down.stream, timeout=header.wait_ms / 1e3 * (header.hop + 2) / (header.hop + 1),
                driver=self._driver(self._forwarders, "forward", header.down).submit, link=down.link, raise_first=False,
                what=f"forward of version {header.version} to rank {header.down}")
            self.relaying = (relay, header.up, header.version)
        up = self._peer(header.up, "the hop before this receiver", header.version)
        receiving = self._receive_from(up, header, slot, relay, payload, trailer)
        if up is self.lane or up.nccl:  # the head of the chain (from the sender), or NCCL (a failed peer breaks
            status, rank = yield from receiving  # the communicator: no healing): on the pull's own thread
        else:  # on a thread of its own per hop before: one that stops holds no later pull of this receiver
            transfer = Transfer(receiving, up.stream, timeout=header.wait_ms / 1e3,
                                driver=self._driver(self._receivers, "receive", header.up).submit, link=up.link,
                                raise_first=False, what=f"receive of version {header.version} from rank {header.up}")
            yield [transfer.ended(drive=False)]
            status, rank = transfer.wait()
        if status == BROKEN:
            self.lost_at = rank
            raise RelayLost(f"pull of version {header.version}: rank {rank} before this receiver in the relay "
                            f"chain failed during the push (did its process die?): version {version} stays "
                            "published, and the next version comes through the chain healed")
        self.relaying = None
        if relay is not None:
            relay.end()

    def _receive_from(self, up: Lane, header: Any, slot: Any, relay: Relay | None, payload: int,
                      trailer: int) -> Any:
        """A sub-protocol: the payload from the hop before into ``slot``, each chunk to ``relay`` as it lands;
        returns the trailer's (status, the rank that failed)."""
        tags = [payload] * len(slot.pieces)
        if relay is not None and up.nccl and wire_can_touch(up, slot.pieces):  # one chunk at a time: each forwarded
            for i, piece in enumerate(slot.pieces):                              # once its receive is on the stream
                yield from recv_into(up, [piece], tags[:1], landed=lambda _, i=i: relay.landed(i))
        else:
            yield from recv_into(up, slot.pieces, tags, landed=relay.landed if relay is not None else None)
        status, got, rank = read_trailer((yield from read_bytes(up, TRAILER_SIZE, trailer, "relay trailer",
                                                                header_too_long)))
        if got != header.version:
            raise OutOfStepError(f"the relay trailer is for version {got}, not {header.version}: out of step")
        return status, rank

    def broken(self) -> tuple[int, int, bool] | None:
        """A pull failed: if a relayed payload was arriving, tell the next hop who failed; returns (version, the
        rank that failed, whether it is a hop before this one rather than the sender), or None."""
        relaying, self.relaying = self.relaying, None
        if relaying is None:
            return None
        relay, up, version = relaying
        lost = self.lost_at if self.lost_at is not None else up
        if relay is not None:
            relay.end(broken=lost)
        return version, lost, up != self.lane.link.peer

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

    def forward_of(self, index: int) -> Transfer | None:
        """The forward that may still read own slot ``index`` (let go of here)."""
        return self._forwards.pop(index, None)

    def _peer(self, rank: int, what: str, version: int) -> Lane:
        """The lane to another receiver of the chain (the sender's own for the sender)."""
        link = self.lane.link
        if rank == link.peer:
            return self.lane
        lane = self._peers.get(rank)
        if lane is None:
            if self.connect is not None:
                peer = self.connect(rank, version)
            elif not 0 <= rank < link.pg.size() or rank == link.pg.rank():
                raise OutOfStepError(f"a relay header names rank {rank} as {what}, in a group of {link.pg.size()} "
                                     f"where this is rank {link.pg.rank()}: the link is out of step")
            else:
                peer = Link(link.pg, rank, link.registered, link.backend)
            stream = None
            if self.lane.stream is not None:  # forwards run on a stream of their own, next to the receives
                stream = torch.cuda.Stream(device=self.lane.stream.device)
            lane = self._peers[rank] = lane_for(peer, self.device, stream, streams.StagingPool())
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
        if self.relaying is not None and self.relaying[0] is not None:
            self.relaying[0].end(broken=self.relaying[1])
        for forward in self._forwards.values():
            with contextlib.suppress(Exception):
                forward.wait(max(deadline - time.monotonic(), 0.0))
        for rank in {*self._peers, *self._forwarders, *self._receivers}:
            self.forget(rank, max(deadline - time.monotonic(), 0.0))
        self._forwards, self.lane = {}, None
