"""How a receiver that joined through a store reaches its neighbours in a relay chain: :class:`Edges`.

Receivers that join through a store share no process group, so two neighbours in a push's relay chain form a
gloo pair of their own, on a prefix of the store (:meth:`Directory.edge`) named by the version of the push that
first made them neighbours: both learn it from that push's headers, so both form the same pair. The pair is kept
for the chains after it, and let go of once its link breaks (the neighbour died or left) or the receiver closes.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ...core.groups import store_group
from ...core.link import Link, resolve
from .directory import Directory, own_client

if TYPE_CHECKING:
    import torch.distributed as dist


class Edges:
    """The links of receiver ``ident`` of ``generation`` to its neighbours (see the module docstring): what
    :class:`~cudarecv.weights.relay.Hop` calls for a neighbour it has no lane to yet."""

    def __init__(self, directory: Directory, generation: int, ident: int, timeout: float) -> None:
        self.directory, self.generation, self.ident, self.timeout = (
            directory,
            generation,
            ident,
            timeout,
        )
        self._lock = threading.Lock()
        # a client of its own, at the first pair (formed on the pulls' thread: never behind the caller's wait on
        # theirs)
        self.store: dist.Store | None = None

    def __call__(self, peer: int, version: int, limit: float) -> Link:
        """The link to receiver ``peer``, formed within ``limit`` s (at most ``timeout``; :class:`TransferTimeout`
        if it never came)."""
        rank = 0 if self.ident < peer else 1
        with self._lock:  # (the pairs of one push form at once)
            if self.store is None:
                self.store = own_client(self.directory.store)
        group = store_group(
            self.store,
            self.directory.edge(self.generation, self.ident, peer, version),
            rank,
            2,
            min(limit, self.timeout),
            f"receiver {self.ident} of weight sender "
            f"{self.directory.name!r}: its relay pair with receiver {peer}",
        )
        return resolve(None, 1 - rank, group, "src", "group_src")
