"""A link direction's channels (one per kind of memory it shares) and their lifecycles, both ends.

A channel's state changes only through :meth:`SendChannel.move` / :meth:`RecvChannel.move`, which refuse a
move their table (:data:`SEND_MOVES`, :data:`RECV_MOVES`) does not list (:class:`~cudarecv.core.lifecycle.
IllegalMove`); docs/design.md draws both tables, and tests/test_states.py checks the page against them.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

from ..core.lifecycle import Lifecycle
from ..plan.header import PayloadRoute
from .policy import DEVICE, HOST, Kind

#: the back tags of each channel (``BACK_TAGS + base + k`` for segment k; its ANSWER on ``base``); the host
#: routes that skip the segments answer on ``BACK_TAGS + 2`` (:data:`~cudarecv.samehost.routes.STORAGE_BACK`)
BACK: dict[Kind, int] = {HOST: 0, DEVICE: 3}
RETRY_MAX = 1024  # transfers at most between two offers declined for now


class ChannelState(enum.Enum):
    """Where a channel stands (the sender's end has all four; the receiver's never ``OFFERED``)."""

    #: nothing offered yet, or the last offer was declined for now
    NEW = "new"
    #: (sender) segments offered after a header; the receiver's ANSWER is on its way
    OFFERED = "offered"
    #: payloads go through the segments (the receiver mapped them)
    SHARED = "shared"
    #: declined for good, or (sender) a transfer failed: the segments are never touched again
    WIRE = "wire"


#: the sender's moves: an offer goes out (NEW, SHARED: a larger re-offer), its ANSWER comes back (SHARED; NEW
#: or the SHARED kept when declined for now; WIRE when declined for good), a failed transfer leaves for WIRE
SEND_MOVES: dict[ChannelState, frozenset[ChannelState]] = {
    ChannelState.NEW: frozenset({ChannelState.OFFERED, ChannelState.WIRE}),
    ChannelState.OFFERED: frozenset({ChannelState.SHARED, ChannelState.NEW, ChannelState.WIRE}),
    ChannelState.SHARED: frozenset({ChannelState.OFFERED, ChannelState.WIRE}),
}
#: the receiver's moves: an offer mapped (SHARED; again on a larger re-offer, whose mappings replace the old),
#: or declined for good (WIRE); one declined for now moves nothing (what was mapped stays)
RECV_MOVES: dict[ChannelState, frozenset[ChannelState]] = {
    ChannelState.NEW: frozenset({ChannelState.SHARED, ChannelState.WIRE}),
    ChannelState.SHARED: frozenset({ChannelState.SHARED, ChannelState.WIRE}),
}
INITIAL = ChannelState.NEW


@dataclasses.dataclass
class Retry:
    """When a channel whose offer was declined for now offers again: these travel together."""

    #: the side's transfer count from which an offer declined for now is made again
    at: int = 0
    #: transfers between the next declined offer and a new one (doubles up to RETRY_MAX)
    wait: int = 1
    #: a re-offer of this size was declined: larger ones go on the wire for now
    too_big: int | None = None

    def declined(self, transfers: int, total: int | None) -> None:
        """An offer (of ``total`` bytes, if a re-offer that keeps the shared segments) was declined for now."""
        if total is not None:
            self.too_big = total
        self.at, self.wait = transfers + self.wait, min(2 * self.wait, RETRY_MAX)

    def taken(self) -> None:
        self.wait, self.too_big = 1, None


class SendChannel:
    """The sender's segments of one kind of memory (host: memfd, device: CUDA IPC) and their state."""

    def __init__(self, kind: Kind, device: torch.device) -> None:
        self.kind, self.device, self.back = kind, device, BACK[kind]
        self.route = PayloadRoute.SEGMENT if kind == HOST else PayloadRoute.DEVICE_SEGMENT
        self._life = Lifecycle(f"the {kind} channel's sender", INITIAL, SEND_MOVES)
        # host: shared_memory.Segment, device: cuda_ipc.DeviceSegment (one kind per channel)
        self.segments: list[Any] = []
        # the segments shared before a re-offer, until answered
        self.previous: list[Any] | None = None
        self.offered = 0  # the bytes of the last offer's segments
        self.next = 0  # the segment the next transfer takes
        self.retry = Retry()

    @property
    def state(self) -> ChannelState:
        return self._life.state

    def move(self, to: ChannelState) -> None:
        """The one way the state changes (:data:`SEND_MOVES`; anything else raises ``IllegalMove``)."""
        self._life.move(to)

    def leave(self) -> None:
        """For the wire, for good, whatever the state (a failed transfer; a declined offer): the segments let go."""
        self._life.move_if(ChannelState.WIRE)  # (False: left already; every other state may leave)
        self.segments, self.previous = [], None

    @property
    def capacity(self) -> int:
        return self.segments[0].capacity if self.segments else 0

    def may_offer(self, seq: int, total: int) -> bool:
        """Whether a transfer of ``total`` bytes, the side's ``seq``-th, carries an offer of new segments."""
        if self.state is ChannelState.NEW:
            return seq >= self.retry.at
        return self.state is ChannelState.SHARED and (
            seq >= self.retry.at or self.retry.too_big is None or total < self.retry.too_big
        )


class RecvChannel:
    """The receiver's mappings of one kind of the sender's segments, and their state."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self._life = Lifecycle(f"the {kind} channel's receiver", INITIAL, RECV_MOVES)
        # host: shared_memory.Mapping, device: cuda_ipc.DeviceMapping (one kind per channel)
        self.mappings: list[Any] = []

    @property
    def state(self) -> ChannelState:
        return self._life.state

    def move(self, to: ChannelState, mappings: list[Any]) -> None:
        """The one way the state changes (:data:`RECV_MOVES`), with the mappings that go with the new state."""
        self._life.move(to)
        self.mappings = mappings


def back_tag(kind: Kind, segment: int) -> int:
    """The back tag (``BACK_TAGS + this``) of segment ``segment`` of a channel of ``kind``."""
    return BACK[kind] + segment
