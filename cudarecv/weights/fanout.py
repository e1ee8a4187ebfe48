"""How a push reaches a receiver: its transfer's protocol (star: the header and the payload, or through a shared
segment the header alone; relay: the header naming its hops, the payload to the head of the chain only),
the receiver's word that it has the version (relay, shared memory, delta, and every push on NCCL), and what a
failed transfer does to the receiver (the drop policy; on NCCL, also to its pair group: :func:`abort_group`).
The fan-out is picked once, at the handshake: :func:`protocol`."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core import streams, transport
from ..core.errors import (
    ChecksumError,
    Error,
    MismatchError,
    OutOfStepError,
    PeerError,
    PushHeaderError,
    RelayLost,
    TransferTimeout,
    UsageError,
)
from ..core.link import Link
from ..core.log import logger
from ..core.protocol import Protocol, Work
from ..samehost.doorbell import Bell
from ..samehost.machine import host_id
from ..wire.control import wire_bytes
from ..wire.staging import Lane, evict_pair, is_pair, send_from
from .link import link_error, send_bytes
from .session import OWED, Member, Session, Standing
from .snapshots import Patch, Snapshot, SnapshotPool
from .transports.registry import WIRE
from .wire import (
    ASK_SIZE,
    GOT,
    LANDED,
    LOST,
    MAX_WAIT_MS,
    REJECTED,
    Ask,
    hop_limit,
    read_ask,
    trailer_message,
)


def out_of_step(text: str) -> OutOfStepError:
    return OutOfStepError(f"{text} (the link is out of step)")


def chain_of(session: Session, live: list[Member]) -> list[Member]:
    """The receivers a sync push relays through, in chain order (the others get it by the star): with
    ``fanout="relay"`` every receiver on the wire, in the order given (receivers that joined through a store: each
    host's next to each other, this host's first); an elastic sender's ``"auto"`` relays when at least two are on
    the wire and one is on another host (a sender's ``"auto"`` with a group chose at its handshake)."""
    if session.mode != "sync" or session.fanout == "star":
        return []
    wire = [m for m in live if not m.transport.header_only]
    if not session.elastic:
        return wire
    here = host_id()
    if session.fanout == "auto" and (len(wire) < 2 or all(m.host == here for m in wire)):
        return []
    return sorted(wire, key=lambda m: (m.host != here, m.host, m.rank))


def protocol(
    session: Session,
    pool: SnapshotPool,
    chain: list[Member],
    hop: int | None,
    member: Member,
    snapshot: Snapshot,
    timeout: float,
) -> tuple[Protocol, float]:
    """The protocol that pushes ``snapshot`` to ``member`` (``chain[hop]``, or by the star if ``hop`` is None), and
    how long it may take: ``timeout``; in a relay chain, as long as the hop after it waits (so a hop that timed out
    on a stopped one before it has ``timeout`` to say so)."""
    if hop is not None:
        patch = chain_patch(chain, snapshot)
        return _relayed(session, chain, hop, snapshot, timeout, patch), hop_limit(timeout, hop + 1)
    return send(session, pool, member, snapshot, timeout, snapshot.patch), timeout


def chain_patch(chain: list[Member], snapshot: Snapshot) -> Patch | None:
    """Delta, relay: the patch the chain forwards as it is, if every receiver of it holds the patch's base (else the
    version goes whole through the chain: a receiver that joined, or failed a push)."""
    patch = snapshot.patch
    if patch is None or any(m.held != patch.base for m in chain):
        return None
    return patch


def send(
    session: Session,
    pool: SnapshotPool,
    member: Member,
    snapshot: Snapshot,
    timeout: float,
    patch: Patch | None = None,
) -> Protocol:
    """Star: what the receiver's transport sends (the header and the payload on the wire, or, a receiver reading
    the snapshot where it lies, the header alone; delta: on the wire, ``patch`` if the receiver holds its base);
    then, header alone or delta, the receiver's word: it copied the version out, or (zero-copy) published it
    where it lies and holds it until FREED; delta: which version it holds now. A receiver with a doorbell gets
    the header and says its word by it (:mod:`cudarecv.samehost.doorbell`) once a push on the link said so. On
    NCCL every push waits for the receiver's word (:func:`_acked`)."""
    transport = member.transport if member.transport.carries(snapshot) else WIRE
    version = snapshot.pushed.version
    if transport.header_only and member.alias:
        with session.cond:
            snapshot.holders += 1
            member.holding[version] = snapshot
    # the version whole if it holds another (or none known), or its transport sends versions whole
    if not transport.patches or (patch is not None and member.held != patch.base):
        patch = None
    if patch is not None:
        member.payload = patch.storage.numel()
    else:
        member.payload = 0 if transport.header_only else snapshot.storage.numel()
    bell = member.bell if transport.header_only and not member.lane.nccl else None
    if bell is not None and snapshot.segment is not None:
        # its doorbell: the first push says on the link that the next ones ring it (and its word comes there)
        if member.rings:
            bell.ring(snapshot.rung())
            yield [Heard(session, pool, member, bell, version, time.monotonic() + timeout + 1.0)]
            return
        head = yield from send_from(
            member.lane,
            [wire_bytes(member.lane, snapshot.rung())],
            [session.tags.header],
            defer=True,
        )
        yield from _confirmed(session, member, version, timeout, head or [])
        member.rings = True
        return
    if member.lane.nccl and not transport.header_only and not session.delta:
        yield from _acked(session, member, snapshot, timeout)
        return
    head = yield from (
        transport.push(member.lane, snapshot, session.tags, patch)
        if patch is not None
        else transport.push(member.lane, snapshot, session.tags)
    )
    if transport.header_only or session.delta:
        yield from _confirmed(session, member, version, timeout, head or [])


def _acked(session: Session, member: Member, snapshot: Snapshot, timeout: float) -> Protocol:
    """Star on NCCL: the header, asking for the receiver's word (``ack``), the payload, then the word. An NCCL send's
    work is done once it is queued on the pair's stream, never once the receiver has the bytes (nor at all, if it
    never posts its receives): only the word says the receiver has the version (docs/weight-sync.md, "NCCL failure
    semantics")."""
    lane, tags = member.lane, session.tags
    header = dataclasses.replace(snapshot.pushed, ack=True)
    yield from send_from(lane, [wire_bytes(lane, header.pack())], [tags.header])
    yield from send_from(lane, snapshot.chunks, [tags.payload] * len(snapshot.chunks))
    yield from _confirmed(session, member, header.version, timeout)


def _relayed(
    session: Session,
    chain: list[Member],
    i: int,
    snapshot: Snapshot,
    timeout: float,
    patch: Patch | None,
) -> Protocol:
    """Relay, to ``chain[i]``: its header (naming its hops); the payload (the version, or ``patch``: delta) and the
    trailer to the head of the chain only; then the receiver's word that it has the version."""
    member, lane = chain[i], chain[i].lane
    chunks = snapshot.chunks if patch is None else patch.chunks
    member.payload = sum(c.numel() for c in chunks) if i == 0 else 0
    header = dataclasses.replace(
        snapshot.pushed if patch is None else patch.header,
        relayed=True,
        hop=i,
        wait_ms=min(math.ceil(hop_limit(timeout, i) * 1e3), MAX_WAIT_MS),
        up=lane.link.pg.rank() if i == 0 else chain[i - 1].rank,
        down=chain[i + 1].rank if i + 1 < len(chain) else -1,
    )
    head = yield from send_from(
        lane, [wire_bytes(lane, header.pack())], [session.tags.header], defer=True
    )
    if i == 0:
        payload, trailer = session.tags.relay(header.version)
        yield from send_from(lane, chunks, [payload] * len(chunks))
        yield from send_bytes(lane, trailer_message(header.version), trailer)
    if head:
        yield head
    yield from _confirmed(session, member, header.version, hop_limit(timeout, i + 1))


def _confirmed(
    session: Session, member: Member, version: int, timeout: float, head: Sequence[Work] = ()
) -> Protocol:
    """Wait for the receiver's word on ``version`` (relay, shared memory): raises if it did not publish it. Then
    the header's send works ``head`` (posted, not waited for): the word says the receiver read the header, so they
    have ended; a wait on the word first is bounded, where a gloo send is not."""
    if member.lane.nccl:  # no listener on NCCL: the word comes here, in order on the pair's stream
        word = _Word(member.lane, session.tags.ask, time.monotonic() + timeout + 1.0, member.who)
        yield [word]
        ask = read_ask(word.value())
        if ask.kind != GOT:
            raise out_of_step("the receiver sent no acknowledgement")
        member.got = ask
    yield [Got(session, member, version, time.monotonic() + timeout + 1.0), *head]


#: the longest sleep between two looks at whether a receiver's word on NCCL has come (:class:`_Word`)
WORD_POLL = 0.01


class _Word:
    """A receiver's word on NCCL, its receive posted on ``lane`` (on ``tag``): a work whose wait orders the lane's
    stream after the receive, copies the word to the host and waits there for it, until ``deadline`` (the push's,
    :func:`time.monotonic`) at most. The host waits in the transfer's wait, never in the step that posts it, so the
    transfer's deadline can fail it meanwhile (a receiver that never pulls never says it: the receive stays posted
    until its pair group is aborted, :func:`abort_group`). The wait looks at the copy's event (a short sleep
    between looks) rather than blocking on it: if the abort fails, or the group cannot be aborted, the event never
    fires, and the driver thread still comes back by the deadline (the sender's close joins it)."""

    def __init__(self, lane: Lane, tag: int, deadline: float, who: str = "the receiver") -> None:
        self.lane, self.deadline, self.who = lane, deadline, who
        with lane.on_stream():  # (allocated on the stream whose work writes it)
            self._raw = torch.empty(ASK_SIZE, dtype=torch.uint8, device=lane.cuda.device)
            self._posted = lane.post(False, [self._raw], [tag])
        self._host = lane.pool.buffers("pinned", ASK_SIZE, count=1)[0]
        self._arrived: torch.cuda.Event | None = None

    def is_completed(self) -> bool:
        return self._arrived is not None and self._arrived.query()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._arrived is None:
            with self.lane.on_stream():
                for work in self._posted:
                    work.wait()  # (NCCL: orders the lane's stream after the receive)
                self._host.copy_(self._raw, non_blocking=True)
                self._arrived = streams.record(self.lane.cuda)
        limit = self.deadline
        if timeout is not None:
            limit = min(limit, time.monotonic() + timeout.total_seconds())
        nap = 1e-4
        while not self._arrived.query():
            left = limit - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"{self.who} did not say it has the version in time")
            time.sleep(min(nap, left))
            nap = min(2 * nap, WORD_POLL)
        return True

    def value(self) -> bytes:
        """The word's bytes, once waited for."""
        return self._host.numpy().tobytes()


