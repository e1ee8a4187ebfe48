"""How a sender takes receivers on: the handshake's answers made members (:func:`enrol`), and members served
from the next push on (:func:`serve`): at construction for ranks of a group, at each join for receivers that
join through a store (:mod:`cudarecv.weights.membership`)."""

from __future__ import annotations

from typing import Any

from ..core.transfer import SHARED_MEMORY
from . import handshake
from .serving import start_listening
from .session import Member, Session, Standing
from .snapshots import SnapshotPool


def enrol(
    session: Session,
    pool: SnapshotPool,
    lanes: list[Any],
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
            session.piece,
            session.mode,
            session_id,
            pool.offer,
            session.shared_kind,
            session.timeout,
        )
    finally:
        if not session.elastic:
            pool.close_fds()
    members = []
    for i, (lane, (host, shared, alias)) in enumerate(zip(lanes, answers)):
        member = Member(lane, host, idents[i] if idents else None, pids[i] if pids else None)
        member.shared, member.alias = shared, alias
        members.append(member)
    return members


def serve(session: Session, pool: SnapshotPool, members: list[Member]) -> None:
    """Serve ``members`` from the next push on: what they map (not with relay fan-out), their listeners."""
    for member in members:
        member.shared = member.shared and session.fanout != "relay"
        member.alias = member.shared and member.alias and session.shared_kind == SHARED_MEMORY
    if (
        session.mode == "sync"
        and session.shared_kind == SHARED_MEMORY
        and any(m.shared for m in members)
        and not pool.populated
    ):
        # the first push would pay for allocating its snapshot's pages (about 0.7 s per GB): here, once; and
        # for the second snapshot, which zero-copy pushes take turns with
        for segment in pool.segments[: 2 if any(m.alias for m in members) else 1]:
            segment.populate()
        pool.populated = True
    with session.cond:
        for member in members:
            member.move(Standing.SERVED)
        session.members.extend(members)
    for member in members:
        if (
            member.lane.link.backend != "nccl"
        ):  # the receiver's asks and BYE (see cudarecv.weights.wire)
            start_listening(session, pool, member)
