"""The same-host transport beneath the fast wire: payloads through shared memory, control on the group.

When both ends of a fast-wire link (``bucket_bytes``, host memory, gloo) are
cudarecv processes on one machine, the payload need not cross a socket (two
kernel copies, both cores). It goes through two shared segments
(:mod:`cudarecv.samehost.shared_memory`) the sender owns and the receiver maps read-only: the
sender writes each message straight into a segment, the receiver copies it
straight into its tensordict; one copy on each side.

Negotiation, once per link direction (a group, a peer, who sends): the
sender's first fast-wire transfer with ``transport="auto"`` creates two segments
sized for it and sends an *offer* right after its header (its machine key,
pid, the segments' descriptors and nonces); that transfer's payload still goes
on the wire. The receiver accepts if its machine key is the same (boot, host
name, network namespace, user), its own ``transport`` allows it, and it can
open both segments and read their nonces; it answers on the link's back tag.
The sender reads the answer before its next transfer on the link: from then on
payloads go through the segments, or on the wire for good.

A transfer through a segment (double buffered: the sender's n-th uses segment
n % 2) after its header (which names the segment and the transfer's number):

- the sender waits for the receiver's ``DONE`` of the segment's previous
  transfer, stamps the segment's progress word with the transfer's number,
  sends the header, then writes the messages into the segment, publishing after
  each how many bytes are in (:meth:`~cudarecv.samehost.shared_memory.Segment.advance`, ordered
  after them), then sends a 48-byte ``READY`` (offset and length: all of them)
  on the piece tag; the send ends once the receiver has taken the header and the
  ``READY`` (gloo completes a send then), so it gets the bytes even if the sending
  process exits at once;
- the receiver copies each message out as soon as the progress word says it is
  written, a message behind the sender (where it reads and writes comes from its
  own plan alone: a peer cannot make it read outside the segment or write
  outside its tensordict), and sleeps on the word in between (a futex the sender
  wakes after each message: no polling); it checks the ``READY`` against its plan
  when it comes (one that does not match fails the transfer as out of step); once
  the word stands still for :data:`FOLLOW_WAIT` it waits for the ``READY`` instead (a
  dead sender's never comes: the process group says so), copies the rest, and
  ends with ``DONE`` on the segment's back tag. On a header mismatch it copies
  nothing, takes the ``READY``, sends ``DONE`` and raises :class:`HeaderError`:
  the link stays in step, the tensordict untouched.

One ``READY`` per transfer: more (one per 4 MiB was tried), each a message on the
process group, measured slower once the receiver follows the word. A sender
built without the native copies publishes no progress; its receiver copies
everything once the ``READY`` came.

Two routes skip the segments, and the sender's copy with them (one copy in
all); the sender's transfer then ends with the receiver's ``DONE``, as the
receiver reads its live memory:

- *storage*: a consolidated storage that torch keeps in shared memory is
  offered once (its fd, device and inode, in one of ``STORAGE_SLOTS`` slots),
  mapped read-only and copied straight out of; a receiver that cannot map it
  answers ``NO`` and takes that payload on the wire;
- *direct*: if the receiver may read the sender's memory (``process_vm_readv``,
  checked when it takes the link's offer) and direct reads are chosen for this
  machine (:func:`~cudarecv.core.host_copy.direct_read_pays`: ``CUDARECV_DIRECT_READ``, else
  what ``python -m cudarecv tune`` measured, else the static default, the
  segments; nothing is measured here; its ``ANSWER`` says ``DIRECT``, or
  ``DIRECT_STORAGES`` for consolidated storages only), the sender sends its host
  leaves' (or its private consolidated storage's) addresses and sizes, and the
  receiver checks the sizes against its own and reads them into them.

Headers, ``READY`` and ``DONE`` stay on the process group, so timeouts, the
header check and a dead peer are detected as on the wire. A transfer larger
than the segments goes once on the wire with an offer of segments of its size.

Order: a link direction's fast-wire transfers (whatever their route, the
negotiating one too) are driven in call order by one thread on each side, so
they go on while their callers do other things, one at a time: a send ends once
the receiver has taken its header (and ``READY``, or offer and payload) before
the next is sent, and a receive is posted once the earlier ones ended. So a
receiver must post its receives in the order of the sender's sends as soon as
two are in flight (they may be waited in any order): posted the other way round
they wait for each other until their timeouts, and the later-posted one's
:class:`~cudarecv.core.errors.TransferTimeout` says it waited for its turn. (Making the
receives independent would take a thread or a posted header per ``init_tag``, and
each transfer's offer and ``DONE`` order with it: not done.)
"""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
import weakref
import zlib
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from ..core.driver import Driver
from ..core.errors import ArgumentError, OutOfStepError
from ..core.host_copy import direct_read_pays, direct_read_setting, may_read_process, read_process
from ..core.link import Link
from ..core.log import logger
from ..core.streams import EventWork, record
from ..core.tags import (  # the receiver's ANSWER and DONE for segment k travel on BACK_TAGS + k
    BACK_TAGS,
    header_tag,
    piece_tag,
)
from ..core.transfer import CUDA_IPC, SHARED_MEMORY, WIRE
from ..core.transport import park
from ..plan.header import KIND_BUCKETS, KIND_CHUNKS, KIND_NAMES, STORAGE_SLOTS, Header, drain_limit, piece_sizes
from ..wire.control import ROOM, wire_bytes
from ..wire.fast import OFFER_SIZE
from ..wire.staging import Lane, send_from
from . import cuda_ipc
from .shared_memory import (
    STORAGE,
    STORAGE_OFFER_SIZE,
    Mapping,
    MappingError,
    Segment,
    StorageMapping,
    available,
    map_offer,
    offer,
    offer_kind,
    offer_size,
    shared_storage,
    storage_offer,
)