class Got:
    """A work that completes when ``member`` has said what became of ``version`` (or left, or is gone); ``wait``
    raises if it did not publish it, naming the rank that failed."""

    def __init__(self, session: Session, member: Member, version: int, deadline: float) -> None:
        self.session, self.member, self.version, self.deadline = session, member, version, deadline

    def _said(self) -> bool:
        m = self.member
        return not m.served or (m.got is not None and m.got.version >= self.version)

    def is_completed(self) -> bool:
        with self.session.cond:
            return self._said()

    def wait(self, timeout: timedelta | None = None) -> bool:
        m = self.member
        with self.session.cond:
            if not self.session.cond.wait_for(
                self._said, timeout=max(self.deadline - time.monotonic(), 0.0)
            ):
                raise TransferTimeout(f"{m.who} did not confirm version {self.version}")
            failed, got = m.why if m.failed else None, m.got
        if got is not None and got.version >= self.version:
            if (
                got.version == self.version and got.status == LOST and m.lane.nccl
            ):  # the communicator broke
                raise PeerError(
                    f"push of version {self.version}: {m.who} did not get it: rank {got.rank} before "
                    "it in the relay chain failed during the push, and on NCCL that broke its link"
                )
            if (
                got.version == self.version and got.status == LOST
            ):  # it stays served: its links are in step
                raise RelayLost(
                    f"push of version {self.version}: {m.who} did not get it: "
                    f"{'receiver' if self.session.elastic else 'rank'} {got.rank} before it in the "
                    "relay chain failed during the push; it keeps its last version, stays served and "
                    "gets the next through the chain healed"
                )
            if (
                got.version == self.version and got.status == REJECTED
            ):  # it stays served: its link is in step
                if self.session.verify:
                    raise ChecksumError(
                        f"push of version {self.version}: {m.who} rejected it: the BLAKE3 "
                        "digest of what it received, or its header, did not match what was sent "
                        "(corrupted on the way); it keeps its last version and stays served"
                    )
                raise PushHeaderError(
                    f"push of version {self.version}: {m.who} rejected its header; it keeps "
                    "its last version and stays served"
                )
            return True
        if failed is not None:
            raise PeerError(failed)
        return True


