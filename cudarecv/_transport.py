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

from collections import deque
from typing import Any, Sequence

import torch.distributed as dist
from torch import Tensor

from ._errors import UsageError
from ._link import Link

MAX_TAG = 2**31 - 1  # torch.distributed takes C ints as tags; gloo refuses negative ones


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


#: works of failed transfers that may still be in flight. Dropping a pending gloo
#: ``Work`` cancels it mid-stream and closes the link to its peer; kept here they
#: run out (or die with a link that is dead anyway). Bounded: the oldest go first.
_PARKED: deque = deque(maxlen=256)


def park(works: Sequence[Any]) -> None:
    """Keep ``works`` alive until they can no longer matter (see ``_PARKED``)."""
    if works:
        _PARKED.append(tuple(works))


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

