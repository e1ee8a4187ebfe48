"""How a weight sender's push goes, by mode (picked once, at construction):

- :class:`SyncPushes`: the version goes to every receiver still served, each transfer posted on the receiver's
  own driver (one failing never keeps the others), by the fan-out chosen at the handshake; a blocking push
  returns once every receiver has it, else the transfers are returned and the next push finishes them first.
- :class:`LatestPushes`: the version is copied into a free snapshot and published as the latest; each receiver
  gets it when it asks (:mod:`cudarecv.weights.serving`).

Either names, in its error, a receiver dropped since the last push (found dead by its listener); an elastic
sender's (receivers joining through a store) logs it instead, and raises for no receiver that failed.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ..core.errors import MismatchError, PeerError
from ..core.transfer import Transfer, here
from .fanout import chain_of, dropping, protocol
from .serving import ring_replies, serve
from .session import Member, Session, Standing
from .snapshots import Snapshot, SnapshotPool

if TYPE_CHECKING:
    import torch

    from ..core.protocol import Protocol, Submit
    from ..plan.plan import Plan


class Pushes:
    """What both modes keep: the pushes in flight (sync, ``wait=False``) and which drops were named."""

    def __init__(self, session: Session, pool: SnapshotPool) -> None:
        self.session, self.pool = session, pool
        self._in_flight: list[tuple[Member, Transfer]] = []

    def untold(self, live: list[Member]) -> list[Member]:
        """The receivers not in ``live`` dropped for a failure that no push's error has named yet (a receiver
        that died between pushes, found by its listener): named from now on."""
        with self.session.cond:
            others = [m for m in self.session.members if m not in live]
            return [m for m in others if m.move_if(Standing.NAMED, frm={Standing.DROPPED})]

    def finish_in_flight(self) -> None:
        """The push in flight must be out before the storage is reused (and before the sender closes); its failures
        were reported on its futures (and their receivers dropped)."""
        pending, self._in_flight = self._in_flight, []
        for _, transfer in pending:
            with contextlib.suppress(Exception):
                transfer.wait()

    def before_push(self) -> None:
        """What a push does first: sync mode finishes the push in flight (:meth:`finish_in_flight`)."""
        self.finish_in_flight()


class SyncPushes(Pushes):
    """Sync mode: every receiver gets every version (see the module docstring)."""

    def push(
        self,
        plan: Plan,
        live: list[Member],
        timeout: float,
        wait: bool,
        stream: torch.cuda.Stream | None,
    ) -> int | list[Transfer]:
        session, pool = self.session, self.pool
        target = pool.sync_target(timeout)
        pool.copy_in(plan, target, stream)
        # delta: a receiver reading the snapshot where it lies takes no patch (nothing to diff for it alone)
        if session.delta:
            if any(not (m.transport.header_only and m.transport.carries(target)) for m in live):
                pool.diff(target, stream)
            else:
                pool.forget_base()
        version, pushes = session.version, []
        with (
            session.cond
        ):  # (a receiver's BYE, and its RELEASED queued after what is in flight, wait for this)
            live = [
                m for m in live if m.served
            ]  # one that said BYE meanwhile may be released already: skip it
            chain = chain_of(session, live)
            session.chain = [m.rank for m in chain]
            hops = {id(m): i for i, m in enumerate(chain)}
            for member in live:
                # a header alone: a blocking push drives it here; a non-blocking one its listener (on the word), or
                # by a doorbell nothing until its end is needed (a lazy transfer: the next push or wait() takes the
                # word on the caller's thread, so no thread of this sender wakes while the caller computes)
                header_only = _header_only(member, target, hops)
                rung = header_only and member.rings
                sending, transfer_timeout = protocol(
                    session, pool, chain, hops.get(id(member)), member, target, timeout
                )
                member.awaiting = version if header_only and not wait and not rung else None
                driver: Submit | None = None
                if rung and not wait:  # (lazy: its driver is asked only if its end is needed first)
                    driver = member.driver.submit
                elif header_only and not wait:
                    driver = here
                member.sending = Transfer(
                    sending,
                    member.lane.stream,
                    timeout=None if header_only and wait else transfer_timeout,
                    driver=driver,
                    link=member.lane.link,
                    raise_first=False,
                    on_error=dropping(session, pool, member, version, timeout),
                    what=f"push of version {version} to {member.who}",
                    lazy=rung and not wait,
                )
                pushes.append((member, member.sending))
            for member in (
                [] if session.elastic else self.untold(live)
            ):  # dropped since the last push: named here
                error = PeerError(f"push of version {version}: {member.why}")
                pushes.append(
                    (
                        member,
                        Transfer(
                            _failing(error),
                            raise_first=False,
                            what=f"push of version {version} to {member.who}",
                        ),
                    )
                )
        if (
            not wait
        ):  # each is driven on its receiver's thread from the start: none waits for another
            self._in_flight = pushes
            return [transfer for _, transfer in pushes]
        _finish(pushes, version, session)
        return version


class LatestPushes(Pushes):
    """Latest mode: the newest version is published; each receiver takes it when it asks (on the link, answered on
    its driver; or by its doorbell, answered by the push that publishes a newer version: a lazy transfer, kept in
    flight until its word is taken)."""

    def before_push(self) -> None:
        """Replies rung by earlier pushes whose words came end here (on this thread); the others stay in flight (a
        push never waits for a receiver): their deadlines, the listener or :meth:`finish_in_flight` end them."""
        for _, transfer in self._in_flight:
            transfer.done()
        self._in_flight = [(m, t) for m, t in self._in_flight if not t.settled]

    def push(
        self,
        plan: Plan,
        live: list[Member],
        timeout: float,
        wait: bool,
        stream: torch.cuda.Stream | None,
    ) -> int:
        session, pool = self.session, self.pool
        if self._in_flight and not pool.free_now():
            # the words of replies in flight let go of snapshots: taken as they come, on the receivers' drivers
            for _, transfer in self._in_flight:
                transfer.settle_in_background()
        target = pool.latest_target(timeout)
        try:
            pool.copy_in(plan, target, stream)
        finally:
            with session.cond:
                target.writing = False
        with session.cond:
            pool.latest = target
            for member in live:
                serve(session, pool, member)
            # every doorbell hears of it (a receiver joined since `live` was taken too); asks by them are answered
            replies, behind = ring_replies(session, pool, session.members, target)
            self._in_flight += replies
        for transfer in behind:  # (its word came: it ends here; the ask is served as it does)
            transfer.done()
        untold = [] if session.elastic else self.untold(live)
        if untold:
            raise PeerError(
                f"version {session.version} is published to ranks {session.ranks()}; "
                + "; ".join(f"{m.who}: {m.why}" for m in untold)
            )
        return session.version


def _header_only(member: Member, snapshot: Snapshot, hops: dict[int, int]) -> bool:
    """Whether a push to ``member`` is a header alone (a receiver reading the snapshot where it lies: the header
    goes, posted at once; then its word, a bounded wait). Such a push takes no thread of its own, and so no
    hand-off between threads (each a scheduler slice on a loaded machine): a blocking push waits for the word on
    the caller's thread, a non-blocking one is ended by the receiver's listener as the word comes (a deadline
    fails it if none comes). A payload on the wire is driven on the receiver's own thread, so that none waits
    for another."""
    transport = member.transport
    return (
        id(member) not in hops
        and transport.header_only
        and transport.carries(snapshot)
        and not member.lane.nccl
    )


def _finish(pushes: list[tuple[Member, Transfer]], version: int, session: Session) -> None:
    """Wait for every receiver's transfer (each bounded by its own timeout, all running at once); say who got the
    version (``session.reached``), then raise the first failure, naming its receiver and who got it. An elastic
    session's receiver that failed (or lost the version to a hop before it in a relay chain) is logged, never
    raised; one that rejected the version (its checksum or header) still is."""
    errors = []
    for _, transfer in pushes:
        try:
            transfer.wait()
        except Exception as error:  # noqa: BLE001 - re-raised below, with the ranks reached
            if not session.elastic or isinstance(error, MismatchError):
                errors.append(error)
    reached = [m.rank for m, t in pushes if not t.failed]
    with session.cond:
        session.reached = reached
    if errors:
        raise type(errors[0])(
            f"{errors[0]} (version {version} reached ranks {reached})"
        ) from errors[0]


def _failing(error: BaseException) -> Protocol:
    """A protocol that fails at once with ``error``."""
    yield from ()
    raise error