def took_got(session: Session, pool: SnapshotPool, member: Member, ask: Ask) -> None:
    """Under the lock: ``member``'s GOT ``ask`` came (on the link or by its doorbell): a zero-copy receiver let go of
    the snapshot it names as freed, and holds the version it published (or nothing of one it did not). Raises
    :class:`OutOfStepError` if it frees a version it does not hold, unless it has ended: a receiver's word said by
    its doorbell before its BYE may be taken after the BYE's RELEASED retired what it held (the BYE comes on the
    link, its listener's; the word by the page, to a push's caller who may take it later)."""
    if ask.freed and not pool.let_go(member, ask.freed) and not member.ended:
        raise out_of_step(f"the receiver let go of version {ask.freed}, which it does not hold")
    member.got = ask  # (delta: what it holds, Member.held)
    if ask.status != LANDED:  # a zero-copy receiver did not publish it: it holds nothing of it
        pool.let_go(member, ask.version)
    session.cond.notify_all()


#: how long a push asleep on a doorbell sleeps before it looks again by itself (a word or the listener's finding
#: wakes it; this bounds the wait when both ends moved the wake word at once and one move was lost)
NAP = 0.2


class Heard(Got):
    """A :class:`Got` whose word comes by ``member``'s doorbell ``bell``: its wait sleeps there (on this thread,
    until the deadline) and takes the word as the listener takes one on the link (:func:`took_got`); the listener,
    which still reads the link, wakes it if the receiver leaves or is found dead."""

    def __init__(
        self,
        session: Session,
        pool: SnapshotPool,
        member: Member,
        bell: Bell,
        version: int,
        deadline: float,
    ) -> None:
        super().__init__(session, member, version, deadline)
        self.pool, self.bell = pool, bell

    def _take(self) -> None:
        raw = self.bell.heard()
        if raw is None:
            return
        ask = read_ask(raw[:ASK_SIZE])
        if ask.kind != GOT or (ask.freed and not self.member.alias):
            raise out_of_step(f"the receiver's doorbell said {ask.kind.name}, not a GOT it can say")
        with self.session.cond:
            took_got(self.session, self.pool, self.member, ask)

    def is_completed(self) -> bool:
        # (a word not taken yet completes it: its wait takes it, and raises if the word is none it may say)
        return self.bell.answered() or super().is_completed()

    def wait(self, timeout: timedelta | None = None) -> bool:
        while True:
            wakes = self.bell.wakes()
            self._take()
            with self.session.cond:
                if self._said():
                    break
            left = self.deadline - time.monotonic()
            if left <= 0:
                break
            self.bell.sleep(wakes, min(left, NAP))
        return super().wait()  # (at once: raises if it did not publish the version, or timed out)


