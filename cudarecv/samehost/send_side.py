"""The sender's end of a same-host link direction: its channels (host segments, CUDA IPC segments), the
routes a payload may take, and the words back it waits for.

A transfer through a segment (double buffered: the channel's n-th uses segment n % 2) after its header
(which names the route, the segment and the transfer's number): the sender waits for the receiver's
``DONE`` of the segment's previous use, stamps the segment's progress word with the transfer's number,
sends the header, writes the messages into the segment, publishing after each how many bytes are in
(host memory; the receiver may copy behind it), then sends a 48-byte ``READY``; the send ends once the
receiver has taken the header and the ``READY`` (gloo completes a send then), so the receiver gets the bytes
even if this process exits at once. Device segments are written on the transfer's stream and carry an
interprocess event the reader's stream waits on.

Two host routes skip the segments (one copy in all), and the send then ends with the receiver's ``DONE``
(it reads live memory): *storage*, a consolidated storage that torch keeps in shared memory, offered once
(its fd, device and inode) in one of ``STORAGE_SLOTS`` slots; *direct*, the sender's leaves (or private
storage) read by the receiver with ``process_vm_readv`` where it answered the offer with ``DIRECT``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from ..core.driver import Driver
from ..core.errors import OutOfStepError
from ..core.link import Link
from ..core.log import logger
from ..core.tags import BACK_TAGS, header_tag, piece_tag
from ..core.transfer import CUDA_IPC, SHARED_MEMORY, WIRE
from ..core.transport import park
from ..plan.header import Header, PayloadRoute, piece_sizes
from ..wire.control import ROOM, wire_bytes
from ..wire.fast import OFFER_SIZE
from ..wire.layouts import announce
from ..wire.staging import Lane, send_from
from . import cuda_ipc
from .channels import ChannelState, SendChannel
from .policy import HOST, STOP_WAIT, Carried, Kind, chose, kind_of, unavailable
from .records import BACK_SIZE, Status, Word, read_back, ready
from .routes import STORAGE_BACK, Steps, StorageSlots
from .shared_memory import Segment, StorageWhere, offer, shared_storage, storage_offer

if TYPE_CHECKING:
    from ..core.transfer import Transfer


class SendSide:
    """The sender's end of a link direction (see the module docstring): one thread, a channel per kind."""

    def __init__(self, peer: int) -> None:
        self.peer = peer  # (not the link: the group's registry of sides holds it weakly)
        self.channels: dict[Kind, SendChannel] = {}
        # per back tag (BACK_TAGS + k): the receive of the word back posted, and the sends kept until it comes
        self.fences: dict[int, tuple[Any, Tensor, int]] = {}
        self.held: dict[int, list[Any]] = {}
        self.direct = False  # whether the receiver reads host leaves straight out of this process
        self.direct_storages = False  # ... and consolidated host storages
        self.storages = StorageSlots()  # the storage route's: storages offered, and those declined
        self.seq = 0  # the transfers through shared memory (named in their headers)
        # every transfer of the side (a declined offer is made again after some of them)
        self.transfers = 0
        # why the link left shared memory for the wire, after a failure
        self.failed: str | None = None
        # the send on the link's thread now (it may be stuck there)
        self.running: Carried | None = None
        self.driver_name = f"cudarecv-send-{self.peer}"
        self.driver = Driver(self.driver_name)

    def close(self) -> None:
        """Stop the thread and let go of the segments and of what was posted for them (the group is gone)."""
        self.driver.stop(STOP_WAIT)
        self.channels, self.fences, self.held = {}, {}, {}

    def ended(self, carried: Carried, transfer: Transfer) -> None:
        """A driven send ended. One that failed elsewhere than on the link's thread while that thread ran it (it
        ran out of its own time with messages posted) leaves the thread in gloo, maybe for good: the link leaves
        shared memory (as after any failed send), the thread is told to end once its wait returns, and later
        sends get a thread of their own."""
        if (
            transfer.failed
            and self.running is carried
            and threading.current_thread() is not self.driver.thread
        ):
            self.running = None
            self._abandon("TransferTimeout: it ran out of its own time")
            self.driver.stop(0.0)
            self.driver = Driver(self.driver_name)

    def _abandon(self, why: str) -> None:
        """A transfer failed: what was posted for the segments may never complete (a DONE that never comes), so
        they and the back tags are never touched again (their works parked, the segments let go: a receiver that
        took the failed transfer's header late still reads it whole); later transfers go on the wire."""
        park(
            [fence[0] for fence in self.fences.values()]
            + [w for held in self.held.values() for w in held]
        )
        if any(
            ch.state in (ChannelState.OFFERED, ChannelState.SHARED) for ch in self.channels.values()
        ):
            logger.info(
                "sending to rank %d: shared memory left for the wire after a failed transfer (%s)",
                self.peer,
                why,
            )
        for ch in self.channels.values():
            ch.leave()
        self.fences, self.held, self.failed = {}, {}, why

    def _channel(self, link: Link, device: torch.device) -> SendChannel | None:
        """The channel of memory on ``device``, made the first time (None: that memory cannot be shared)."""
        kind = kind_of(device)
        ch = self.channels.get(kind)
        if ch is None:
            problem = unavailable(device)
            if problem is not None:
                chose(link, "send", WIRE, f"{device}: {problem}")
                return None
            ch = self.channels[kind] = SendChannel(kind, device)
        elif ch.device != device:
            chose(
                link,
                "send",
                WIRE,
                f"this link's device segments are on {ch.device}; {device} goes on the wire",
            )
            return None
        return ch

    def send(
        self,
        lane: Lane,
        header: Header,
        init_tag: int,
        fill: Callable[[Tensor, str, int, int, int], None],
        wire: Callable[[Header, bytes | None], Any],
        allow: bool,
        carried: Carried,
        storage: Tensor | None = None,
        chunks: list[Tensor] | None = None,
        table: Tensor | None = None,
    ) -> Steps[Any]:
        """The protocol of one fast-wire send on this link (run on :attr:`driver`).

        ``fill(data, key, i, offset, length)`` writes message i into segment ``data`` (``key`` names it);
        ``wire(header, offer)`` is the wire protocol (with ``offer`` sent after the header). A consolidated
        ``storage`` (cut into ``chunks``) that torch keeps in shared memory is read by the receiver where it
        lies, if it can map it; host leaves (their ``table`` of addresses and sizes, as bytes) are read straight
        out of this process by a receiver allowed to.
        """
        yield ()  # nothing before the link's earlier transfers: the rest runs on the link's thread, in order
        self.transfers += 1
        ch = self._channel(lane.link, lane.device) if allow else None
        self.running = carried
        try:
            if ch is not None and ch.state is ChannelState.OFFERED:
                yield from self._answer(lane, ch)
            shared = ch is not None and ch.state is ChannelState.SHARED
            host = shared and ch is not None and ch.kind == HOST
            where = shared_storage(storage) if host and storage is not None else None
            if where is not None and not self.storages.was_declined(where):
                yield from self._send_storage(lane, header, init_tag, where, chunks or [], carried)
                return None
            if host and self.direct and table is not None:
                yield from self._send_direct(lane, header, init_tag, table, carried)
                return None
            if host and self.direct_storages and storage is not None and storage.numel():
                row = torch.from_numpy(
                    np.array([[storage.data_ptr(), storage.numel()]], dtype=np.uint64)
                    .view(np.uint8)
                    .reshape(-1)
                )
                yield from self._send_direct(lane, header, init_tag, row, carried)
                return None
            if ch is not None and shared and header.total <= ch.capacity:
                carried.transport = SHARED_MEMORY if ch.kind == HOST else CUDA_IPC
                yield from self._shared(lane, ch, header, init_tag, fill)
                return None
            offer_bytes = None
            if ch is not None and ch.may_offer(self.transfers, header.total):
                yield from self._quiet(ch)  # the old segments are free before new ones are offered
                offer_bytes = self._offer(ch, header.total)
                if offer_bytes is not None:
                    header = dataclasses.replace(header, offer=True)
            result = yield from wire(header, offer_bytes)
            if ch is not None and offer_bytes is not None:
                # the receiver took the offer (and mapped the segments, or not) before it posted the receives
                # of the payload, which the sends just completed into: nothing need name the segments now
                for segment in ch.segments:
                    segment.close_fd()
                self.expect(lane, ch.back, 0)
                ch.move(ChannelState.OFFERED)
            return result
        except BaseException as error:
            if self.running is carried:  # (not once :meth:`ended` gave up on it)
                self._abandon(f"{type(error).__name__}: {error}".splitlines()[0])
            raise
        finally:
            if self.running is carried:
                self.running = None

    # -- negotiation -------------------------------------------------------------------------------------
    def _offer(self, ch: SendChannel, total: int) -> bytes | None:
        """New segments for ``total`` bytes and their offer; None if they could not be made (logged: the
        channel keeps what it shared, or is offered again later)."""
        ch.previous = ch.segments if ch.state is ChannelState.SHARED else None
        segments: list[Any]
        try:
            if ch.kind == HOST:
                host = [Segment(max(total, 1)) for _ in range(2)]
                segments, raw = list(host), offer(host)
            else:
                device = [cuda_ipc.DeviceSegment(max(total, 1), ch.device) for _ in range(2)]
                segments, raw = list(device), cuda_ipc.offer(device)
        except Exception as error:  # noqa: BLE001 - memory, descriptors, a refused IPC export: not now
            logger.warning(
                "sending to rank %d: %s segments of %d bytes could not be made (%s: %s); this transfer "
                "goes on the wire",
                self.peer,
                ch.kind,
                total,
                type(error).__name__,
                error,
            )
            self._declined_for_now(ch, total)
            return None
        ch.segments, ch.next, ch.offered = segments, 0, total
        return raw + bytes(OFFER_SIZE - len(raw))

    def _declined_for_now(self, ch: SendChannel, total: int) -> None:
        """An offer of ``total`` bytes did not happen (the channel stays where it was) or was declined for now
        (OFFERED): back to what was shared (larger transfers on the wire for a while), or to NEW; offered
        again after ``ch.retry.wait`` transfers."""
        kept = ch.previous
        if ch.state is ChannelState.OFFERED:
            ch.move(ChannelState.NEW if kept is None else ChannelState.SHARED)
        ch.segments, ch.previous, ch.next = kept or [], None, 0
        ch.retry.declined(self.transfers, None if kept is None else total)

    def _answer(self, lane: Lane, ch: SendChannel) -> Steps[None]:
        status = yield from self.take(ch.back, Word.ANSWER)
        if status in (Status.OK, Status.DIRECT, Status.DIRECT_STORAGES):
            ch.move(ChannelState.SHARED)
            ch.previous = None
            ch.retry.taken()
            if ch.kind == HOST:
                self.direct = status == Status.DIRECT
                self.direct_storages = status in (Status.DIRECT, Status.DIRECT_STORAGES)
            route = {
                Status.DIRECT: "the receiver reads leaves and storages itself",
                Status.DIRECT_STORAGES: "the receiver reads consolidated storages itself",
            }.get(status, "segments")
            chose(
                lane.link,
                "send",
                SHARED_MEMORY if ch.kind == HOST else CUDA_IPC,
                f"the receiver took the offer; {route}",
            )
        elif status == Status.NO_NOW:
            self._declined_for_now(ch, ch.offered)
            chose(
                lane.link,
                "send",
                WIRE if ch.state is ChannelState.NEW else ch.kind,
                f"the receiver could not map {ch.kind} segments of {ch.offered} bytes now (it logs why); "
                "they are offered again later",
            )
        else:
            ch.leave()
            chose(
                lane.link, "send", WIRE, f"the receiver declined the {ch.kind} offer (it logs why)"
            )

    def expect(self, lane: Lane, k: int, seq: int) -> None:
        """Post the receive of the word back on ``BACK_TAGS + k`` about transfer ``seq``."""
        buffer = torch.zeros(
            BACK_SIZE + ROOM, dtype=torch.uint8
        )  # (room: gloo aborts on a longer message)
        self.fences[k] = (lane.post(False, [buffer], [BACK_TAGS + k])[0], buffer, seq)

    def take(self, k: int, word: Word) -> Steps[Status]:
        work, buffer, seq = self.fences[k]
        yield [work]
        del self.fences[k]
        status = read_back(buffer.numpy().tobytes(), word, seq)
        self.held.pop(k, None)
        return status

    def _quiet(self, ch: SendChannel) -> Steps[None]:
        for k in (ch.back, ch.back + 1):
            if k in self.fences:
                yield from self.take(k, Word.DONE)

    # -- routes ----------------------------------------------------------------------------------------
    def post(self, lane: Lane, data: bytes, tag: int) -> list[Any]:
        return lane.post(True, [wire_bytes(lane, data)], [tag])

    def post_header(
        self, lane: Lane, header: Header, init_tag: int, offer: bytes | None = None
    ) -> list[Any]:
        """Send ``header`` and what goes with it on its tag (``offer``; the sender's layout the first time the link
        carries its schema: :func:`~cudarecv.wire.layouts.announce`)."""
        _, messages = announce(lane.link, header, offer)
        return [work for data in messages for work in self.post(lane, data, header_tag(init_tag))]

    def _shared(
        self,
        lane: Lane,
        ch: SendChannel,
        header: Header,
        init_tag: int,
        fill: Callable[[Tensor, str, int, int, int], None],
    ) -> Steps[None]:
        k = ch.next
        ch.next ^= 1
        back = ch.back + k
        if back in self.fences:
            yield from self.take(back, Word.DONE)  # the receiver is done reading this segment
        self.seq += 1
        seq, segment = self.seq, ch.segments[k]
        progress = (
            isinstance(segment, Segment) and lane.stream is None
        )  # (host bytes, written as fill returns)
        if progress:
            segment.start(
                seq
            )  # before the header: a receiver that has the header sees this transfer's word
        head = dataclasses.replace(header, transport=ch.route, segment=k, seq=seq)
        held = self.post_header(lane, head, init_tag)
        offset = 0
        for i, length in enumerate(piece_sizes(header.total, header.bucket_bytes)):
            with lane.on_stream():
                fill(segment.data, f"{ch.kind}:{k}", i, offset, length)
            offset += length
            if progress:
                segment.advance(offset)  # the receiver may copy up to here before the READY comes
        if lane.stream is not None:
            segment.written.record(lane.stream)  # before the READY: the reader's copies wait for it
        held += self.post(lane, ready(seq, header.total), piece_tag(init_tag))
        self.held[back] = held
        self.expect(lane, back, seq)
        # a gloo send completes once the receiver has taken it: the send ends when its receiver has the header
        # and READY, so it can still get the bytes if this process exits right after (the wire's promise too)
        yield held
        self.held[back] = []

    # -- the host routes that skip the segments (:mod:`~cudarecv.samehost.routes`) ---------------------------
    def _send_storage(
        self,
        lane: Lane,
        header: Header,
        init_tag: int,
        where: StorageWhere,
        chunks: list[Tensor],
        carried: Carried,
    ) -> Steps[None]:
        """The storage route: the header names the storage's slot (after an offer the first time); the receiver
        copies the bytes straight out of this process's storage and says DONE, or NO (it cannot map it: then
        the chunks follow on the wire and the storage never takes this route again)."""
        slot, new = self.storages.slot(where)
        offered = storage_offer(where) if new else None
        self.seq += 1
        head = dataclasses.replace(
            header,
            transport=PayloadRoute.STORAGE,
            segment=slot,
            offer=offered is not None,
            seq=self.seq,
        )
        padded = None if offered is None else offered + bytes(OFFER_SIZE - len(offered))
        self.held[STORAGE_BACK] = self.post_header(lane, head, init_tag, padded)
        self.expect(lane, STORAGE_BACK, self.seq)
        status = yield from self.take(STORAGE_BACK, Word.DONE)
        if status == Status.OK:
            carried.transport = SHARED_MEMORY
        else:
            self.storages.decline(where)
            yield from send_from(lane, chunks, [piece_tag(init_tag)] * len(chunks))

    def _send_direct(
        self, lane: Lane, header: Header, init_tag: int, table: Tensor, carried: Carried
    ) -> Steps[None]:
        """The direct route: the header, then the leaves' (or the consolidated storage's) addresses and sizes;
        the receiver reads them straight out of this process (one copy in all, by the kernel) and says DONE."""
        self.seq += 1
        head = dataclasses.replace(header, transport=PayloadRoute.DIRECT, segment=0, seq=self.seq)
        self.held[STORAGE_BACK] = self.post_header(lane, head, init_tag)
        self.held[STORAGE_BACK] += lane.post(True, [table], [piece_tag(init_tag)])
        self.expect(lane, STORAGE_BACK, self.seq)
        if (yield from self.take(STORAGE_BACK, Word.DONE)) != Status.OK:
            raise OutOfStepError(
                "the receiver could not read this process's memory (a region was not mapped): "
                "its tensordict may be partly written"
            )
        carried.transport = SHARED_MEMORY
