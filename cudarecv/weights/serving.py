"""A weight sender's side of its receivers' words: the listener thread of each receiver (its asks in latest
mode, its GOT and FREED on shared memory and relays, its BYE), latest mode's replies (each receiver gets the
newest snapshot when it asks, on its own driver), and the sender's last word to each (CLOSED or RELEASED)."""

from __future__ import annotations

import contextlib
import functools
import math

from ..core.errors import OutOfStepError, PeerError
from ..core.log import logger
from ..core.shutdown import start_thread
from ..core.transfer import Transfer, here, run_standing
from ..wire.control import read_bytes
from .fanout import dropping, out_of_step, send, took_got
from .link import naming, run, send_bytes
from .session import OWED, Member, Session, Standing
from .snapshots import Snapshot, SnapshotPool
from .wire import (
    ASK,
    ASK_SIZE,
    BYE,
    FREED,
    GOT,
    RELEASED,
    HeaderKind,
    PushHeader,
    read_ask,
)


def start_listening(session: Session, pool: SnapshotPool, member: Member) -> None:
    """Start ``member``'s listener thread (gloo links: NCCL runs a pair's messages in order, no listener)."""
    member.listener = start_thread(
        _listen, f"cudarecv-listen-{member.rank}", (session, pool, member)
    )


def _listen(session: Session, pool: SnapshotPool, member: Member) -> None:
    """The receiver's words, for as long as it is connected; a dead or lying receiver is dropped."""
    lane, bell = member.lane, member.bell
    words = 0  # (its words on the link but ASK: what its doorbell says the listener took)
    while True:
        try:
            ask = read_ask(
                run_standing(
                    read_bytes(lane, ASK_SIZE, session.tags.ask, "receiver message", out_of_step),
                    lane.link,
                    lane.stream,
                    on_error=naming(lane.link, "weight sync", math.inf, "sent nothing"),
                )
            )
            kind, version = ask.kind, ask.version
            if bell is not None and kind != ASK:
                words += 1
                bell.took(words)
            if (
                (kind == ASK and session.mode != "latest")
                or (
                    kind == GOT
                    and session.fanout == "star"
                    and not member.transport.header_only
                    and not session.delta
                )
                or ((kind == FREED or ask.freed) and not member.alias)
            ):
                raise OutOfStepError(
                    f"the receiver sent a message this {session.mode} {session.fanout} sender "
                    "never asks for: out of step"
                )
            if kind == FREED:  # a zero-copy receiver let go of a snapshot (or said so with its GOT)
                with session.cond:
                    if not pool.let_go(member, version):
                        raise OutOfStepError(
                            f"the receiver let go of version {version}, which it does not "
                            "hold: out of step"
                        )
                continue
            if kind == GOT:
                with session.cond:
                    took_got(session, pool, member, ask)
        except Exception as error:  # noqa: BLE001 - a dead or lying receiver is dropped
            with session.cond:
                # (not once the sender's last word is said: the receiver may close its end then)
                why = f"{error}; {member.who} is dropped from this sender"
                if member.move_if(Standing.DROPPED, frm=OWED, why=why):
                    logger.warning("weight sender: %s", why)
                pool.retire(member)
                session.cond.notify_all()
                sending, gone = member.sending, member.why if member.failed else None
            if bell is not None:
                bell.kick()  # a push asleep on its doorbell finds it dropped
            if (
                sending is not None and gone is not None
            ):  # (its send may wait in gloo for good: it fails now)
                sending.abort(PeerError(gone))
            return
        if kind == BYE:
            with session.cond:  # (atomic with a push posting to the receivers still served)
                # its BYE: it leaves (RELEASED follows what is in flight to it), or answers CLOSED; a receiver
                # dropped meanwhile (a push to it failed) stays dropped
                if member.move_if(Standing.LEAVING, frm={Standing.SERVED}):
                    member.driver.submit(
                        functools.partial(_leaves, session, pool, member, member.sending)
                    )
                else:
                    member.move_if(Standing.DONE, frm={Standing.CLOSING})
                session.cond.notify_all()
            if bell is not None:
                bell.kick()  # a push asleep on its doorbell ends: it left
            _answered(session, member, None)  # (a push it will never answer ends: it left)
            return
        if kind == GOT:
            _answered(session, member, version)
            continue
        # a reply rung by a push, whose word came before this ask, ends here
        reply = member.sending
        if reply is not None:
            reply.done()
        with session.cond:
            member.asked = version
            serve(session, pool, member)


def _leaves(session: Session, pool: SnapshotPool, member: Member, sending: Transfer | None) -> None:
    """On ``member``'s driver, after its BYE: a lazy push in flight to it that nothing drove yet ends first (it takes
    the receiver's word, said before its BYE, while the receiver still holds what that word names), then RELEASED
    (which retires what it holds). Any other push has a driver of its own, as before."""
    if sending is not None:
        sending.finish_lazy()  # (never raises: the push's error is its own)
    last_word(session, pool, member, RELEASED)


def _answered(session: Session, member: Member, version: int | None) -> None:
    """The receiver's word on ``version`` came (None: it left): end the non-blocking push that waits for it, here,
    on its listener (no other thread is handed it: see :func:`~.pushes._header_only`). Its waits return at once:
    the word is in, and the header's send ended when the receiver read it."""
    with session.cond:
        sending, awaiting = member.sending, member.awaiting
        if sending is None or awaiting is None or (version is not None and version < awaiting):
            return
        member.awaiting = None
    sending.settle()  # (never raises: the transfer keeps its error)