def dropping(
    session: Session,
    pool: SnapshotPool,
    member: Member,
    version: int,
    timeout: float,
    told: bool = True,
) -> Callable[[BaseException, float], BaseException]:
    """The error hook of a transfer of ``version`` to ``member``: name it, and drop it (``told``: the error
    reaches the caller, a push's future; else the next push names it). A receiver that rejected the version
    (its word), or lost it to a failure before it in the relay chain (logged), stays served."""

    def dropped(error: BaseException, elapsed: float) -> BaseException:
        if isinstance(error, RelayLost):
            logger.warning("weight sender: %s", error)
            return error
        if isinstance(error, MismatchError):
            return error
        wire = _pair_of(member)
        went = None if wire is None else _ABORTED.get(wire.pg)
        if went is not None:  # its pair group was aborted for another receiver: that is its failure
            failure: BaseException = PeerError(went)
        elif isinstance(error, Error) and not isinstance(error, TimeoutError):
            failure = (
                error  # it names the rank already (a dead one, or one upstream in a relay chain)
            )
        else:
            failure = link_error(
                member.lane.link,
                f"push of version {version}",
                error,
                timeout if isinstance(error, TimeoutError) else elapsed,
                f"did not take version {version}",
            )
        text = str(failure)
        if "is dropped from this sender" not in text:
            text += f"; {member.who} is dropped from this sender"
        if wire is not None and went is None:
            text += abort_group(session, pool, member, wire, text)
        elif wire is None and _on_nccl(member):
            text += _standalone(member)
        # (once: its listener may have heard it die first, and said so; a push's error names it at once)
        if member.move_if(Standing.NAMED if told else Standing.DROPPED, frm=OWED, why=text):
            logger.warning("weight sender: %s", text)
        elif told:
            member.move_if(Standing.NAMED, frm={Standing.DROPPED})
        pool.retire(member)
        if not member.transport.stamped:
            # its send (or, CUDA IPC, its copy) may still read the storage, long after this; a receiver of host
            # segments checks their stamps instead (a copy overtaken by a write is never published)
            pool.torn = True
        return type(failure)(text)

    return dropped


