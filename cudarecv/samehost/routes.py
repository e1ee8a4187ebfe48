"""The two host routes that skip the segments (one copy in all): *storage*, a consolidated storage that torch
keeps in shared memory, offered once (its fd, device and inode, in one of ``STORAGE_SLOTS`` slots), mapped
read-only by the receiver and copied straight out of (or declined: ``NO``, and that storage's payload comes on
the wire from then on); *direct*, the sender's leaves (or private consolidated storage) read by the receiver
with ``process_vm_readv`` where it may and that pays (:func:`~cudarecv.core.host_copy.direct_read_pays`), its
table of addresses and sizes checked against its own first. The sender's transfer ends with the receiver's
``DONE``: it reads live memory.

What both ends agree on lives here (the back tag, the copy's signature), with the sender's memory of the
storages it offered (:class:`StorageSlots`); each end's steps are its side's methods, which change only that
side: :meth:`SendSide._send_storage <cudarecv.samehost.send_side.SendSide._send_storage>` and
``_send_direct``, :meth:`RecvSide._take_storage <cudarecv.samehost.recv_side.RecvSide._take_storage>` and
``_read_direct``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

from torch import Tensor

from ..plan.header import STORAGE_SLOTS
from .shared_memory import StorageWhere

R = TypeVar("R")
#: a side's sub-protocol (``yield from`` it in a transfer's protocol, :mod:`cudarecv.core.protocol`): it yields
#: the works the host waits on (gloo works, CUDA events, stages: open) and returns an ``R``
Steps = Generator[Sequence[Any], None, R]

STORAGE_BACK = 2  # the back tag (BACK_TAGS + this) of both routes' DONE
DECLINED = 64  # storages a sender remembers the receiver could not map
#: copies a segment's message, or a direct read's, into the tensordict: ``copy(data, key, i, offset, length, piece)``
Copy = Callable[[Tensor, str, int, int, int, int], None]


class StorageSlots:
    """The sender's storage route: which storages it offered (one of ``STORAGE_SLOTS`` slots each, the least
    recently used given up first) and which the receiver could not map (the last :data:`DECLINED`)."""

    def __init__(self) -> None:
        self._slots: OrderedDict[tuple[int, int, int], int] = OrderedDict()
        self._declined: OrderedDict[tuple[int, int, int], None] = OrderedDict()

    def was_declined(self, where: StorageWhere) -> bool:
        return where.key in self._declined

    def slot(self, where: StorageWhere) -> tuple[int, bool]:
        """The slot of the storage at ``where``, and whether it is new there (an offer goes with the header)."""
        slot = self._slots.get(where.key)
        new = slot is None
        if slot is None:
            full = len(self._slots) >= STORAGE_SLOTS
            slot = self._slots.popitem(last=False)[1] if full else len(self._slots)
        self._slots[where.key] = slot
        self._slots.move_to_end(where.key)
        return slot, new

    def decline(self, where: StorageWhere) -> None:
        """The receiver could not map it: its payload goes on the wire from now on."""
        del self._slots[where.key]
        self._declined[where.key] = None
        if len(self._declined) > DECLINED:
            self._declined.popitem(last=False)