def serve(session: Session, pool: SnapshotPool, member: Member) -> None:
    """Latest mode, under the lock: start a reply if ``member`` asked and a newer version exists."""
    latest = pool.latest
    if (
        member.served
        and not member.replying
        and member.asked is not None
        and latest is not None
        and latest.header is not None
        and latest.header.version > member.asked
        and not session.closed
    ):
        member.replying = True
        member.driver.submit(lambda: _reply(session, pool, member))


def _reply(session: Session, pool: SnapshotPool, member: Member) -> None:
    """Latest mode, on the receiver's driver: send it the newest snapshot (it asked on the link)."""
    with session.cond:
        snapshot = pool.latest
        # (a reply is started only once a version is published, and a newer one replaces it)
        assert snapshot is not None and snapshot.header is not None
        snapshot.readers += 1
        member.asked = None
    version = snapshot.header.version
    # a header alone (a receiver reading the snapshot where it lies, then its word: a bounded wait) is driven here,
    # on the receiver's thread; a payload on its own thread, which a wait in gloo past the deadline may keep
    driven_here = _header_only(member, snapshot)
    patch = pool.patch_from(snapshot, member.held) if session.delta and not driven_here else None
    transfer = Transfer(
        send(session, pool, member, snapshot, session.timeout, patch),
        member.lane.stream,
        timeout=session.timeout,
        driver=here if driven_here else None,
        link=member.lane.link,
        on_error=dropping(session, pool, member, version, session.timeout, told=False),
        raise_first=False,
        what=f"version {version} to {member.who}",
        on_end=functools.partial(_replied, session, pool, member, snapshot),
    )
    with session.cond:
        member.sending = transfer
        gone = member.why if member.failed else None  # (its listener found it dead first)
    if gone is not None:
        transfer.abort(PeerError(gone))
    if driven_here:
        transfer.settle()  # (never raises: a failure is the transfer's, and drops the receiver)
    with contextlib.suppress(Exception):  # a failure drops the receiver (its hook)
        transfer.wait()


def ring_replies(
    session: Session, pool: SnapshotPool, members: list[Member], snapshot: Snapshot
) -> tuple[list[tuple[Member, Transfer]], list[Transfer]]:
    """Latest mode, under the lock, on the pushing thread, once ``snapshot`` is published: say so on every
    doorbell, and answer each receiver that asked by its doorbell for an older version (:meth:`Bell.published`):
    its header rung here, the reply a lazy transfer (nothing of the sender wakes for it: its word is taken by the
    next push, by the listener if the receiver asks on the link next, before the answer to its BYE, or at its
    deadline). The replies started, and those in flight to receivers whose ask was taken meanwhile: each such ask
    is answered as one on the link once that reply ends, which the caller ends at once (:meth:`Transfer.done`,
    outside the lock: the receiver said its word on that reply before it asked)."""
    assert snapshot.header is not None
    version, replies, behind = snapshot.header.version, [], []
    for member in members:
        bell = member.bell
        if bell is None or not member.served:
            continue
        floor = bell.published(version)
        if floor is None:
            continue
        if member.replying or not (member.rings and _header_only(member, snapshot)):
            member.asked = floor  # (answered as an ask on the link: when its reply in flight ends)
            serve(session, pool, member)
            if member.replying and member.sending is not None:
                behind.append(member.sending)
            continue
        snapshot.readers += 1
        member.replying = True
        member.sending = Transfer(
            send(session, pool, member, snapshot, session.timeout),
            member.lane.stream,
            timeout=session.timeout,
            driver=member.driver.submit,
            link=member.lane.link,
            on_error=dropping(session, pool, member, version, session.timeout, told=False),
            raise_first=False,
            what=f"version {version} to {member.who}",
            lazy=True,
            on_end=functools.partial(_replied, session, pool, member, snapshot),
        )
        replies.append((member, member.sending))
    return replies, behind


def _header_only(member: Member, snapshot: Snapshot) -> bool:
    """Whether a reply to ``member`` is a header alone (it reads ``snapshot`` where it lies)."""
    transport = member.transport
    return transport.header_only and transport.carries(snapshot) and not member.lane.nccl


def _replied(
    session: Session, pool: SnapshotPool, member: Member, snapshot: Snapshot, transfer: Transfer
) -> None:
    """A reply ended (on the thread that ended it): let go of its snapshot, and serve the receiver again (it may
    have asked on the link meanwhile)."""
    with session.cond:
        snapshot.readers -= 1
        # a failed copy out of a stamped segment is never published: the segment may be written again
        stamped = member.transport.stamped and member.transport.carries(snapshot)
        if transfer.failed and not stamped and snapshot in pool.snapshots:
            pool.replace(
                snapshot
            )  # its parked send may still read the buffer: never write it again
        member.replying = False
        serve(session, pool, member)
        session.cond.notify_all()


def last_word(session: Session, pool: SnapshotPool, member: Member, kind: HeaderKind) -> None:
    """Send ``member`` the sender's last header (CLOSED or RELEASED), once."""
    # (said once: CLOSED leaves it closing until its BYE; RELEASED answers that BYE)
    with session.cond:
        if not member.move_if(
            Standing.CLOSING if member.standing is Standing.SERVED else Standing.DONE, frm=OWED
        ):
            return
    header = PushHeader(
        session.version,
        session.schema.total,
        session.bucket_bytes,
        session.schema.fingerprint,
        kind=kind,
    )
    with contextlib.suppress(Exception):  # a receiver gone meanwhile: nothing left to tell
        run(
            send_bytes(member.lane, header.pack(), session.tags.header),
            member.lane,
            session.timeout,
            "weight-sync close",
            "took no close message",
        )
    if kind == RELEASED:
        with session.cond:
            logger.info("weight sender: %s closed its receiver: no longer served", member.who)
            pool.retire(
                member
            )  # its published version stays readable: where it lies, never written again
            session.cond.notify_all()
