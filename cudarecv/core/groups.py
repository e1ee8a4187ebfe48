"""Gloo groups of their own, formed through a store: no ``init_process_group``, no group shared by a world.

The weight-sync membership (a pair per receiver that joins) and the vLLM backend (the trainer and an engine's
workers) each form their groups here, on a prefix of the user's store.
"""

from __future__ import annotations

import datetime
import weakref
from typing import cast

import torch.distributed as dist

from .errors import TransferTimeout

#: the groups formed with ``bounded=True`` (see :func:`bounded`)
_BOUNDED: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def store_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    timeout: float,
    what: str,
    bounded: bool = False,
) -> dist.ProcessGroup:
    """This process's rank of the gloo group that the ``size`` processes calling it with ``prefix`` form (each
    within ``timeout`` s; the group's own operations time out after ``timeout`` too). ``what`` names the group
    in the error when it cannot be formed (a member that never came). ``bounded``: a pair whose transfers' gloo
    waits may end a little past their deadlines, closing the pair (:func:`bounded`).

    Example:
        >>> group = store_group(store, "cudarecv/weights/policy/g1/pair/3", rank=0, size=2, timeout=60,
        ...                     what="the pair of the trainer and receiver 3")
        >>> cudarecv.send(td, group=group, group_dst=1)
    """
    try:
        group = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, store), rank, size, datetime.timedelta(seconds=timeout)
        )
    except RuntimeError as error:  # (gloo's rendezvous times out with a RuntimeError)
        raise TransferTimeout(
            f"{what} could not be formed within {timeout:g} s: not every one of its {size} "
            "processes came (the backend's message is this error's __cause__)"
        ) from error
    pg = cast(dist.ProcessGroup, group)  # (a standalone backend: see Link.pg)
    if bounded:
        _BOUNDED.add(pg)
    return pg


def bounded(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg`` is a pair formed with ``bounded=True``: an elastic sender's pair with one receiver, where a
    transfer that failed drops the receiver (it joins again on a new pair), so closing the pair's links (what a
    gloo wait that runs out does) once a transfer's deadline has passed costs nothing. gloo may leave a send to
    a peer that died waiting for good, whatever is done to the group; a bounded wait is what frees its thread."""
    return pg in _BOUNDED