TRANSPORTS = ("auto", "wire")
#: ``CUDARECV_TRANSPORT=wire`` turns every same-host transport off (the default, ``auto``, allows them)
ENV = "CUDARECV_TRANSPORT"
MAX_SEGMENT_BYTES = 1 << 48
STORAGE_BACK = 2  # ... and its DONE of a storage-route or direct transfer on BACK_TAGS + 2
DECLINED = 64  # storages a sender remembers the receiver could not map


def check_transport(transport: object) -> str:
    """``transport`` is one of :data:`TRANSPORTS`, and the environment's settings are valid (checked here, with
    the arguments: a receiver's refusal then reaches its sender)."""
    if not isinstance(transport, str) or transport not in TRANSPORTS:
        raise ArgumentError(
            f"`transport` must be one of {TRANSPORTS} (\"auto\": shared memory with a cudarecv peer on this "
            f"machine, else the wire; \"wire\": always the socket or NCCL), got {transport!r}"
        )
    _environment()
    return transport


def _environment() -> str:
    """:data:`ENV`, checked, and the direct route's variable, ``CUDARECV_DIRECT_READ``, with it."""
    env = os.environ.get(ENV, "auto")
    if env not in TRANSPORTS:
        raise ArgumentError(f"the environment variable {ENV}={env!r} must be one of {TRANSPORTS}")
    direct_read_setting()
    return env


def allowed(transport: str) -> bool:
    """Whether ``transport`` and the environment (:data:`ENV`) allow a same-host transport (checked before
    anything is sent)."""
    return _environment() == "auto" and transport == "auto"


class Route:
    """Which transport a transfer's payload took (decided as it runs); read as ``Transfer.transport``."""

    def __init__(self) -> None:
        self.transport = WIRE
        self.waiting = False  # whether a receive still waits for its turn on the link's thread (nothing posted)


# -- records -----------------------------------------------------------------------------
def _sealed(body: bytes, size: int) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body)) + bytes(size - len(body) - 4)


def _open(raw: bytes, record: struct.Struct, magic: bytes, what: str) -> tuple:
    (crc,) = struct.unpack_from("<I", raw, record.size)
    fields = record.unpack_from(raw)
    if fields[0] != magic or zlib.crc32(raw[:record.size]) != crc:
        raise OutOfStepError(f"the message is no cudarecv {what} (bad magic or checksum): the link is out of step")
    return fields[1:]


_BACK = struct.Struct("<4sHHQ")  # magic, kind, status, the transfer number it is about
BACK_SIZE = 32
ANSWER, DONE = 0, 1
# an ANSWER's OK with DIRECT: the receiver reads the sender's host leaves and storages itself; with
# DIRECT_STORAGES: its consolidated storages only (the kernel's read of small regions is slow on its machine)
OK, NO, DIRECT, DIRECT_STORAGES = 0, 1, 2, 3
_READY = struct.Struct("<4sIQQQ")  # magic, message index, transfer number, offset, length
READY_SIZE = 48


#: seconds a receiver sleeps on a progress word that stopped moving (a futex: no CPU) before it waits for the
#: READY on the process group instead (which also tells a dead sender)
FOLLOW_WAIT = 0.002


def _back(kind: int, status: int, seq: int) -> bytes:
    return _sealed(_BACK.pack(b"CDRB", kind, status, seq), BACK_SIZE)


