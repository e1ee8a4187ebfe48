"""How a sender takes receivers on: the handshake's answers made members (:func:`enrol`), and members served
from the next push on (:func:`serve`): at construction for ranks of a group, at each join for receivers that
join through a store (:mod:`cudarecv.weights.membership`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.log import logger
from ..samehost import doorbell
from ..samehost.doorbell import Bell
from ..samehost.shared_memory import MappingError
from . import handshake
from .serving import start_listening
from .session import Member, Session, Standing
from .snapshots import SnapshotPool
from .transports.registry import WIRE
from .transports.wire import rules

if TYPE_CHECKING:
    from ..wire.staging import Lane


def enrol(
    session: Session,
    pool: SnapshotPool,
    lanes: list[Lane],
    raw: bytes,
    session_id: int,
    idents: list[int] | None = None,
    pids: list[int] | None = None,
) -> list[Member]:
    """The handshake with the receivers at the ends of ``lanes`` (schema ``raw``): their members, not served
    yet. Receivers that joined through a store have ``idents`` (and ``pids``): the snapshots' descriptors then
    stay open for the next to join; else they are closed once these have mapped them."""
    try:
        answers = handshake.offer(
            lanes,
            raw,
            session.bucket_bytes,
            session.mode,
            session_id,
            pool.offer,
            session.transport,
            session.timeout,
        )
    finally:
        if not session.elastic:
            pool.close_fds()
    members = []
    for i, (lane, answered) in enumerate(zip(lanes, answers)):
        member = Member(
            lane, answered.host, idents[i] if idents else None, pids[i] if pids else None
        )
        if answered.shared:  # it took the offer
            member.transport = session.transport
            member.bell = _bell(member, answered.bell)
        member.alias = answered.alias
        members.append(member)
    return members


def _bell(member: Member, offer: str) -> Bell | None:
    """The doorbell ``member`` offers, mapped (None: it offers none, or this process cannot map it: its headers go on
    the link, logged)."""
    if not offer or member.lane.nccl or doorbell.available() is not None:
        return None
    try:
        return Bell(offer)
    except MappingError as error:
        logger.info(
            "weight sender: %s's doorbell is not mapped (%s): its headers go on the link",
            member.who,
            error,
        )
        return None


def serve(session: Session, pool: SnapshotPool, members: list[Member]) -> None:
    """Serve ``members`` from the next push on: what they map (not with relay fan-out), their listeners."""
    for member in members:
        if session.fanout == "relay" and member.transport.header_only:
            member.transport = WIRE  # a relay chain moves payloads
            member.bell = None
        member.alias = member.alias and member.transport.zero_copy
    if (
        session.mode == "sync"
        and any(m.transport is not WIRE for m in members)
        and not pool.populated
    ):
        session.transport.warm(pool.segments, any(m.alias for m in members))
        pool.populated = True
    with session.cond:
        latest = pool.latest
        for member in members:
            member.move(Standing.SERVED)
            if member.bell is not None and session.mode == "latest":
                # its doorbell says the newest version now, then each push's (``ring_replies``, under this lock)
                member.bell.say_latest(latest.pushed.version if latest is not None else 0)
        session.members.extend(members)
    for member in members:
        # the receiver's asks and BYE (see cudarecv.weights.wire); on NCCL they are read in turn
        if rules(member.lane.link).standing:
            start_listening(session, pool, member)
