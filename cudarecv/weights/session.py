"""What a weight sender's mechanisms share: its :class:`Session` (schema, tags, lock, settings, version) and its
view of each receiver (:class:`Member`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ..core.driver import Driver
from ..wire.staging import Lane
from .schema import Schema
from .transports.base import Transport
from .transports.registry import WIRE
from .wire import Ask, SessionTags


class Member:
    """The sender's view of one receiver: its lane, its driver, and why it is gone (if it is)."""

    def __init__(
        self, lane: Lane, host: str = "", ident: int | None = None, pid: int | None = None
    ) -> None:
        self.lane = lane
        #: its rank in the group, or (a receiver that joined through a store) its number among the joins
        self.rank = lane.link.peer if ident is None else ident
        self.host, self.pid = host, pid
        #: how errors and the log name it
        self.who = (
            f"rank {self.rank}" if ident is None else f"receiver {ident} (host {host}, pid {pid})"
        )
        self.driver = Driver(f"cudarecv-push-{self.rank}")
        self.gone: str | None = None  # why it is no longer served
        self.leaving = False  # it said BYE: nothing new is sent to it
        self.asked: int | None = None  # latest mode: it wants a version newer than this
        self.replying = False
        self.said_last = False  # CLOSED or RELEASED sent (once)
        self.named = False  # its failure reached the caller, in a push's error
        self.listener: threading.Thread | None = None
        self.got: Ask | None = (
            None  # relay, shared memory: the receiver's last word on a version (GOT)
        )
        #: what carries its pushes: the session's transport if it took the offer (and no relay chain needs it on
        #: the wire), else the wire
        self.transport: Transport = WIRE
        self.alias = False  # zero-copy: it publishes the versions where they lie in the segments
        self.holding: dict[
            int, Any
        ] = {}  # zero-copy: the snapshot of each version it may still read
        #: the last transfer of a version to it (a push's or a reply's): failed at once when its listener finds
        #: the link dead, so that no push waits its whole timeout on a send to a dead receiver
        self.sending: Any = None

    @property
    def served(self) -> bool:
        return self.gone is None and not self.leaving

    @property
    def failed(self) -> bool:
        """Dropped for a failure (not told the sender's last word): its threads may wait on its link for good."""
        return self.gone is not None and not self.said_last


@dataclass
class Session:
    """A sender's state that its mechanisms (snapshots, fan-out, serving, drops) share; guarded by ``cond``."""

    schema: Schema
    piece: int
    tags: SessionTags
    timeout: float
    verify: bool
    mode: str
    fanout: str
    transport: (
        Transport  # where the snapshots lie, offered to every receiver (the wire: the sender's own)
    )
    cond: threading.Condition = field(default_factory=threading.Condition)
    members: list[Member] = field(default_factory=list)
    version: int = 0
    chain: list[int] = field(
        default_factory=list
    )  # the ranks (ids) of the last push's relay chain, in order
    closed: bool = False
    #: receivers join and leave through a store: a push never raises for one that failed (it is dropped and
    #: logged), and one with no receiver at all is no error
    elastic: bool = False

    def ranks(self) -> list[int]:
        """The ranks of the receivers still served."""
        return [m.rank for m in self.members if m.served]

    def held(self) -> list[tuple[int, int]]:
        """Under the lock: (rank, version) of every snapshot a zero-copy receiver holds."""
        return sorted({(m.rank, v) for m in self.members for v in m.holding})
