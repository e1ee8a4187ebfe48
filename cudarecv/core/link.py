"""Peer and group resolution: which process-group object to call, and the peer's rank in it.

Every check runs before anything is sent, and names the argument and the fix.
Stock tensordict checks only "one of src/group_src"; a peer outside the group
segfaults the process there, so the range is checked here.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, SupportsIndex, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C_Backend
from torch.distributed import distributed_c10d as c10d

from .errors import ArgumentError, ArgumentTypeError, UsageError


@dataclass(frozen=True)
class Link:
    """One end of a point-to-point link: call ``pg.send/recv(..., peer, tag)``."""

    #: a ProcessGroup or a standalone backend (ProcessGroupGloo/NCCL): the backend has the same send, recv,
    #: size, rank and name, which torch's stubs give the ProcessGroup only, so both are typed as one
    pg: dist.ProcessGroup
    peer: int  # the peer's rank in ``pg``
    registered: bool  # whether torch.distributed knows ``pg`` (P2POp accepts it)
    backend: str = ""  # "gloo", "nccl", ... (read from the group when not given)

    def __post_init__(self) -> None:
        if not self.backend:
            object.__setattr__(self, "backend", str(self.pg.name()).lower())

    def group_timeout(self) -> float | None:
        """The process group's own timeout in seconds (what bounds a wait without ``timeout=``), if readable."""
        pg = self.pg
        getters: list[Callable[[], timedelta]] = [lambda: cast(Any, pg).options._timeout]
        getters += [
            functools.partial(lambda d: pg._get_backend(torch.device(d)).options._timeout, d)
            for d in ("cpu", "cuda")
        ]
        for get in getters:
            try:
                return get().total_seconds()
            except Exception:  # noqa: BLE001 - not this kind of group
                continue
        return None


def as_rank(value: object, name: str) -> int:
    """An int rank from ``value`` (numpy ints too, as torch.distributed takes them)."""
    if isinstance(value, bool):
        raise ArgumentTypeError(
            f"`{name}` must be an int rank (or, where it takes several, a list of them), got bool"
        )
    try:
        return operator.index(cast(SupportsIndex, value))  # (anything else: TypeError)
    except TypeError:
        raise ArgumentTypeError(
            f"`{name}` must be an int rank (or, where it takes several, a list of them), "
            f"got {type(value).__name__}"
        ) from None


def _check_group(group: object) -> dist.ProcessGroup | None:
    """``group`` is a process group (registered or standalone) or a backend object built on a store."""
    if group is not None and not isinstance(group, (dist.ProcessGroup, _C_Backend)):
        raise ArgumentTypeError(
            f"`group` must be a torch.distributed process group (e.g. from dist.new_group(...), or "
            f"dist.ProcessGroupGloo(store, rank, size)), got {type(group).__name__}; pass None for the default group"
        )
    return cast("dist.ProcessGroup | None", group)  # (a backend: see Link.pg)


def resolve(
    peer: int | None,
    group_peer: int | None,
    group: object | None,
    peer_name: str,
    group_peer_name: str,
) -> Link:
    """Check the peer arguments of one call and return its :class:`Link`.

    ``peer_name``/``group_peer_name`` are ``"src"``/``"group_src"`` or
    ``"dst"``/``"group_dst"``, used in the messages.
    """
    pg = _check_group(group)
    if group_peer is not None:
        if group is None:
            raise ArgumentError(
                f"`{group_peer_name}` requires `group`: pass the process group that "
                f"`{group_peer_name}={group_peer}` is a rank of"
            )
        if peer is not None:
            raise ArgumentError(
                f"`{peer_name}` and `{group_peer_name}` are mutually exclusive: pass "
                f"`{peer_name}` (a global rank) or `{group_peer_name}` (a rank in `group`), not both"
            )
    elif peer is None:
        raise ArgumentError(
            f"Exactly one of `{peer_name}` and `{group_peer_name}` must be provided"
        )
    if peer is not None:
        peer = value = as_rank(peer, peer_name)
        name = peer_name
    else:
        value = as_rank(group_peer, group_peer_name)
        name = group_peer_name

    if group is None:
        if not dist.is_initialized():
            raise UsageError(
                "torch.distributed is not initialized: call "
                "torch.distributed.init_process_group(...) first, or pass a standalone "
                f"`group` with `{group_peer_name}`"
            )
        pg = c10d._get_default_group()
    assert pg is not None  # (resolved: the default group when None)
    registered = pg in c10d._world.pg_map
    if peer is not None:
        if not registered:
            raise ArgumentError(
                f"`{peer_name}={peer}` is a global rank, but `group` is a standalone process "
                "group that torch.distributed does not know: pass "
                f"`{group_peer_name}=<the peer's rank in group>` instead"
            )
        world = dist.get_world_size()
        if not 0 <= peer < world:
            raise ArgumentError(
                f"`{peer_name}={peer}` is outside the world of {world} ranks: "
                f"pass a rank in 0..{world - 1}"
            )
        ranks = dist.get_process_group_ranks(pg)
        if peer not in ranks:
            raise ArgumentError(
                f"`{peer_name}={peer}` is not a member of `group` (global ranks {ranks}): "
                f"pass one of them, or `{group_peer_name}` for a rank in the group"
            )
        group_rank = ranks.index(peer)
    else:
        size = pg.size()
        if not 0 <= value < size:
            raise ArgumentError(
                f"`{group_peer_name}={value}` is outside `group` of {size} ranks: "
                f"pass a rank in 0..{size - 1}"
            )
        group_rank = value
    if group_rank == pg.rank():
        raise ArgumentError(
            f"`{name}={value}` is this process's own rank: a rank cannot send to or "
            "receive from itself; pass the peer's rank"
        )
    return Link(pg, group_rank, registered)


# what a backend's error says, by a phrase of its text, in cudarecv's words
_SAYS = (
    ("closed by peer", "the peer closed the connection"),
    ("reset by peer", "the connection was reset"),
    ("broken pipe", "the connection was reset"),
    ("timed out", "the process group's wait timed out"),
)


def peer_failure(error: BaseException) -> str:
    """What a failed wait on the process group means, never the backend's own text (it stays the raised
    error's ``__cause__``)."""
    text = str(error).lower()
    said = next(
        (said for phrase, said in _SAYS if phrase in text),
        f"{type(error).__name__} from the process group",
    )
    return f"{said} (the backend's message is this error's __cause__)"
