"""The same-host transport beneath the fast wire: which links take it, and their two ends.

When both ends of a fast-wire link (``bucket_bytes``, gloo) are cudarecv processes on one machine, the
payload need not cross a socket. A link direction (a group, a peer, who sends) has a
:class:`~cudarecv.samehost.send_side.SendSide` at the sender and a :class:`~cudarecv.samehost.recv_side.RecvSide`
at the receiver, kept per group here and ended with it. Each side has one thread that drives the link's
fast-wire transfers in call order (headers, offers and words back stay in step), and one *channel* per kind
of memory: host memory (memfd segments, :mod:`~cudarecv.samehost.shared_memory`) and device memory (CUDA IPC
segments, :mod:`~cudarecv.samehost.cuda_ipc`), each negotiated on its own when a transfer of that kind first
needs it: the sender offers two segments right after a header (that transfer's payload goes on the wire),
the receiver maps them if it may and can and answers; from the sender's next transfer of that kind on, the
payload goes through the segments (the header's route says which: :class:`~cudarecv.plan.header.PayloadRoute`).

An offer declined for good (another machine, boot, network namespace or user; a receiver on the wire) keeps
that channel on the wire; one declined for now (the segments could not be opened: memory, descriptors) is
made again later, and a larger re-offer that is declined keeps the segments already shared. Host memory
also has two routes that skip the segments (the sender's storage in torch's shared memory, and direct
reads of the sender's memory): see :mod:`~cudarecv.samehost.routes`. Each side's channels move through
the states of :mod:`~cudarecv.samehost.channels` (docs/design.md draws them).

Headers, READY and the words back stay on the process group, so timeouts, the header check and a dead peer
are detected as on the wire. Order: a receiver must post its receives in the order of the sender's sends as
soon as two are in flight (each side takes them one at a time); posted the other way round they wait for
each other until their timeouts, and the later-posted one's :class:`~cudarecv.core.errors.TransferTimeout`
says it waited for its turn.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from ..core.link import Link
from ..core.transfer import WIRE
from .policy import ENV, Role, allowed, chose, unavailable
from .recv_side import RecvSide
from .send_side import SendSide
from .shared_memory import available

Side = SendSide | RecvSide
#: a group's sides, per (peer, role)
Sides = dict[tuple[int, Role], Side]
S = TypeVar("S", SendSide, RecvSide)

# a group's sides; they end when the group is garbage-collected (a plain isend/irecv link has no close):
# nothing of theirs refers to the group, and an idle driver holds no job (cudarecv.core.driver)
_SIDES: weakref.WeakKeyDictionary[Any, Sides] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def side_of(link: Link, role: Role, kind: type[S], make: Callable[[], S] | None) -> S | None:
    """The side of ``link`` in ``role`` (a ``kind``), made with ``make()`` the first time (None: don't)."""
    with _LOCK:
        sides = _SIDES.get(link.pg)
        if sides is None:
            sides = _SIDES[link.pg] = {}
            weakref.finalize(
                link.pg, close_all, sides
            ).atexit = False  # (at exit, idle daemon threads just end)
        side = sides.get((link.peer, role))
        if side is None and make is not None:
            side = sides[(link.peer, role)] = make()
        assert side is None or isinstance(side, kind)  # (the role says which)
        return side


def sides_of(pg: Any) -> Sides:
    """The sides of group ``pg``, per (peer, role) (for tests and diagnostics)."""
    with _LOCK:
        return dict(_SIDES.get(pg, {}))


def close_all(sides: Sides) -> None:
    """A group went away: stop its sides' threads and let go of their segments and mappings."""
    for side in list(sides.values()):
        side.close()
    sides.clear()


def sending_side(link: Link, transport: str, device: torch.device) -> SendSide | None:
    """The link's sending side when this transfer goes through it (on its thread; perhaps through shared
    memory or CUDA IPC), else None: the transfer goes on the wire as it always did."""
    if link.backend != "gloo":  # NCCL's own intra-node path is peer to peer already
        return None
    problem = unavailable(device)
    if not allowed(transport):
        problem = f"the call's `transport` is {transport!r}, {ENV}={os.environ.get(ENV, 'auto')!r}"
    if problem is None:
        return side_of(link, "send", SendSide, lambda: SendSide(link.peer))
    side = side_of(
        link, "send", SendSide, None
    )  # one made earlier is kept: it orders the link's sends
    if side is None:
        chose(link, "send", WIRE, problem)
    return side


def receiving_side(link: Link) -> RecvSide | None:
    """The link's receiving side (its thread, its mappings); None on links that cannot share memory."""
    if link.backend != "gloo" or available() is not None:
        return None
    return side_of(link, "recv", RecvSide, lambda: RecvSide(link.peer))


def storage_table(storage: Tensor) -> np.ndarray:
    """A consolidated host storage's (address, bytes) as the one ``struct iovec`` row of a direct read."""
    return np.array([[storage.data_ptr(), storage.numel()]], dtype=np.uint64)
