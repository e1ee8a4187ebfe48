"""Posting one call's messages as one batch, on any backend and any kind of group.

- NCCL, registered group: :func:`torch.distributed.batch_isend_irecv`, which
  NCCL runs as one group call (one ``Work`` for the whole batch). PyTorch runs
  batched and single NCCL point-to-point ops on different communicators (the
  group's, and a two-rank one), so a stock tensordict peer, which sends one op
  per leaf, needs batching off (``CUDARECV_NCCL_BATCH=0``); single messages
  (a consolidated storage) always go as single ops.
- NCCL, standalone group (which ``P2POp`` refuses): the same coalescing done on
  the group object itself (``_start_coalescing`` ... ``_end_coalescing``).
- Backends without coalescing (gloo): ``batch_isend_irecv`` would issue the ops
  one by one with their tags; they are issued exactly so here, but straight on
  the group object, which keeps the stock wire and costs half the Python time
  per message of ``dist.isend``/``dist.irecv`` (that matters at 2000 leaves).

NCCL ops are issued on the current stream (callers enter the transfer stream
first); NCCL's own stream waits on it, and ``Work.wait()`` orders the current
stream after the batch without blocking the host.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Sequence

import torch.distributed as dist
from torch import Tensor

from .errors import UsageError
from .link import Link
from .log import logger


def post(link: Link, sending: bool, tensors: Sequence[Tensor], tags: Sequence[int],
         batch: bool = True) -> list[Any]:
    """Post a send (``sending``) or receive of every tensor with its tag; return the works.

    On NCCL, two or more messages go as one batch unless ``batch`` is False; a
    single message always goes as a single op, as stock tensordict sends it.
    """
    if not tensors:
        return []
    if link.backend == "nccl" and batch and len(tensors) > 1:
        return _coalesced(link, sending, tensors, tags)
    op = link.pg.send if sending else link.pg.recv
    peer = link.peer
    works: list[Any] = []
    try:
        for t, tag in zip(tensors, tags):
            works.append(op([t], peer, tag))
    except BaseException:
        park(works)  # posted before the error: let them run out rather than cancel them mid-stream
        raise
    return works


#: works of failed transfers that may still be in flight, and messages posted and left to run out.
#: Dropping a pending gloo ``Work`` cancels it mid-stream and closes the link to its peer, so an
#: entry goes once every work in it reports completion (NCCL works, ended transfers; gloo reports a
#: send or receive complete only once something waited for it), or, past :data:`PARKED_MAX` entries,
#: oldest first, said by the logger (a bound on memory: one entry is about a kilobyte).
_PARKED: deque = deque()
_PARKING = threading.Lock()
PARKED_WARN = 1024  # the logger warns each time the kept entries pass this, then twice as many
PARKED_MAX = 1 << 16
_warn_at = PARKED_WARN
_scan_at = PARKED_WARN  # the entries' count at which completed ones are let go (twice those kept then)


def park(works: Sequence[Any]) -> None:
    """Keep ``works`` alive until they can no longer matter (see ``_PARKED``)."""
    global _warn_at, _scan_at
    if not works:
        return
    with _PARKING:
        _PARKED.append(tuple(works))
        if len(_PARKED) < _scan_at:
            return
        kept = [entry for entry in _PARKED if not all(_completed(item) for item in entry)]
        dropped = max(len(kept) - PARKED_MAX, 0)
        _PARKED.clear()
        _PARKED.extend(kept[dropped:])
        _scan_at = min(max(PARKED_WARN, 2 * len(_PARKED)), PARKED_MAX + PARKED_WARN)
        if len(kept) < _warn_at:
            return
        _warn_at = min(2 * _warn_at, PARKED_MAX)
    if dropped:
        logger.warning("more than %d posted works of failed transfers and unanswered messages are kept: the %d "
                       "oldest were dropped; a dropped one still pending cancels its message and closes its link",
                       PARKED_MAX, dropped)
    else:
        logger.warning("%d posted works of failed transfers and unanswered messages are kept alive (dropping one "
                       "still pending would close its link); they are freed at exit", len(kept))


def _completed(item: Any) -> bool:
    """Whether ``item`` (a work, a transfer, a protocol's frame) is done with its link."""
    settled = getattr(item, "settled", None)  # a transfer: it has ended
    if settled is not None:
        return bool(settled)
    check = getattr(item, "is_completed", None)
    return check is not None and bool(check())  # a protocol's frame may hold works: kept


def _coalesced(link: Link, sending: bool, tensors: Sequence[Tensor], tags: Sequence[int]) -> list[Any]:
    device = tensors[0].device
    if link.registered:
        op = dist.isend if sending else dist.irecv
        return dist.batch_isend_irecv(
            [dist.P2POp(op, t, group=link.pg, tag=tag, group_peer=link.peer) for t, tag in zip(tensors, tags)]
        )
    pg = link.pg
    if not hasattr(pg, "_start_coalescing"):
        raise UsageError(
            f"the standalone group {type(pg).__name__} cannot coalesce point-to-point ops; "
            "build it as ProcessGroupNCCL, or register it with torch.distributed.new_group"
        )
    op = pg.send if sending else pg.recv
    pg._start_coalescing(device)
    try:
        for t, tag in zip(tensors, tags):
            op([t], link.peer, tag)
    finally:
        work = pg._end_coalescing(device)
    return [work]