#: the pair groups a drop aborted, and why (what each receiver on one is told)
_ABORTED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_ABORTING = threading.Lock()
#: the abort threads a sender started, by the id of its session (:func:`join_aborts` at its close)
_ABORTS: dict[int, list[threading.Thread]] = {}


def _on_nccl(member: Member) -> bool:
    try:
        return member.lane.nccl
    except UsageError:  # (the sender closed)
        return False


def _pair_of(member: Member) -> Link | None:
    """The pair group of cudarecv's own that ``member``'s messages go on (``Lane.wire``), while it is in use:
    the one kind of NCCL group cudarecv aborts (None: another backend, a standalone group used as it is, or the
    sender let go of it)."""
    try:
        wire = member.lane.wire
    except UsageError:  # (the sender closed)
        return None
    if wire is None or wire.backend != "nccl":
        return None
    # (an aborted pair is evicted at once, but stays one for the errors of the ends that were on it)
    return wire if is_pair(wire) or wire.pg in _ABORTED else None


def _standalone(member: Member) -> str:
    """``member`` failed on a standalone NCCL group (the user's, not registered with torch.distributed: no store
    to form a pair group on): cudarecv does not abort the user's group. Says what happens then."""
    logger.error(
        "weight sender: %s failed on a standalone NCCL group, which cudarecv does not abort (it is yours): what "
        "was posted to it stays posted, and once the group's timeout has passed torch's watchdog takes this "
        "process down; pass a group registered with torch.distributed (dist.new_group), on which each receiver "
        "gets a pair group of cudarecv's own that is aborted alone",
        member.who,
    )
    return (
        "; its NCCL group is standalone, which cudarecv does not abort: what was posted to it stays posted, "
        "and torch's watchdog takes this process down once the group's timeout has passed (pass a group "
        "registered with torch.distributed to have a failed receiver cost only itself)"
    )