# -- the two ends of a link direction ------------------------------------------------------
# a group's sides, per (peer, role); they end when the group is garbage-collected (a plain isend/irecv link has
# no close): nothing of theirs refers to the group, and an idle driver holds no job (:class:`~cudarecv.weights.link.Driver`)
_SIDES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_SAID: "weakref.WeakKeyDictionary[Any, set]" = weakref.WeakKeyDictionary()  # what was logged, per group
_LOCK = threading.Lock()
STOP_WAIT = 1.0  # seconds a side's closing waits for its (idle) thread to end


def _side(link: Link, role: str, make: Callable[[], Any] | None) -> Any:
    with _LOCK:
        sides = _SIDES.get(link.pg)
        if sides is None:
            sides = _SIDES[link.pg] = {}
            weakref.finalize(link.pg, _close_all, sides).atexit = False  # (at exit, idle daemon threads just end)
        side = sides.get((link.peer, role))
        if side is None and make is not None:
            side = sides[(link.peer, role)] = make()
        return side


def _close_all(sides: dict) -> None:
    """A group went away: stop its sides' threads and let go of their segments and mappings."""
    for side in list(sides.values()):
        side.close()
    sides.clear()


def _chose(link: Link, role: str, transport: str, reason: str) -> None:
    """Log the transport a link direction takes, and why (once per link, role and reason)."""
    with _LOCK:
        said = _SAID.setdefault(link.pg, set())
        if (link.peer, role, reason) in said:
            return
        said.add((link.peer, role, reason))
    logger.info("%s rank %d of a %s group: %s (%s)", "sending to" if role == "send" else "receiving from",
                link.peer, link.backend, transport, reason)


def sending_side(link: Link, transport: str, device: torch.device) -> "SendSide | None":
    """The link's sending side when this transfer goes through it (on its thread; perhaps through
    shared memory or CUDA IPC), else None: the transfer goes on the wire as it always did."""
    if link.backend != "gloo":  # NCCL's own intra-node path is peer to peer already
        return None
    problem = available() if device.type == "cpu" else cuda_ipc.available(device)
    if not allowed(transport):
        problem = f"the call's `transport` is {transport!r}, {ENV}={os.environ.get(ENV, 'auto')!r}"
    side = _side(link, "send", (lambda: SendSide(link.peer, device)) if problem is None else None)
    if side is None:  # a side made earlier is kept (it keeps the order of the link's sends)
        _chose(link, "send", WIRE, problem)
    return side


def receiving_side(link: Link) -> "RecvSide | None":
    """The link's receiving side (its thread, its mappings); None on links that cannot share memory."""
    if link.backend != "gloo" or available() is not None:
        return None
    return _side(link, "recv", lambda: RecvSide(link.peer))


def storage_table(storage: Tensor) -> np.ndarray:
    """A consolidated host storage's (address, bytes) as the one ``struct iovec`` row of a direct read."""
    return np.array([[storage.data_ptr(), storage.numel()]], dtype=np.uint64)


def _post(lane: Lane, data: bytes, tag: int) -> list[Any]:
    return lane.post(True, [wire_bytes(lane, data)], [tag])


