"""What both ends of a weight sync share: argument checks, the per-peer driver thread,
control-message runs and errors that name the peer.

The protocol itself (messages, tags, the handshake) is described in
:mod:`cudarecv.weights.wire`; the two ends are :mod:`cudarecv.weights.sender` and
:mod:`cudarecv.weights.receiver`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.errors import (
    ArgumentError,
    LinkError,
    MismatchError,
    OutOfStepError,
    PeerError,
    TransferTimeout,
)
from ..core.link import Link, as_rank, peer_failure
from ..core.transfer import Transfer
from ..wire.control import wire_bytes
from ..wire.staging import Lane, send_from

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..core.protocol import Protocol


def check_peers(value: Any, name: str) -> list[int] | None:
    """A rank or a list (tuple) of distinct ranks, as a list of ints."""
    if value is None:
        return None
    peers = [as_rank(p, name) for p in (value if isinstance(value, (list, tuple)) else [value])]
    if not peers:
        raise ArgumentError(f"`{name}` is empty: pass at least one rank")
    if len(set(peers)) != len(peers):
        raise ArgumentError(f"`{name}` names a rank twice: {peers}")
    return peers


def link_error(
    link: Link, what: str, error: BaseException, seconds: float, silent: str
) -> LinkError:
    """``error`` on the link to ``link.peer`` as a :class:`TransferTimeout` or :class:`PeerError` naming the peer.

    ``seconds``: the time that ran out (a timeout) or that had passed (a failure);
    ``silent`` says what the peer did not do, e.g. ``"sent nothing"``.
    """
    if isinstance(error, TimeoutError):
        return TransferTimeout(
            f"{what}: rank {link.peer} of the group {silent} within {seconds:g} s"
        )
    return PeerError(
        f"{what}: the link to rank {link.peer} of the group failed after {seconds:.3g} s "
        f"(did its process die?): {peer_failure(error)}"
    )


def naming(
    link: Link, what: str, timeout: float, silent: str
) -> Callable[[BaseException, float], BaseException]:
    """An error hook that names the peer (ours: a mismatch or a lie, stays as it is)."""

    def named(error: BaseException, elapsed: float) -> BaseException:
        if isinstance(error, (MismatchError, OutOfStepError)):
            return error
        return link_error(
            link, what, error, timeout if isinstance(error, TimeoutError) else elapsed, silent
        )

    return named


def run(
    protocol: Protocol, lane: Lane, timeout: float, what: str, silent: str = "sent nothing"
) -> Any:
    """Drive a control-message protocol to its end within ``timeout`` seconds."""
    return Transfer(
        protocol,
        lane.stream,
        on_error=naming(lane.link, what, timeout, silent),
        timeout=timeout,
        link=lane.link,
        what=f"{what} with rank {lane.link.peer}",
    ).wait()


def send_bytes(lane: Lane, data: bytes, tag: int) -> Protocol:
    """A protocol that sends ``data`` as one message on ``tag``."""
    yield from send_from(lane, [wire_bytes(lane, data)], [tag])


class Unanswered:
    """Messages posted to one peer on one tag without waiting for them (words the peer may never
    take: it may be gone already), kept alive until the peer has shown it took them.

    gloo reports a send complete only once something waits for it, so a message never waited for
    would be kept until exit (about 2.5 KB each: two per pull, a leak). The peer's single reader
    takes one tag's messages in the order they were posted, so once it has answered a later message
    (the owner knows which answer proves that) every earlier one is taken, and waiting for it returns
    at once: :meth:`taken` hands those over for the owner's protocol to wait for. What is left at
    the end is kept with the group (:data:`_LEFT`) by :meth:`forget`.

    Example (a receiver: the sender's next push shows it took every word up to ``mark``)::

        mark = asks.post(ask_message(GOT, version, LANDED))
        ...                                   # the next push's header arrives
        yield asks.taken(mark)                # waited: returns at once
    """

    def __init__(self, lane: Lane, tag: int) -> None:
        self._lane: Lane | None = lane
        self._tag = tag
        self._lock = threading.Lock()
        self._posted: list[
            tuple[int, tuple[dist.Work, ...]]
        ] = []  # (sequence number, works), oldest first
        self._count = 0
        self._leave = weakref.finalize(
            self, _leave, self._posted, weakref.ref(lane.link.pg)
        )  # also if never closed

    def post(self, data: bytes) -> int:
        """Post ``data`` and return its sequence number (a mark for :meth:`taken`); nothing once forgotten."""
        with self._lock:  # posted under the lock: the numbers follow the order gloo matches them in
            if self._lane is None:
                return self._count
            protocol = send_from(
                self._lane, [wire_bytes(self._lane, data)], [self._tag], defer=True
            )
            try:
                next(protocol)
                works: tuple[dist.Work, ...] = ()
            except StopIteration as posted:
                works = tuple(posted.value or ())
            self._count += 1
            if works:
                self._posted.append((self._count, works))
            return self._count

    def mark(self) -> int:
        """The sequence number of the last message posted."""
        with self._lock:
            return self._count

    def taken(self, mark: int) -> list[dist.Work]:
        """The works of the messages up to ``mark``, which the peer has taken (the caller knows it): to be
        waited for, which lets them go."""
        with self._lock:
            done = [works for count, works in self._posted if count <= mark]
            self._posted[:] = [entry for entry in self._posted if entry[0] > mark]
        return [work for works in done for work in works]

    def forget(self) -> None:
        """At the end: leave what the peer has not shown it took with the group, and post nothing more."""
        with self._lock:
            self._lane = None
            self._leave()


#: group -> the works of words its peers never showed they took (a closed receiver's last GOT, its BYE
#: crossing the sender's CLOSED): kept while the group lives, so none is cancelled mid-stream, and let go
#: with it (parked for good, they kept a destroyed group's gloo context and its thread until exit)
_LEFT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _leave(
    posted: list[tuple[int, tuple[dist.Work, ...]]], group: weakref.ref[dist.ProcessGroup]
) -> None:
    pg = group()
    if pg is not None:
        _LEFT.setdefault(pg, []).extend(work for _, works in posted for work in works)
    posted.clear()
