"""Posting one call's messages, on any backend and any kind of group; keeping works that may still run.

On NCCL, which ignores tags and matches point-to-point messages in posting order per communicator, both
ends of a link must post each message the same way, since torch runs a single op on a two-rank
communicator of the pair and a batched (coalesced) one on the group's communicator (without
``device_id``); a group's communicator is made by every rank of the group at its first batched op, and a
group's coalescing state is one for all threads. So cudarecv posts single ops (the pair's communicator)
everywhere, except the stock wire's per-leaf messages, which go as one batch where :func:`nccl_batching`
says so (both ends decide alike from the group and ``CUDARECV_NCCL_BATCH``); batches on one group are
posted one thread at a time, and a single op on an NCCL group waits while another thread posts a batch there.

- NCCL, registered group: :func:`torch.distributed.batch_isend_irecv` (one ``Work`` for the batch).
- NCCL, standalone group (which ``P2POp`` refuses): the same coalescing on the group object itself
  (``_start_coalescing`` ... ``_end_coalescing``; a backend's take no device, a ``ProcessGroup``'s do).
- gloo: the ops one by one with their tags, straight on the group object, which keeps the stock wire and
  costs half the Python time per message of ``dist.isend``/``dist.irecv`` (that matters at 2000 leaves).

NCCL ops are issued on the current stream (callers enter the transfer stream first); NCCL's own stream
waits on it, and ``Work.wait()`` orders the current stream after the batch without blocking the host.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import Backend as _C_Backend

from .errors import ArgumentError, UsageError
from .link import Link
from .log import logger


def post(
    link: Link, sending: bool, tensors: Sequence[Tensor], tags: Sequence[int], batch: bool = False
) -> list[dist.Work]:
    """Post a send (``sending``) or receive of every tensor with its tag; return the works.

    On NCCL, ``batch`` posts them as one coalesced group call (the group's communicator, even for one
    message); without it each is a single op (the pair's communicator). The peer must post alike.
    """
    if not tensors:
        return []
    if link.backend == "nccl" and batch:
        return _coalesced(link, sending, tensors, tags)
    op = link.pg.send if sending else link.pg.recv
    peer = link.peer
    works: list[dist.Work] = []
    # on NCCL a single op posted while another thread coalesces on the group would join that thread's batch
    # (torch's coalescing state is one per group): it waits for the batch to be posted
    with _coalescing(link.pg) if link.backend == "nccl" else contextlib.nullcontext():
        try:
            for t, tag in zip(tensors, tags):
                works.append(op([t], peer, tag))
        except BaseException:
            # posted before the error: let them run out rather than cancel them mid-stream
            park(works)
            raise
    return works


BATCH_ENV = (
    "CUDARECV_NCCL_BATCH"  # "1": batch the stock wire's per-leaf messages, "0": one op each, "auto"
)


def nccl_batching(link: Link) -> bool:
    """Whether the stock wire's per-leaf messages go as one NCCL batch on ``link``: ``CUDARECV_NCCL_BATCH=1``
    or ``0``; by default (``auto``) on a group of two ranks only, where the batch's communicator is made by the
    two ends of the transfer (on a larger group every rank of the group would have to batch once first). A
    stock tensordict peer posts one op per leaf: set ``0`` on the cudarecv end."""
    setting = os.environ.get(BATCH_ENV, "auto")
    if setting not in ("0", "1", "auto"):
        raise ArgumentError(
            f"the environment variable {BATCH_ENV}={setting!r} must be 0, 1 or auto"
        )
    if setting != "auto":
        return setting == "1"
    return link.pg.size() == 2


#: works of failed transfers that may still be in flight, and messages posted and left to run out.
#: Dropping a pending gloo ``Work`` cancels it mid-stream and closes the link to its peer, so an
#: entry goes once every work in it reports completion (NCCL works, ended transfers; gloo reports a
#: send or receive complete only once something waited for it), or, past :data:`PARKED_MAX` entries,
#: oldest first, said by the logger (a bound on memory: one entry is about a kilobyte).
_PARKED: deque[tuple[weakref.ref[dist.ProcessGroup] | None, tuple[object, ...]]] = deque()
_PARKING = threading.Lock()
PARKED_WARN = 1024  # the logger warns each time the kept entries pass this, then twice as many
PARKED_MAX = 1 << 16
_warn_at = PARKED_WARN
_scan_at = (
    PARKED_WARN  # the entries' count at which completed ones are let go (twice those kept then)
)


def park(works: Sequence[object], pg: dist.ProcessGroup | None = None) -> None:
    """Keep ``works`` alive until they can no longer matter (see ``_PARKED``); ``pg``: the group they are on,
    which :func:`release` names once its peer is gone."""
    global _warn_at
    if not works:
        return
    with _PARKING:
        _PARKED.append((None if pg is None else weakref.ref(pg), tuple(works)))
        if len(_PARKED) < _scan_at:
            return
        kept, dropped = _sweep()
        if kept < _warn_at:
            return
        _warn_at = min(2 * _warn_at, PARKED_MAX)
    if dropped:
        logger.warning(
            "more than %d posted works of failed transfers and unanswered messages are kept: the %d "
            "oldest were dropped; a dropped one still pending cancels its message and closes its link",
            PARKED_MAX,
            dropped,
        )
    else:
        logger.warning(
            "%d posted works of failed transfers and unanswered messages are kept alive (dropping one "
            "still pending would close its link); they are freed at exit",
            kept,
        )


def release(pg: dist.ProcessGroup) -> None:
    """Let go of what is parked on ``pg``, pending or not: its peer is gone for good (a receiver that left an
    elastic sender), so nothing is cancelled that could still arrive; the group goes with the last of it."""
    with _PARKING:
        kept = [entry for entry in _PARKED if entry[0] is None or entry[0]() is not pg]
        _PARKED.clear()
        _PARKED.extend(kept)


def _sweep() -> tuple[int, int]:
    """Under ``_PARKING``: drop the completed entries (and, past :data:`PARKED_MAX`, the oldest); (kept, dropped)."""
    global _scan_at
    kept = [entry for entry in _PARKED if not all(_completed(item) for item in entry[1])]
    dropped = max(len(kept) - PARKED_MAX, 0)
    _PARKED.clear()
    _PARKED.extend(kept[dropped:])
    _scan_at = min(max(PARKED_WARN, 2 * len(_PARKED)), PARKED_MAX + PARKED_WARN)
    return len(kept), dropped


def _completed(item: object) -> bool:
    """Whether ``item`` (a work, a transfer, a protocol's frame) is done with its link."""
    settled = getattr(item, "settled", None)  # a transfer: it has ended
    if settled is not None:
        return bool(settled)
    check = getattr(item, "is_completed", None)
    return check is not None and bool(check())  # a protocol's frame may hold works: kept


_COALESCING: weakref.WeakKeyDictionary[dist.ProcessGroup, threading.Lock] = (
    weakref.WeakKeyDictionary()
)  # per group
_COALESCING_LOCK = threading.Lock()


def _coalescing(pg: dist.ProcessGroup) -> threading.Lock:
    """The lock of ``pg``'s coalescing state (one per group in torch, not per thread)."""
    with _COALESCING_LOCK:
        lock = _COALESCING.get(pg)
        if lock is None:
            lock = _COALESCING[pg] = threading.Lock()
        return lock


def posting(pg: dist.ProcessGroup) -> threading.Lock:
    """The lock every cudarecv post on the NCCL group ``pg`` holds (single ops and batches alike): held, no
    cudarecv op is being posted there, e.g. while the group is aborted (:func:`cudarecv.weights.fanout.abort_group`)."""
    return _coalescing(pg)


def _coalesced(
    link: Link, sending: bool, tensors: Sequence[Tensor], tags: Sequence[int]
) -> list[dist.Work]:
    device = tensors[0].device
    pg = link.pg
    with _coalescing(
        pg
    ):  # batches from several threads must not mix in the group's one coalescing state
        if link.registered:
            op = dist.isend if sending else dist.irecv
            return dist.batch_isend_irecv(
                [
                    dist.P2POp(op, t, group=pg, tag=tag, group_peer=link.peer)
                    for t, tag in zip(tensors, tags)
                ]
            )
        if not hasattr(pg, "_start_coalescing"):
            raise UsageError(
                f"the standalone group {type(pg).__name__} cannot coalesce point-to-point ops; "
                "build it as ProcessGroupNCCL, or register it with torch.distributed.new_group"
            )
        args = () if isinstance(pg, _C_Backend) else (device,)  # a backend's take no device
        send_or_recv = pg.send if sending else pg.recv
        pg._start_coalescing(*args)
        try:
            for t, tag in zip(tensors, tags):
                send_or_recv([t], link.peer, tag)
        finally:
            work = pg._end_coalescing(*args)
        return [work]