class SendSide:
    """The sender's end of a link direction: its state, segments and thread.

    States: ``new`` (nothing offered yet), ``offered`` (an answer is on its way),
    ``shared`` (payloads go through the segments), ``wire`` (the receiver declined, or a
    transfer failed: its posted messages may never complete, so the segments are left alone).
    """

    def __init__(self, peer: int, device: torch.device) -> None:
        self.state = "new"
        self.device = device  # where its segments live: host memory, or a GPU (CUDA IPC)
        self.segments: list[Any] = []
        # the back receive posted per segment, and for the storage and direct routes (index STORAGE_BACK)
        self.fences: list[tuple[Any, Tensor, int] | None] = [None, None, None]
        self.held: list[list[Any]] = [[], [], []]  # a segment's header and READY sends, kept until its DONE
        self.direct = False  # whether the receiver reads host leaves straight out of this process
        self.direct_storages = False  # ... and consolidated host storages
        self.slots: OrderedDict[tuple[int, int, int], int] = OrderedDict()  # storages offered: their slot
        self.declined: OrderedDict[tuple[int, int, int], None] = OrderedDict()  # storages the receiver cannot map
        self.seq = 0
        self.next = 0
        self.failed: str | None = None  # why the link left shared memory for the wire, after a failure
        self.running: Route | None = None  # the route of the send on the link's thread now (it may be stuck there)
        self.peer = peer
        self.driver_name = f"cudarecv-send-{peer}"
        self.driver = Driver(self.driver_name)

    def close(self) -> None:
        """Stop the thread and let go of the segments and of what was posted for them (the group is gone)."""
        self.driver.stop(STOP_WAIT)
        self.state, self.segments, self.fences, self.held = "wire", [], [None, None, None], [[], [], []]

    def ended(self, route: Route, transfer: Any) -> None:
        """A driven send (whose ``route`` it is) ended. One that failed elsewhere than on the link's thread while
        that thread ran it (it ran out of its own time with messages posted) leaves the thread in gloo, maybe
        for good: the link leaves shared memory (as after any failed send), the thread is told to end once its
        wait returns, and later sends get a thread of their own."""
        if transfer.failed and self.running is route and threading.current_thread() is not self.driver.thread:
            self.running = None
            self._abandon("TransferTimeout: it ran out of its own time")
            self.driver.stop(0.0)
            self.driver = Driver(self.driver_name)

    def _abandon(self, why: str) -> None:
        """A transfer failed: what was posted for the segments may never complete (a DONE that never comes),
        so they and the back tags are never touched again (their works parked, the segments let go: a
        receiver that took the failed transfer's header late still reads it whole); later transfers go on the
        wire (the failed one's error is its own)."""
        park([fence[0] for fence in self.fences if fence is not None] + [w for held in self.held for w in held])
        if self.state in ("offered", "shared"):
            logger.info("sending to rank %d: shared memory left for the wire after a failed transfer (%s)",
                        self.peer, why)
        self.state, self.segments, self.fences, self.held = "wire", [], [None, None, None], [[], [], []]
        self.failed = why

    def send(self, lane: Lane, header: Header, init_tag: int, fill: Callable[[Tensor, int, int, int], None],
             wire: Callable[[Header, bytes | None], Any], allow: bool, route: Route,
             storage: Tensor | None = None, chunks: list[Tensor] | None = None,
             table: Tensor | None = None) -> Any:
        """The protocol of one fast-wire send on this link (run on :attr:`driver`).

        ``fill(data, i, offset, length)`` writes message i into a segment's ``data``;
        ``wire(header, offer)`` is the wire protocol (with ``offer`` sent after the header).
        A consolidated ``storage`` (cut into ``chunks``) that torch keeps in shared memory is read by
        the receiver where it lies, if it can map it; host leaves (their ``table`` of addresses and
        sizes, as bytes) are read straight out of this process by a receiver allowed to.
        """
        yield ()  # nothing before the link's earlier transfers: the rest runs on the link's thread, in order
        allow = allow and lane.device == self.device  # a side shares one kind of memory
        self.running = route
        try:
            if self.state == "offered":
                yield from self._answer(lane)
            offer = None
            where = None if storage is None or not (allow and self.state == "shared") else shared_storage(storage)
            if where is not None and (where[1], where[2], where[4]) not in self.declined:
                yield from self._from_storage(lane, header, init_tag, where, chunks or [], route)
                return None
            if allow and self.state == "shared" and self.direct and table is not None:
                yield from self._direct(lane, header, init_tag, table, route)
                return None
            if (allow and self.state == "shared" and self.direct_storages and storage is not None
                    and storage.device.type == "cpu" and storage.numel()):
                row = torch.from_numpy(storage_table(storage).view(np.uint8).reshape(-1))
                yield from self._direct(lane, header, init_tag, row, route)
                return None
            if allow and self.state == "shared" and header.total <= self.segments[0].capacity:
                route.transport = SHARED_MEMORY if self.device.type == "cpu" else CUDA_IPC
                yield from self._shared(lane, header, init_tag, fill)
                return None
            if allow and self.state in ("new", "shared"):
                yield from self._quiet(lane)  # the old segments are free before new ones are offered
                offer = self._offer(header.total)
                header = dataclasses.replace(header, offer=True)
            result = yield from wire(header, offer)
            if offer is not None:
                # the receiver took the offer (and mapped the segments, or not) before it posted the receives
                # of the payload, which the sends just completed into: nothing need name the segments now
                for segment in self.segments:
                    segment.close_fd()
                self.fences[0] = self._expect(lane, 0, 0)
                self.state = "offered"
            return result
        except BaseException as error:
            if self.running is route:  # (not once :meth:`ended` gave up on it)
                self._abandon(f"{type(error).__name__}: {error}".splitlines()[0])
            raise
        finally:
            if self.running is route:
                self.running = None

    def _offer(self, total: int) -> bytes:
        self.next = 0
        if self.device.type == "cpu":
            self.segments = [Segment(max(total, 1)) for _ in range(2)]
            raw = offer(self.segments)
        else:
            self.segments = [cuda_ipc.DeviceSegment(max(total, 1), self.device) for _ in range(2)]
            raw = cuda_ipc.offer(self.segments)
        return raw + bytes(OFFER_SIZE - len(raw))

    def _expect(self, lane: Lane, k: int, seq: int) -> tuple[Any, Tensor, int]:
        buffer = torch.zeros(BACK_SIZE + ROOM, dtype=torch.uint8)  # (room: gloo aborts on a longer message)
        return lane.post(False, [buffer], [BACK_TAGS + k])[0], buffer, seq

    def _take(self, k: int, kind: int) -> Any:
        work, buffer, seq = self.fences[k]
        yield [work]
        self.fences[k] = None
        raw = buffer.numpy()
        if raw[BACK_SIZE:].any():
            raise OutOfStepError("the receiver's same-host message is longer than its 32 bytes: out of step")
        got_kind, status, got_seq = _open(raw[:BACK_SIZE].tobytes(), _BACK, b"CDRB", "same-host answer")
        if (got_kind, got_seq) != (kind, seq):
            raise OutOfStepError(f"the receiver's same-host message is kind {got_kind} for transfer {got_seq}, "
                                 f"expected kind {kind} for {seq}: the link is out of step")
        self.held[k] = []
        return status

    def _answer(self, lane: Lane) -> Any:
        status = yield from self._take(0, ANSWER)
        if status in (OK, DIRECT, DIRECT_STORAGES):
            self.state, self.direct = "shared", status == DIRECT
            self.direct_storages = status in (DIRECT, DIRECT_STORAGES)
            route = {DIRECT: "the receiver reads leaves and storages itself",
                     DIRECT_STORAGES: "the receiver reads consolidated storages itself"}.get(status, "segments")
            _chose(lane.link, "send", SHARED_MEMORY if self.device.type == "cpu" else CUDA_IPC,
                   f"the receiver took the offer; {route}")
        else:
            self.state, self.segments = "wire", []
            _chose(lane.link, "send", WIRE, "the receiver declined the offer (it logs why)")

    def _quiet(self, lane: Lane) -> Any:
        for k in (0, 1):
            if self.fences[k] is not None:
                yield from self._take(k, DONE)

    def _shared(self, lane: Lane, header: Header, init_tag: int, fill: Callable[[Tensor, int, int, int], None]) -> Any:
        k = self.next
        self.next ^= 1
        if self.fences[k] is not None:
            yield from self._take(k, DONE)  # the receiver is done reading this segment
        self.seq += 1
        seq, segment = self.seq, self.segments[k]
        progress = isinstance(segment, Segment) and lane.stream is None  # (host bytes, written as fill returns)
        if progress:
            segment.start(seq)  # before the header: a receiver that has the header sees this transfer's word
        held = _post(lane, dataclasses.replace(header, transport=1, segment=k, seq=seq).pack(), header_tag(init_tag))
        offset = 0
        for i, length in enumerate(piece_sizes(header.total, header.piece)):
            with lane.on_stream():
                fill(segment.data, i, offset, length)
            offset += length
            if progress:
                segment.advance(offset)  # the receiver may copy up to here before the READY comes
        if lane.stream is not None:
            segment.written.record(lane.stream)  # before the READY: the reader's copies wait for it
        held += _post(lane, _sealed(_READY.pack(b"CDRP", 0, seq, 0, header.total), READY_SIZE), piece_tag(init_tag))
        self.held[k] = held
        self.fences[k] = self._expect(lane, k, seq)
        # a gloo send completes once the receiver has taken it: the send ends when its receiver has the header
        # and READY, so it can still get the bytes if this process exits right after (the wire's promise too)
        yield held
        self.held[k] = []

    def _from_storage(self, lane: Lane, header: Header, init_tag: int, where: tuple[int, int, int, int, int],
                      chunks: list[Tensor], route: Route) -> Any:
        """The storage route: the header names the storage's slot (after an offer the first time); the receiver
        copies the bytes straight out of this process's storage and says DONE, or NO (it cannot map it: then the
        chunks follow on the wire and the storage never takes this route again). Ends once the receiver is done."""
        key = (where[1], where[2], where[4])  # the file (device, inode: never reused while it lives) and offset
        slot, offer = self.slots.get(key), None
        if slot is None:
            slot = len(self.slots) if len(self.slots) < STORAGE_SLOTS else self.slots.popitem(last=False)[1]
            offer = storage_offer(where)
        self.slots[key] = slot
        self.slots.move_to_end(key)
        self.seq += 1
        head = dataclasses.replace(header, transport=2, segment=slot, offer=offer is not None, seq=self.seq)
        self.held[STORAGE_BACK] = _post(lane, head.pack(), header_tag(init_tag))
        if offer is not None:
            self.held[STORAGE_BACK] += _post(lane, offer + bytes(OFFER_SIZE - len(offer)), header_tag(init_tag))
        self.fences[STORAGE_BACK] = self._expect(lane, STORAGE_BACK, self.seq)
        status = yield from self._take(STORAGE_BACK, DONE)
        if status == OK:
            route.transport = SHARED_MEMORY
        else:
            del self.slots[key]
            self.declined[key] = None
            if len(self.declined) > DECLINED:
                self.declined.popitem(last=False)
            yield from send_from(lane, chunks, [piece_tag(init_tag)] * len(chunks))

    def _direct(self, lane: Lane, header: Header, init_tag: int, table: Tensor, route: Route) -> Any:
        """The direct route: the header, then the leaves' (or the consolidated storage's) addresses and sizes; the
        receiver reads them straight out of this process (one copy in all, by the kernel) and says DONE. Ends once
        it is done."""
        self.seq += 1
        head = dataclasses.replace(header, transport=3, segment=0, seq=self.seq)
        self.held[STORAGE_BACK] = _post(lane, head.pack(), header_tag(init_tag))
        self.held[STORAGE_BACK] += lane.post(True, [table], [piece_tag(init_tag)])
        self.fences[STORAGE_BACK] = self._expect(lane, STORAGE_BACK, self.seq)
        if (yield from self._take(STORAGE_BACK, DONE)) != OK:
            raise OutOfStepError("the receiver could not read this process's memory (a region was not mapped): "
                                 "its tensordict may be partly written")
        route.transport = SHARED_MEMORY


