"""The store keys through which receivers find a named sender, and join it.

Under ``cudarecv/weights/<name>/`` in the user's store (a TCPStore or FileStore any process can reach):

- ``generation``: a counter; each :class:`~cudarecv.WeightSender` built with the store and name takes the next
  (a trainer that restarts is a new generation), and ``current`` names the newest;
- ``g<N>/sender``: the generation's sender (host, pid, mode, timeout) as JSON;
- ``last_version``: the last version pushed, by any generation: a new one goes on from there, so the versions a
  receiver gets strictly increase across trainer restarts;
- ``g<N>/joins``: a counter; a receiver takes the next number ``k`` and writes ``g<N>/join/<k>`` (its host and
  pid); the two then form a gloo group of their own on ``g<N>/pair/<k>/`` (the sender rank 0) and run the
  weight-sync handshake over it;
- ``g<N>/join/<k>`` with ``{"closed": true}``: the sender closed (it wakes its own admission thread);
- ``g<N>/alive/<k>``: receiver ``k``'s heartbeat counter; ``g<N>/dropped/<k>``: the sender dropped it
  (:mod:`.heartbeat`);
- ``g<N>/edge/<a>-<b>/<v>/``: relay fan-out: the gloo pair of receivers ``a < b``, formed when the push of version
  ``v`` first names them neighbours in its chain (rank 0: ``a``).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from ...core.errors import ArgumentError, SenderClosed, WaitTimeout
from ...samehost.machine import host_id

#: how long one wait of the admission thread for the next join lasts before it waits again (the sender's close
#: wakes it at once, with a record of its own; a store whose wait runs out logs a warning, hence not shorter)
ADMISSION_WAIT = 600.0


class Directory:
    """One sender name's keys in a store (see the module docstring)."""

    def __init__(self, store: Any, name: Any) -> None:
        if store is None or not hasattr(store, "add") or not hasattr(store, "wait"):
            raise ArgumentError(f"`store` must be a torch.distributed.Store (TCPStore, FileStore), got {store!r}")
        if not isinstance(name, str) or not name or "/" in name:
            raise ArgumentError(f"`name` must be a non-empty string without '/' (the sender's name in the store), "
                                f"got {name!r}")
        # a client of its own: a push records its version in the store, and must not wait behind a blocking
        # wait of the caller's on its client (a TCPStore client runs one operation at a time)
        self.store, self.name = own_client(store), name
        self.root = f"cudarecv/weights/{name}"

    def key(self, *parts: object) -> str:
        return "/".join([self.root, *map(str, parts)])

    # -- the sender's side -------------------------------------------------------------------------------
    def announce(self, mode: str, timeout: float) -> tuple[int, int]:
        """A new generation of the sender (its ``timeout``: how long a receiver's heartbeat may stand still):
        (its number, the version it goes on from)."""
        generation = self.store.add(self.key("generation"), 1)
        last = int(self.store.get(self.key("last_version"))) if self.store.check([self.key("last_version")]) else 0
        self.store.set(self.key("current"), str(generation))  # (first: a receiver woken by the record reads it)
        self.store.set(self.key(f"g{generation}", "sender"),
                       json.dumps({"host": host_id(), "pid": os.getpid(), "mode": mode, "timeout": timeout}))
        # one more than the last recorded: a push that a crash cut short may have reached some receivers
        return generation, last + 1 if last else 0

    def sender(self, generation: int) -> dict:
        """The generation's sender record (host, pid, mode, timeout)."""
        return json.loads(self.store.get(self.key(f"g{generation}", "sender")))

    def record(self, version: int) -> None:
        self.store.set(self.key("last_version"), str(version))

    def next_join(self, store: Any, generation: int, k: int) -> dict | None:
        """The record of join ``k`` if it came within :data:`ADMISSION_WAIT` s (on ``store``, the admission
        thread's own client), else None."""
        key = self.key(f"g{generation}", "join", k)
        try:
            store.wait([key], datetime.timedelta(seconds=ADMISSION_WAIT))
        except Exception:  # noqa: BLE001 - the wait ran out (a DistStoreError or RuntimeError, by store)
            if not store.check([key]):
                return None
        return json.loads(store.get(key))

    def close(self, generation: int) -> None:
        """Wake the generation's admission thread: the sender closed."""
        k = self.store.add(self.key(f"g{generation}", "joins"), 1)
        self.store.set(self.key(f"g{generation}", "join", k), json.dumps({"closed": True}))

    # -- a receiver's side -------------------------------------------------------------------------------
    def current(self, newer_than: int, timeout: float) -> int:
        """The newest generation above ``newer_than``, waiting up to ``timeout`` s for the next to announce."""
        try:
            self.store.wait([self.key(f"g{newer_than + 1}", "sender")], datetime.timedelta(seconds=timeout))
        except Exception as error:  # noqa: BLE001 - the wait ran out (a DistStoreError or RuntimeError, by store)
            if newer_than:
                raise SenderClosed(f"weight sender {self.name!r}: no new sender came within {timeout:g} s (the "
                                   f"last, generation {newer_than}, is gone)") from error
            raise WaitTimeout(f"no weight sender named {self.name!r} came within {timeout:g} s (is the trainer "
                              "up, with this store?)") from error
        return int(self.store.get(self.key("current")))

    def join(self, generation: int) -> int:
        """Ask to join ``generation``: this receiver's number in it."""
        k = self.store.add(self.key(f"g{generation}", "joins"), 1)
        self.store.set(self.key(f"g{generation}", "join", k), json.dumps({"host": host_id(), "pid": os.getpid()}))
        return k

    def pair(self, generation: int, k: int) -> str:
        """The prefix on which the sender and receiver ``k`` form their group."""
        return self.key(f"g{generation}", "pair", k)

    def alive(self, generation: int, k: int) -> str:
        return self.key(f"g{generation}", "alive", k)

    def dropped(self, generation: int, k: int) -> str:
        return self.key(f"g{generation}", "dropped", k)

    def edge(self, generation: int, a: int, b: int, version: int) -> str:
        """The prefix on which receivers ``a`` and ``b`` form their pair for the relay chain of ``version``."""
        return self.key(f"g{generation}", "edge", f"{min(a, b)}-{max(a, b)}", version)


def own_client(store: Any) -> Any:
    """A client of ``store`` of cudarecv's own (TCPStore and FileStore clone; a store that cannot is shared)."""
    try:
        return store.clone()
    except Exception:  # noqa: BLE001 - e.g. a HashStore, in one process: no client to wait behind
        return store
