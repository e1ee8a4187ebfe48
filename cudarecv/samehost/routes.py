"""The two host routes that skip the segments (one copy in all), both ends together: *storage*, a consolidated
storage that torch keeps in shared memory, offered once (its fd, device and inode, in one of ``STORAGE_SLOTS``
slots), mapped read-only by the receiver and copied straight out of (or declined: ``NO``, and that storage's
payload comes on the wire from then on); *direct*, the sender's leaves (or private consolidated storage) read by
the receiver with ``process_vm_readv`` where it may and that pays (:func:`~cudarecv.core.host_copy.direct_read_pays`),
its table of addresses and sizes checked against its own first. The sender's transfer ends with the receiver's
``DONE``: it reads live memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..core.errors import OutOfStepError
from ..core.host_copy import read_process
from ..core.streams import EventWork, record
from ..core.tags import piece_tag
from ..core.transfer import SHARED_MEMORY
from ..plan.header import (
    KIND_BUCKETS,
    KIND_CHUNKS,
    KIND_NAMES,
    STORAGE_SLOTS,
    Header,
    PayloadRoute,
    drain_limit,
    piece_sizes,
)
from ..wire.control import ROOM
from ..wire.fast import OFFER_SIZE
from ..wire.staging import Lane, send_from
from .policy import HOST, Carried
from .records import Status, Word
from .shared_memory import storage_offer

STORAGE_BACK = 2  # the back tag (BACK_TAGS + this) of both routes' DONE
DECLINED = 64  # storages a sender remembers the receiver could not map
#: copies a segment's message, or a direct read's, into the tensordict: ``copy(data, key, i, offset, length, piece)``
Copy = Callable[[Tensor, str, int, int, int, int], None]


# -- the sender's end ---------------------------------------------------------------------------------------
def send_storage(
    side: Any,
    lane: Lane,
    header: Header,
    init_tag: int,
    where: tuple[int, int, int, int, int],
    chunks: list[Tensor],
    carried: Carried,
) -> Any:
    """The storage route: the header names the storage's slot (after an offer the first time); the receiver
    copies the bytes straight out of this process's storage and says DONE, or NO (it cannot map it: then
    the chunks follow on the wire and the storage never takes this route again)."""
    key = (
        where[1],
        where[2],
        where[4],
    )  # the file (device, inode: never reused while it lives) and offset
    slot, offered = side.slots.get(key), None
    if slot is None:
        slot = (
            len(side.slots)
            if len(side.slots) < STORAGE_SLOTS
            else side.slots.popitem(last=False)[1]
        )
        offered = storage_offer(where)
    side.slots[key] = slot
    side.slots.move_to_end(key)
    side.seq += 1
    head = dataclasses.replace(
        header,
        transport=PayloadRoute.STORAGE,
        segment=slot,
        offer=offered is not None,
        seq=side.seq,
    )
    side.held[STORAGE_BACK] = side.post_header(
        lane,
        head,
        init_tag,
        None if offered is None else offered + bytes(OFFER_SIZE - len(offered)),
    )
    side.expect(lane, STORAGE_BACK, side.seq)
    status = yield from side.take(STORAGE_BACK, Word.DONE)
    if status == Status.OK:
        carried.transport = SHARED_MEMORY
    else:
        del side.slots[key]
        side.declined[key] = None
        if len(side.declined) > DECLINED:
            side.declined.popitem(last=False)
        yield from send_from(lane, chunks, [piece_tag(init_tag)] * len(chunks))


def send_direct(
    side: Any, lane: Lane, header: Header, init_tag: int, table: Tensor, carried: Carried
) -> Any:
    """The direct route: the header, then the leaves' (or the consolidated storage's) addresses and sizes; the
    receiver reads them straight out of this process (one copy in all, by the kernel) and says DONE."""
    side.seq += 1
    head = dataclasses.replace(header, transport=PayloadRoute.DIRECT, segment=0, seq=side.seq)
    side.held[STORAGE_BACK] = side.post_header(lane, head, init_tag)
    side.held[STORAGE_BACK] += lane.post(True, [table], [piece_tag(init_tag)])
    side.expect(lane, STORAGE_BACK, side.seq)
    if (yield from side.take(STORAGE_BACK, Word.DONE)) != Status.OK:
        raise OutOfStepError(
            "the receiver could not read this process's memory (a region was not mapped): "
            "its tensordict may be partly written"
        )
    carried.transport = SHARED_MEMORY


# -- the receiver's end -------------------------------------------------------------------------------------
def read_direct(
    side: Any,
    lane: Lane,
    header: Header,
    init_tag: int,
    table: np.ndarray | None,
    copy: Copy,
    problem: str | None,
    carried: Carried,
) -> Any:
    """The direct route: take the sender's table of leaves, or of its one consolidated storage (checked against
    this tensordict's ``table``: the same sizes), and read them straight into the leaves or storage, then DONE
    (NO if the read fell short). Off the host (no ``table``) they are read into a reused host buffer, DONE said
    at once (the sender's memory is read), then copied out of it on the transfer's stream."""
    leaves = header.kind == KIND_BUCKETS
    what = "leaves" if leaves else "storage"
    if (
        side.channels[HOST].state != "shared"
        or side.direct is None
        or not (side.direct_leaves if leaves else header.kind == KIND_CHUNKS)
    ):
        raise OutOfStepError(
            f"the sender names its {what} for a direct read this receiver never agreed to: "
            "the link is out of step"
        )
    size = 16 * (header.leaves if leaves else 1)
    if problem is not None and size > drain_limit(0 if table is None else 16 * len(table)):
        raise OutOfStepError(
            f"{problem}; its table of {header.leaves} leaves is more than this receiver drains: "
            "not drained, the link is out of step; the tensordict was left untouched"
        )
    buffer = torch.zeros(size + ROOM, dtype=torch.uint8)
    yield lane.post(False, [buffer], [piece_tag(init_tag)])
    raw = buffer.numpy()
    if raw[size:].any():
        raise OutOfStepError(
            f"the sender's table of its {what} is longer than its header says: out of step"
        )
    if problem is not None:
        side.say(lane, Word.DONE, Status.OK, header.seq, STORAGE_BACK)
        return True
    remote = raw[:size].view(np.uint64).reshape(-1, 2)
    staging = None
    if table is None:
        staging = yield from _direct_staging(side, header.total)
    local = (
        table
        if staging is None
        else np.array([[staging.data_ptr(), header.total]], dtype=np.uint64)
    )
    sizes = remote[:, 1] if staging is None else remote[:, 1].sum(keepdims=True)
    if not np.array_equal(sizes, local[:, 1]):
        raise OutOfStepError(
            f"the sender's table of its {what} names other sizes than this tensordict's "
            f"{what}: not read; the link is out of step"
        )
    carried.transport = SHARED_MEMORY
    status = Status.OK if read_process(side.direct, local, remote) == header.total else Status.NO
    side.say(lane, Word.DONE, status, header.seq, STORAGE_BACK)  # (the sender's memory is read)
    if status != Status.OK:
        raise OutOfStepError(
            f"the sender's table of its {what} names memory it does not have: the tensordict "
            "is partly written; the link is out of step"
        )
    if staging is not None:
        for i, n in enumerate(piece_sizes(header.total, header.bucket_bytes)):
            with lane.on_stream():
                copy(staging, "direct", i, i * header.bucket_bytes, n, header.bucket_bytes)
        if lane.stream is not None:
            side.staging_fence = record(lane.stream)  # the next direct read waits for these copies
    return True


def _direct_staging(side: Any, nbytes: int) -> Any:
    """A sub-protocol: this side's host buffer for a direct read of ``nbytes``, once the copies out of its
    previous use have run (reused: one per link, grown when too small)."""
    if side.staging_fence is not None:
        yield [EventWork(side.staging_fence)]
        side.staging_fence = None
    if side.staging is None or side.staging.numel() < nbytes:
        side.staging = torch.empty(nbytes, dtype=torch.uint8)
    return side.staging[:nbytes]


def take_storage(
    side: Any, lane: Lane, header: Header, copy: Copy, problem: str | None, carried: Carried
) -> Any:
    """The storage route: one copy straight out of the sender's storage (checked against the mapping), then
    DONE; or NO if it could not be mapped."""
    if (
        side.channels[HOST].state != "shared"
        or header.kind != KIND_CHUNKS
        or header.segment not in side.storages
    ):
        raise OutOfStepError(
            f"the header names storage slot {header.segment} of a {KIND_NAMES[header.kind]} "
            "transfer, which this receiver never mapped: the link is out of step"
        )
    mapping = side.storages[header.segment]
    if mapping is None:
        side.say(lane, Word.DONE, Status.NO, header.seq, STORAGE_BACK)
        return False
    if header.total > mapping.capacity:
        raise OutOfStepError(
            f"the header announces {header.total} bytes in a storage of {mapping.capacity}: "
            "the link is out of step"
        )
    carried.transport = SHARED_MEMORY
    if problem is None:
        copy(mapping.data, f"storage:{header.segment}", 0, 0, header.total, header.total)
    yield from side.finish(lane, lane.stream, header.seq, STORAGE_BACK)
    return True