class RecvSide:
    """The receiver's end of a link direction: its thread and its read-only mappings of the sender's
    segments. States: ``new``, ``shared`` (mapped), ``wire`` (an offer was declined)."""

    def __init__(self, peer: int) -> None:
        self.state = "new"
        self.mappings: list[Mapping] = []
        self.storages: dict[int, StorageMapping | None] = {}  # the sender's storages per slot (None: not mappable)
        self.direct: int | None = None  # the sender's pid, if this process reads its storages itself
        self.direct_leaves = False  # ... and its leaves
        self.declined: str | None = None  # why the last offer was declined
        self.said: dict[int, list[Any]] = {}  # the last ANSWER or DONE sent on each back tag, until the next
        self.driver_name = f"cudarecv-recv-{peer}"
        self.driver = Driver(self.driver_name)

    def submit(self, job: Callable[[], None]) -> None:
        self.driver.submit(job)

    def queued(self, protocol: Any, route: Route) -> Any:
        """``protocol`` (a receive) posting nothing before the link's earlier receives have ended, on the
        link's thread: an offer follows its header on the header's tag, and would be taken by the header
        receive of a later transfer with the same ``init_tag`` posted meanwhile. ``route.waiting`` says
        whether it still waits for its turn."""
        route.waiting = True
        yield ()
        route.waiting = False
        return (yield from protocol)

    def ended(self, route: Route, transfer: Any) -> None:
        """A driven receive (whose ``route`` it is) ended. One that failed elsewhere than on the link's thread
        (it ran out of its own time) once its turn came leaves that thread in gloo, maybe for good: it is told
        to end once the wait returns, and later receives get a thread of their own. One that failed while still
        queued (``route.waiting``) leaves the thread running an earlier receive, whose turn later ones await."""
        if transfer.failed and not route.waiting and threading.current_thread() is not self.driver.thread:
            self.driver.stop(0.0)
            self.driver = Driver(self.driver_name)

    def close(self) -> None:
        """Stop the thread and let go of the mappings (the group is gone)."""
        self.driver.stop(STOP_WAIT)
        self.state, self.mappings, self.storages, self.direct, self.said = "wire", [], {}, None, {}

    def _say(self, lane: Lane, kind: int, status: int, seq: int, k: int) -> None:
        """Send an ANSWER or DONE on back tag ``BACK_TAGS + k``. Its work is held until the next on that tag: the
        sender has taken it before it sends what calls for another (held here, not parked: a parked work keeps a
        dropped group's sockets and threads until 256 more are parked)."""
        self.said[k] = _post(lane, _back(kind, status, seq), BACK_TAGS + k)

    @property
    def driven(self) -> bool:
        """Whether this link's receives run on :attr:`driver` (the sender's may wait for their DONE)."""
        return self.state != "wire"

    def take_offer(self, lane: Lane, raw: bytes, allow: bool, header: Header) -> None:
        """Map the offered segments (host memory, or CUDA IPC onto the lane's GPU) if this end may and
        can; answer the sender either way. A storage offer (the storage route: ``header`` names its slot)
        is answered by the transfer's DONE instead."""
        if (offer_kind(raw) == STORAGE) != (header.transport == 2):
            raise OutOfStepError("the offer does not go with the header's route: the link is out of step")
        if header.transport == 2:
            self.storages[header.segment] = self._map_storage(raw, allow)
            return
        reason, mappings = None, []
        if not allow:
            reason = f"this receiver's transport is \"wire\" (the call's `transport` or {ENV})"
        else:
            try:
                if cuda_ipc.is_device_offer(raw):
                    mappings = cuda_ipc.map_offer(raw[:cuda_ipc.offer_size(2)], MAX_SEGMENT_BYTES, lane.device)
                else:
                    mappings = map_offer(raw[:offer_size(2)], MAX_SEGMENT_BYTES)
            except Exception as error:  # noqa: BLE001 - whatever stops the mapping (a CUDA error too): decline
                reason = str(error) if isinstance(error, MappingError) else f"{type(error).__name__}: {error}"
        self.declined = reason
        self.state, self.mappings = ("shared", mappings) if reason is None else ("wire", [])
        kind = CUDA_IPC if mappings and not isinstance(mappings[0], Mapping) else SHARED_MEMORY
        _chose(lane.link, "recv", WIRE if reason is not None else kind,
               f"declined the offer: {reason}" if reason is not None else "took the offer")
        host = reason is None and isinstance(mappings[0], Mapping)
        pays = direct_read_pays() if host and may_read_process(mappings[0].pid) is None else None
        self.direct = mappings[0].pid if pays is not None and pays.storages else None
        self.direct_leaves = pays is not None and pays.leaves
        status = (NO if reason is not None else DIRECT if self.direct_leaves
                  else DIRECT_STORAGES if self.direct is not None else OK)
        self._say(lane, ANSWER, status, 0, 0)

    def _map_storage(self, raw: bytes, allow: bool) -> StorageMapping | None:
        if not allow:
            self.declined = f"this receiver's transport is \"wire\" (the call's `transport` or {ENV})"
            return None
        try:
            return StorageMapping(raw[:STORAGE_OFFER_SIZE], MAX_SEGMENT_BYTES)
        except Exception as error:  # noqa: BLE001 - whatever stops the mapping: the payload comes on the wire
            self.declined = str(error) if isinstance(error, MappingError) else f"{type(error).__name__}: {error}"
            return None

    def receive(self, lane: Lane, header: Header, init_tag: int, copy: Callable[[Tensor, int, int, int, int], None],
                problem: str | None, route: Route, table: np.ndarray | None = None) -> Any:
        """A sub-protocol: copy the segment's messages out with ``copy(data, i, offset, length, piece)`` as the
        sender's progress word says they are in, take its READY (checked against the header and the segment)
        and copy what is left (nothing when ``problem``: a mismatched header), then say DONE; or read the
        sender's leaves into those of ``table`` (their addresses and sizes). Returns whether the payload was
        taken (False: a storage this receiver could not map, whose payload follows on the wire)."""
        if header.transport == 2:
            return (yield from self._from_storage(lane, header, copy, problem, route))
        if header.transport == 3:
            return (yield from self._read_direct(lane, header, init_tag, table, copy, problem, route))
        if self.state != "shared" or header.segment >= len(self.mappings):
            raise OutOfStepError(f"the header names shared segment {header.segment}, which this receiver never "
                                 "mapped: the link is out of step")
        mapping = self.mappings[header.segment]
        if header.total > mapping.capacity:
            raise OutOfStepError(f"the header announces {header.total} bytes in a segment of {mapping.capacity}: "
                                 "the link is out of step")
        piece, total = header.piece, header.total
        count, done = len(piece_sizes(total, piece)), 0  # messages, and how many are copied out
        device = isinstance(mapping, cuda_ipc.DeviceMapping)
        route.transport = CUDA_IPC if device else SHARED_MEMORY

        def follow() -> None:
            """Copy out the messages the sender's progress word says are written, in order, without waiting
            for the READY (its check comes when it lands); back to the READY once the word stops moving."""
            nonlocal done
            while done < count:
                written = mapping.progress(header.seq)
                if written is None:
                    return  # the sender publishes no progress (built without the native copies)
                end = min((done + 1) * piece, total)  # (the receiver's own plan: never past its buffers)
                if written >= end:
                    with lane.on_stream():
                        copy(mapping.data, done, done * piece, end - done * piece, piece)
                    done += 1
                elif not mapping.follow(written, FOLLOW_WAIT):
                    return

        slot = torch.zeros(READY_SIZE + ROOM, dtype=torch.uint8)
        [ready] = lane.post(False, [slot], [piece_tag(init_tag)])
        if problem is None and not device:
            follow()
        yield [ready]
        raw = slot.numpy()
        if raw[READY_SIZE:].any():
            raise OutOfStepError("a READY message is longer than its 48 bytes: the link is out of step")
        got = _open(raw[:READY_SIZE].tobytes(), _READY, b"CDRP", "READY message")
        want = (0, header.seq, 0, total)
        if tuple(got) != want:
            raise OutOfStepError(f"READY message 0 names (index, transfer, offset, length) {tuple(got)}, "
                                 f"the plan {want}: not read; the link is out of step")
        if problem is None:
            with lane.on_stream():
                if device:
                    mapping.before_read(lane.stream)
                for i in range(done, count):
                    copy(mapping.data, i, i * piece, min(piece, total - i * piece), piece)
        if lane.stream is not None:  # the copies out of the segment are over before the sender may write it
            yield [EventWork(record(lane.stream))]
        self._say(lane, DONE, OK, header.seq, header.segment)
        return True

    def _read_direct(self, lane: Lane, header: Header, init_tag: int, table: np.ndarray | None,
                     copy: Callable[[Tensor, int, int, int, int], None], problem: str | None, route: Route) -> Any:
        """The direct route: take the sender's table of leaves, or of its one consolidated storage (checked
        against this tensordict's ``table``: the same sizes), and read them straight into the leaves or storage,
        then DONE (NO if the read fell short). Off the host (no ``table``) they are read into a host buffer,
        then copied out of it as out of a segment."""
        leaves = header.kind == KIND_BUCKETS
        what = "leaves" if leaves else "storage"
        if self.state != "shared" or self.direct is None or not (self.direct_leaves if leaves else
                                                                 header.kind == KIND_CHUNKS):
            raise OutOfStepError(f"the sender names its {what} for a direct read this receiver never agreed to: "
                                 "the link is out of step")
        size = 16 * (header.leaves if leaves else 1)
        if problem is not None and size > drain_limit(0 if table is None else 16 * len(table)):
            raise OutOfStepError(f"{problem}; its table of {header.leaves} leaves is more than this receiver drains: "
                                 "not drained, the link is out of step; the tensordict was left untouched")
        buffer = torch.zeros(size + ROOM, dtype=torch.uint8)
        yield lane.post(False, [buffer], [piece_tag(init_tag)])
        raw = buffer.numpy()
        if raw[size:].any():
            raise OutOfStepError(f"the sender's table of its {what} is longer than its header says: out of step")
        status = OK
        if problem is None:
            remote = raw[:size].view(np.uint64).reshape(-1, 2)
            staging = None if table is not None else torch.empty(header.total, dtype=torch.uint8)
            local = table if staging is None else np.array([[staging.data_ptr(), header.total]], dtype=np.uint64)
            sizes = remote[:, 1] if staging is None else remote[:, 1].sum(keepdims=True)
            if not np.array_equal(sizes, local[:, 1]):
                raise OutOfStepError(f"the sender's table of its {what} names other sizes than this tensordict's "
                                     f"{what}: not read; the link is out of step")
            route.transport = SHARED_MEMORY
            status = OK if read_process(self.direct, local, remote) == header.total else NO
            if staging is not None and status == OK:
                for i, n in enumerate(piece_sizes(header.total, header.piece)):
                    with lane.on_stream():
                        copy(staging, i, i * header.piece, n, header.piece)
                if lane.stream is not None:  # the copies out of the buffer have landed
                    yield [EventWork(record(lane.stream))]
        self._say(lane, DONE, status, header.seq, STORAGE_BACK)
        if status != OK:
            raise OutOfStepError(f"the sender's table of its {what} names memory it does not have: the tensordict "
                                 "is partly written; the link is out of step")
        return True

    def _from_storage(self, lane: Lane, header: Header, copy: Callable[[Tensor, int, int, int, int], None],
                      problem: str | None, route: Route) -> Any:
        """The storage route: one copy straight out of the sender's storage (checked against the mapping),
        then DONE; or NO if it could not be mapped."""
        if self.state != "shared" or header.kind != KIND_CHUNKS or header.segment not in self.storages:
            raise OutOfStepError(f"the header names storage slot {header.segment} of a {KIND_NAMES[header.kind]} "
                                 "transfer, which this receiver never mapped: the link is out of step")
        mapping = self.storages[header.segment]
        if mapping is None:
            self._say(lane, DONE, NO, header.seq, STORAGE_BACK)
            return False
        if header.total > mapping.capacity:
            raise OutOfStepError(f"the header announces {header.total} bytes in a storage of {mapping.capacity}: "
                                 "the link is out of step")
        route.transport = SHARED_MEMORY
        if problem is None:
            copy(mapping.data, 0, 0, header.total, header.total)
        if lane.stream is not None:  # the copy has landed before the sender may write its storage again
            yield [EventWork(record(lane.stream))]
        self._say(lane, DONE, OK, header.seq, STORAGE_BACK)
        return True
