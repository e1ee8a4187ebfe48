"""Receives that share a link and their tags take turns: each posts nothing before the earlier ones have ended.

gloo matches messages of one tag in posting order, and a fast-wire receive posts in steps: its header, and only
once the header is read (and the same-host offer that may follow it on the header's tag) its payload. Two such
receives with one ``init_tag`` in flight at once, each driven when its own header lands (two threads, or posted
in order and waited the other way round), would each post their next step as it comes: the later one could take
the earlier one's offer as its header, or its payload. So a receive first waits for the earlier receives on its
tags to end (a :class:`~cudarecv.core.transfer.Transfer`'s :meth:`~cudarecv.core.transfer.Transfer.turn`), then
posts; each takes one whole message, in the order the receives were posted, whatever order they are waited in.
Receives on other tags (another ``init_tag``) do not wait for each other.

A :class:`Line` is the receives of one link (group, peer) and one tag key still in flight; its lock is held while
a receive joins it (it sees every earlier one, and the next sees it), so the posting order is the joining order.
Lines live as long as their group (held weakly) and hold their transfers weakly.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch.distributed as dist

from .link import Link

if TYPE_CHECKING:
    from .transfer import Transfer


class Line:
    """The transfers of one link and tag key in flight, in joining order (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = (
            threading.Lock()
        )  # held from :meth:`earlier` to :meth:`join`, across the transfer's first step
        self._pending: list[weakref.ref[Transfer]] = []

    def earlier(self) -> list[Transfer]:
        """The transfers that joined before and have not ended (call under :attr:`lock`)."""
        alive = [(ref, t) for ref in self._pending if (t := ref()) is not None and not t.settled]
        self._pending = [ref for ref, _ in alive]
        return [t for _, t in alive]

    def join(self, transfer: Transfer) -> None:
        """``transfer`` is the latest (call under :attr:`lock`, after :meth:`earlier`)."""
        self._pending.append(weakref.ref(transfer))


_LINES: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, Hashable], Line]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def line(link: Link, key: Hashable) -> Line:
    """The line of ``link`` for tag key ``key`` (e.g. ``("recv", header_tag)``), made the first time."""
    with _LOCK:
        lines = _LINES.get(link.pg)
        if lines is None:
            lines = _LINES[link.pg] = {}
        found = lines.get((link.peer, key))
        if found is None:
            found = lines[(link.peer, key)] = Line()
        return found