def abort_group(
    session: Session, pool: SnapshotPool, member: Member, wire: Link, failure: str
) -> str:
    """``member`` failed on NCCL (``failure``): end what this sender posted to it, and say how (to add to the error).

    NCCL cannot cancel a posted op: a send (or the receive of the receiver's word) that its peer never matches
    stays posted, and once the group's timeout has passed torch's watchdog takes the whole process down. torch ends
    such ops only by aborting a communicator, and only ``ProcessGroupNCCL.abort()``, which aborts every
    communicator of the group, also stops its watchdog from turning that into a process abort. So the group
    ``wire`` is on is aborted: always a pair group of cudarecv's own (:func:`cudarecv.wire.staging.pair_link`),
    never the user's, so the user's collectives and every other receiver go on (another weight end of this
    process on the same pair, if any, is dropped with it). It is evicted, so a new weight end with that peer
    forms a new one.

    The abort runs on a thread of its own (``cudarecv-abort-<rank>``; the sender's close joins it,
    :func:`join_aborts`): ``abort()`` may block for up to the group's timeout, and this runs on the deadlines
    thread, under the transfer's lock. It holds the group's posting lock
    (:func:`cudarecv.core.transport.posting`), so no cudarecv post is in flight on the group meanwhile. See
    docs/weight-sync.md, "NCCL failure semantics"."""
    group = wire.pg
    with _ABORTING:
        if group in _ABORTED:
            return ""
        others = [m for m in list(session.members) if m is not member and _pair_of(m) is wire]
        why = (
            f"its NCCL pair group was aborted, as {member.who} failed during a push on it ({failure}): NCCL "
            "cannot cancel what was posted to it"
        )
        _ABORTED[group] = why
    # evicted now, before the abort thread starts: no release (a close) may shut down, nor a new weight end form
    # on, a pair that is being aborted
    evict_pair(wire)
    dropped = [m for m in others if m.move_if(Standing.DROPPED, frm=OWED, why=f"{m.who}: {why}")]
    for other in dropped:
        pool.retire(other)
        if not other.transport.stamped:
            pool.torn = True  # (a send to it may still read the snapshot, as to the failed one)
    thread = threading.Thread(
        target=_abort,
        args=(member.who, wire, others, why),
        name=f"cudarecv-abort-{member.rank}",
        daemon=True,
    )
    with _ABORTING:
        _ABORTS.setdefault(id(session), []).append(thread)
    thread.start()
    return (
        "; on NCCL, which cannot cancel what was posted to it, the communicator of its pair group (cudarecv's "
        "own, never your process group) is aborted"
    )


def _abort(who: str, wire: Link, others: list[Member], why: str) -> None:
    """The abort thread of :func:`abort_group`: abort ``wire``'s pair group under its posting lock, evict it."""
    group = wire.pg
    try:
        with transport.posting(group):
            backend: Any = group
            if isinstance(group, dist.ProcessGroup):
                backend = group._get_backend(torch.device("cuda"))
            backend.abort()
    except Exception as error:  # noqa: BLE001 - said: what stays posted may then take the process down
        logger.error(
            "weight sender: the NCCL pair group of %s could not be aborted (%s): what was posted to it stays "
            "posted, and torch's watchdog may take this process down once the group's timeout has passed",
            who,
            error,
        )
        return
    for other in others:  # a push in flight to another receiver on the pair: its link is gone now
        sending = other.sending
        if sending is not None and not sending.settled:
            sending.abort(PeerError(f"{other.who}: {why}"))


def join_aborts(session: Session, timeout: float) -> None:
    """At the sender's close: wait for the abort threads its drops started (within ``timeout``; one still running
    is said, and left: a daemon thread, blocked in NCCL's abort)."""
    with _ABORTING:
        threads = _ABORTS.pop(id(session), [])
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
        if thread.is_alive():
            logger.warning(
                "weight sender: %s still aborts an NCCL pair group at close (left running)",
                thread.name,
            )
