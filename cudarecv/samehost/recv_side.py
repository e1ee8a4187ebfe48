"""The receiver's end of a same-host link direction: its mappings of the sender's segments (a channel per kind
of memory), the routes it takes a payload from, and its words back (ANSWER to an offer, DONE with a transfer).

Out of a segment, the receiver copies each message as soon as the segment's progress word says it is written
(host memory: a message behind the sender; where it reads and writes comes from its own plan alone, so a peer
cannot make it read outside the segment or write outside its tensordict), sleeping on the word in between (a
futex the sender wakes after each message: no polling). Once the word stands still for :data:`FOLLOW_WAIT` it
waits for the ``READY`` instead (a dead sender's never comes: the process group says so), checks it against its
plan, copies the rest and says ``DONE``. A device segment is read on a stream that first waits for the
writer's interprocess event. On a header mismatch it copies nothing, takes the ``READY``, says ``DONE`` and
raises: the link stays in step, the tensordict untouched.

When the copies run on a stream, ``DONE`` waits for them, but the caller does not: a device receiver's transfer
ends with its copies queued (its event orders the caller's stream) and the link's thread says ``DONE`` once
they ran; a host receiver's transfer ends once they ran (its memory holds the bytes when ``wait()`` returns).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from ..core.driver import Driver
from ..core.errors import OutOfStepError
from ..core.host_copy import direct_read_pays, may_read_process, read_process
from ..core.log import logger
from ..core.protocol import Stage
from ..core.streams import EventWork, dedicated_stream, record
from ..core.tags import BACK_TAGS, piece_tag
from ..core.transfer import CUDA_IPC, SHARED_MEMORY, WIRE
from ..plan.header import (
    KIND_BUCKETS,
    KIND_CHUNKS,
    KIND_NAMES,
    Header,
    PayloadRoute,
    drain_limit,
    piece_sizes,
)
from ..wire.control import ROOM, wire_bytes
from ..wire.staging import Lane
from . import cuda_ipc
from .channels import BACK, ChannelState, RecvChannel, back_tag
from .policy import DEVICE, ENV, HOST, STOP_WAIT, Carried, Kind, chose
from .records import READY_SIZE, Status, Word, back, read_ready
from .routes import STORAGE_BACK, Copy, Steps
from .shared_memory import (
    HOST_OFFER,
    STORAGE,
    STORAGE_OFFER_SIZE,
    MappingError,
    StorageMapping,
    map_offer,
    offer_kind,
)

MAX_SEGMENT_BYTES = 1 << 48
#: seconds a receiver sleeps on a progress word that stopped moving (a futex: no CPU) before it waits for the
#: READY on the process group instead (which also tells a dead sender)
FOLLOW_WAIT = 0.002

if TYPE_CHECKING:
    from ..core.protocol import Protocol
    from ..core.transfer import Transfer


class RecvSide:
    """The receiver's end of a link direction (see the module docstring): one thread, a channel per kind."""

    def __init__(self, peer: int) -> None:
        self.peer = peer  # (not the link: the group's registry of sides holds it weakly)
        self.channels = self._new_channels()
        # the sender's storages per slot (None: not mappable)
        self.storages: dict[int, StorageMapping | None] = {}
        # the sender's pid, if this process reads its storages itself
        self.direct: int | None = None
        self.direct_leaves = False  # ... and its leaves
        self.declined: str | None = None  # why the last offer was declined
        # the last ANSWER or DONE sent on each back tag, until the next
        self.said: dict[int, list[Any]] = {}
        # a direct read into device leaves lands here first (reused)
        self.staging: Tensor | None = None
        self.staging_fence: torch.cuda.Event | None = None  # the event after the copies out of it
        self.driver_name = f"cudarecv-recv-{self.peer}"
        self.driver = Driver(self.driver_name)

    @staticmethod
    def _new_channels() -> dict[Kind, RecvChannel]:
        return {HOST: RecvChannel(HOST), DEVICE: RecvChannel(DEVICE)}

    def submit(self, job: Callable[[], None]) -> None:
        self.driver.submit(job)

    def queued(self, protocol: Protocol, carried: Carried) -> Protocol:
        """``protocol`` (a receive) posting nothing before the link's earlier receives have ended, on the link's
        thread: an offer follows its header on the header's tag, and would be taken by the header receive of a
        later transfer with the same ``init_tag`` posted meanwhile. ``carried.waiting`` says whether it still
        waits for its turn."""
        carried.waiting = True
        yield ()
        carried.waiting = False
        return (yield from protocol)

    def ended(self, carried: Carried, transfer: Transfer) -> None:
        """A driven receive ended. One that failed elsewhere than on the link's thread (it ran out of its own time)
        once its turn came leaves that thread in gloo, maybe for good: it is told to end once the wait returns, and
        later receives get a thread of their own. One that failed while still queued leaves the thread running an
        earlier receive, whose turn later ones await."""
        if (
            transfer.failed
            and not carried.waiting
            and threading.current_thread() is not self.driver.thread
        ):
            self.driver.stop(0.0)
            self.driver = Driver(self.driver_name)

    def close(self) -> None:
        """Stop the thread and let go of the mappings (the group is gone)."""
        self.driver.stop(STOP_WAIT)
        self.channels = self._new_channels()
        self.storages, self.direct, self.said, self.staging = {}, None, {}, None

    @property
    def driven(self) -> bool:
        """Whether this link's receives run on :attr:`driver` (the sender may wait for their DONE)."""
        return any(ch.state is not ChannelState.WIRE for ch in self.channels.values())

    def say(self, lane: Lane, word: Word, status: Status, seq: int, k: int) -> None:
        """Send an ANSWER or DONE on back tag ``BACK_TAGS + k``. Its work is held until the next on that tag: the
        sender has taken it before it sends what calls for another (held here, not parked: a parked work keeps a
        dropped group's sockets and threads until 256 more are parked)."""
        self.said[k] = lane.post(True, [wire_bytes(lane, back(word, status, seq))], [BACK_TAGS + k])

    def done(self, lane: Lane, seq: int, k: int) -> None:
        """DONE for transfer ``seq``, whose bytes are all in. A sender whose send completed (once its bytes were in
        the segment) may since have dropped its group or exited; that fails nothing here, only logged: what was
        sent is received."""
        try:
            self.say(lane, Word.DONE, Status.OK, seq, k)
        except RuntimeError as error:
            logger.info(
                "same host: transfer %d from rank %d is in, its DONE not delivered (the sender's link "
                "closed: %s)",
                seq,
                lane.link.peer,
                str(error).splitlines()[0],
            )

    def _done_once_copied(self, lane: Lane, event: torch.cuda.Event, seq: int, k: int) -> None:
        """(On the link's thread, after the receive that queued the copies:) DONE once they ran."""
        event.synchronize()
        self.done(lane, seq, k)

    def finish(self, lane: Lane, stream: torch.cuda.Stream | None, seq: int, k: int) -> Steps[None]:
        """A sub-protocol: say DONE for transfer ``seq`` on back tag ``k`` once the copies on ``stream`` (None: the
        host's, done) have run, without holding up the caller of a device receiver (see the module docstring)."""
        if stream is None:
            self.done(lane, seq, k)
        elif lane.stream is None:  # host memory: the transfer ends with the bytes in
            yield [EventWork(record(stream))]
            self.done(lane, seq, k)
        else:
            self.driver.submit(
                functools.partial(self._done_once_copied, lane, record(stream), seq, k)
            )

    # -- offers ----------------------------------------------------------------------------------------
    def take_offer(self, lane: Lane, raw: bytes, allow: bool, header: Header) -> None:
        """Map the offered segments (host memory, or CUDA IPC onto the lane's GPU) if this end may and can; answer
        the sender either way. A storage offer (the storage route) is answered by the transfer's DONE instead."""
        if (offer_kind(raw) == STORAGE) != (header.transport == PayloadRoute.STORAGE):
            raise OutOfStepError(
                "the offer does not go with the header's route: the link is out of step"
            )
        if header.transport == PayloadRoute.STORAGE:
            self.storages[header.segment] = self._map_storage(raw, allow)
            return
        kind: Kind = DEVICE if cuda_ipc.is_device_offer(raw) else HOST
        ch, reason, lasting = self.channels[kind], None, True
        mappings: list[Any] = []  # host: shared_memory.Mapping, device: cuda_ipc.DeviceMapping
        if not allow:
            reason = f"this receiver's transport is \"wire\" (the call's `transport` or {ENV})"
        else:
            try:
                if kind == DEVICE:
                    mappings = cuda_ipc.map_offer(
                        raw[: cuda_ipc.OFFER.size_of(2)], MAX_SEGMENT_BYTES, lane.device
                    )
                else:
                    mappings = map_offer(raw[: HOST_OFFER.size_of(2)], MAX_SEGMENT_BYTES)
            except MappingError as error:
                reason, lasting = str(error), error.lasting
            except Exception as error:  # noqa: BLE001 - whatever stops the mapping (a CUDA error too): not now
                reason, lasting = f"{type(error).__name__}: {error}", False
        self.declined = reason
        status = Status.OK
        if reason is not None:
            status = Status.NO if lasting else Status.NO_NOW
            if lasting:
                ch.move(ChannelState.WIRE, [])  # (declined for now: what was mapped stays)
            chose(
                lane.link,
                "recv",
                WIRE,
                f"declined the {kind} offer{'' if lasting else ' for now'}: {reason}",
            )
        else:
            ch.move(ChannelState.SHARED, mappings)
            crossing = mappings[0].crossing if kind == DEVICE else None
            chose(
                lane.link,
                "recv",
                SHARED_MEMORY if kind == HOST else CUDA_IPC,
                f"took the {kind} offer" + (f"; {crossing}" if crossing else ""),
            )
            if kind == HOST:
                pays = direct_read_pays() if may_read_process(mappings[0].pid) is None else None
                self.direct = mappings[0].pid if pays is not None and pays.storages else None
                self.direct_leaves = pays is not None and pays.leaves
                status = (
                    Status.DIRECT
                    if self.direct_leaves
                    else Status.DIRECT_STORAGES
                    if self.direct is not None
                    else Status.OK
                )
        self.say(lane, Word.ANSWER, status, 0, BACK[kind])

    def _map_storage(self, raw: bytes, allow: bool) -> StorageMapping | None:
        if not allow:
            self.declined = (
                f"this receiver's transport is \"wire\" (the call's `transport` or {ENV})"
            )
            return None
        try:
            return StorageMapping(raw[:STORAGE_OFFER_SIZE], MAX_SEGMENT_BYTES)
        except Exception as error:  # noqa: BLE001 - whatever stops the mapping: the payload comes on the wire
            self.declined = (
                str(error)
                if isinstance(error, MappingError)
                else f"{type(error).__name__}: {error}"
            )
            return None

    # -- routes ----------------------------------------------------------------------------------------
    def receive(
        self,
        lane: Lane,
        header: Header,
        init_tag: int,
        copy: Copy,
        problem: str | None,
        carried: Carried,
        table: np.ndarray | None = None,
    ) -> Steps[bool]:
        """A sub-protocol: take the payload the header's route names (see the module docstring), copying with
        ``copy`` (nothing when ``problem``: a mismatched header), or read the sender's leaves into those of
        ``table`` (their addresses and sizes). Returns whether the payload was taken (False: a storage this
        receiver could not map, whose payload follows on the wire)."""
        if header.transport == PayloadRoute.STORAGE:
            return (yield from self._take_storage(lane, header, copy, problem, carried))
        if header.transport == PayloadRoute.DIRECT:
            return (
                yield from self._read_direct(lane, header, init_tag, table, copy, problem, carried)
            )
        kind: Kind = DEVICE if header.transport == PayloadRoute.DEVICE_SEGMENT else HOST
        ch = self.channels[kind]
        if ch.state is not ChannelState.SHARED or header.segment >= len(ch.mappings):
            raise OutOfStepError(
                f"the header names {kind} segment {header.segment}, which this receiver never "
                "mapped: the link is out of step"
            )
        mapping = ch.mappings[header.segment]
        if header.total > mapping.capacity:
            raise OutOfStepError(
                f"the header announces {header.total} bytes in a segment of {mapping.capacity}: "
                "the link is out of step"
            )
        bucket_bytes, total, key = header.bucket_bytes, header.total, f"{kind}:{header.segment}"
        # messages, and how many are copied out
        count, done = len(piece_sizes(total, bucket_bytes)), 0
        stage = SegmentStage(kind, header.segment, count, piece_tag(init_tag))
        carried.transport = CUDA_IPC if kind == DEVICE else SHARED_MEMORY
        # a host receiver of device memory copies on the device's stream too (and waits for it, below)
        stream = (
            lane.stream
            if lane.stream is not None or kind == HOST
            else dedicated_stream(mapping.device)
        )

        def on_stream() -> Any:
            return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

        def follow() -> None:
            """Copy out the messages the sender's progress word says are written, in order, without waiting for the
            READY (its check comes when it lands); back to the READY once the word stops moving."""
            nonlocal done
            while done < count:
                written = mapping.progress(header.seq)
                if written is None or written > total:
                    return  # no progress published (no native copies), or a word past the end, which no honest
                    #         writer publishes: the rest is copied once the READY says it is in

                end = min(
                    (done + 1) * bucket_bytes, total
                )  # (the receiver's own plan: never past its buffers)
                if written >= end:
                    with on_stream():
                        copy(
                            mapping.data,
                            key,
                            done,
                            done * bucket_bytes,
                            end - done * bucket_bytes,
                            bucket_bytes,
                        )
                    done += 1
                    stage.copied = done
                elif not mapping.follow(written, FOLLOW_WAIT):
                    return

        slot = torch.zeros(READY_SIZE + ROOM, dtype=torch.uint8)
        [ready] = lane.post(False, [slot], [piece_tag(init_tag)])
        yield [Stage(stage)]  # (a sender that dies now is named at its payload, the segment)
        if problem is None and kind == HOST:
            follow()
        yield [ready]
        read_ready(slot.numpy().tobytes(), header.seq, total)
        if problem is None:
            # (a device mapping: after the writer's event; from another GPU, device-to-device: cuda_ipc's docstring)
            with (
                mapping.reading(stream) if kind == DEVICE else contextlib.nullcontext(),
                on_stream(),
            ):
                for i in range(done, count):
                    offset = i * bucket_bytes
                    copy(
                        mapping.data,
                        key,
                        i,
                        offset,
                        min(bucket_bytes, total - offset),
                        bucket_bytes,
                    )
        yield from self.finish(lane, stream, header.seq, back_tag(kind, header.segment))
        return True

    # -- the host routes that skip the segments (:mod:`~cudarecv.samehost.routes`) ---------------------------
    def _read_direct(
        self,
        lane: Lane,
        header: Header,
        init_tag: int,
        table: np.ndarray | None,
        copy: Copy,
        problem: str | None,
        carried: Carried,
    ) -> Steps[bool]:
        """The direct route: take the sender's table of leaves, or of its one consolidated storage (checked
        against this tensordict's ``table``: the same sizes), and read them straight into the leaves or storage,
        then DONE (NO if the read fell short). Off the host (no ``table``) they are read into a reused host
        buffer, DONE said at once (the sender's memory is read), then copied out of it on the transfer's
        stream."""
        leaves = header.kind == KIND_BUCKETS
        what = "leaves" if leaves else "storage"
        pid = self.direct
        if (
            self.channels[HOST].state is not ChannelState.SHARED
            or pid is None
            or not (self.direct_leaves if leaves else header.kind == KIND_CHUNKS)
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
            self.say(lane, Word.DONE, Status.OK, header.seq, STORAGE_BACK)
            return True
        remote = raw[:size].view(np.uint64).reshape(-1, 2)
        staging = None
        if table is None:
            staging = yield from self._direct_staging(header.total)
            local = np.array([[staging.data_ptr(), header.total]], dtype=np.uint64)
            sizes = remote[:, 1].sum(keepdims=True)
        else:
            local, sizes = table, remote[:, 1]
        if not np.array_equal(sizes, local[:, 1]):
            raise OutOfStepError(
                f"the sender's table of its {what} names other sizes than this tensordict's "
                f"{what}: not read; the link is out of step"
            )
        carried.transport = SHARED_MEMORY
        status = Status.OK if read_process(pid, local, remote) == header.total else Status.NO
        self.say(lane, Word.DONE, status, header.seq, STORAGE_BACK)  # (the sender's memory is read)
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
                self.staging_fence = record(
                    lane.stream
                )  # the next direct read waits for these copies
        return True

    def _direct_staging(self, nbytes: int) -> Steps[Tensor]:
        """A sub-protocol: this side's host buffer for a direct read of ``nbytes``, once the copies out of its
        previous use have run (reused: one per link, grown when too small)."""
        if self.staging_fence is not None:
            yield [EventWork(self.staging_fence)]
            self.staging_fence = None
        if self.staging is None or self.staging.numel() < nbytes:
            self.staging = torch.empty(nbytes, dtype=torch.uint8)
        return self.staging[:nbytes]

    def _take_storage(
        self, lane: Lane, header: Header, copy: Copy, problem: str | None, carried: Carried
    ) -> Steps[bool]:
        """The storage route: one copy straight out of the sender's storage (checked against the mapping),
        then DONE; or NO if it could not be mapped."""
        if (
            self.channels[HOST].state is not ChannelState.SHARED
            or header.kind != KIND_CHUNKS
            or header.segment not in self.storages
        ):
            raise OutOfStepError(
                f"the header names storage slot {header.segment} of a {KIND_NAMES[header.kind]} "
                "transfer, which this receiver never mapped: the link is out of step"
            )
        mapping = self.storages[header.segment]
        if mapping is None:
            self.say(lane, Word.DONE, Status.NO, header.seq, STORAGE_BACK)
            return False
        if header.total > mapping.capacity:
            raise OutOfStepError(
                f"the header announces {header.total} bytes in a storage of {mapping.capacity}: "
                "the link is out of step"
            )
        carried.transport = SHARED_MEMORY
        if problem is None:
            copy(mapping.data, f"storage:{header.segment}", 0, 0, header.total, header.total)
        yield from self.finish(lane, lane.stream, header.seq, STORAGE_BACK)
        return True


class SegmentStage:
    """What a receive through a segment waits for (a :class:`~cudarecv.core.protocol.Stage`'s text, as it goes):
    the sender's messages in the segment, those copied out so far, and its READY."""

    def __init__(self, kind: Kind, segment: int, count: int, tag: int) -> None:
        self.kind, self.segment, self.count, self.tag = kind, segment, count, tag
        self.copied = 0  # messages copied out, in order, before the READY

    def __str__(self) -> str:
        return (
            f"receive of the fast-wire payload through {self.kind} segment {self.segment}: message "
            f"{min(self.copied + 1, self.count)} of {self.count} ({self.copied} copied), then the sender's "
            f"READY on tag {self.tag}"
        )
