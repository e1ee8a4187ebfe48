"""Host shared memory: the sender's snapshots in anonymous segments (:mod:`cudarecv.samehost.shared_memory`) that
receivers on its machine map read-only; a push sends the header alone, naming the segment, and the receiver
copies the version out (or, zero copy, publishes it where it lies), checking the segment's two stamps (writing v,
written v) so that a copy a newer write overtook is never published."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...core import streams
from ...core.errors import TransferTimeout
from ...core.protocol import Protocol
from ...core.transfer import SHARED_MEMORY
from ...samehost import shared_memory as host
from ...wire.staging import Lane
from .base import HeaderOnly, Need

if TYPE_CHECKING:
    from ..slots import Slot


class SharedMemory(HeaderOnly):
    """Host weights, receivers on the sender's machine."""

    name = SHARED_MEMORY
    priority = 10
    #: the version zero-copy receivers publish, the one a reader may still hold, and the next one
    sync_snapshots = 3
    zero_copy = True
    stamped = True
    host_memory = True

    def usable(self, need: Need) -> bool:
        # offered on gloo links only: a group's receivers on NCCL take the wire
        return (
            need.device.type == "cpu"
            and host.available() is None
            and (need.elastic or "gloo" in need.backends)
        )

    def offered_on(self, backend: str) -> bool:
        return backend == "gloo"

    def takes(self, offer: bytes) -> bool:
        # every offer no other transport takes: its parser says what is wrong with it (the answer's route)
        return True

    def segments(self, total: int, device: torch.device, count: int) -> list[Any]:
        return [host.Segment(total) for _ in range(count)]

    def offer(self, segments: list[Any]) -> bytes:
        return host.offer(segments)

    def warm(self, segments: list[Any], zero_copy: bool) -> None:
        # the first push would pay for allocating its snapshot's pages (about 0.7 s per GB): here, once; and for
        # the second snapshot, which zero-copy pushes take turns with
        for segment in segments[: 2 if zero_copy else 1]:
            segment.populate()

    def before_write(self, segment: Any, version: int) -> None:
        segment.begin_write(
            version
        )  # a receiver dropped while it copies sees its version overwritten

    def after_write(self, segment: Any, version: int, stream: Any) -> None:
        segment.end_write(version)

    def map(self, offer: bytes, total: int, device: torch.device | None) -> list[Any]:
        return host.map_offer(offer, total)

    def land(
        self, mapping: Any, slot: Slot, total: int, version: int, lane: Lane, held: int
    ) -> Protocol:
        written = mapping.written()
        data = mapping.data[:total]
        if (
            lane.stream is None
        ):  # one thread's memcpy (placed: one per message): actors share the trainer's cores
            slot.fill(data)
        else:
            with lane.on_stream():
                slot.fill(data)
            yield [streams.EventWork(streams.record(lane.stream))]  # over before the stamp is read
        if not written == mapping.writing() == version:
            raise TransferTimeout(
                f"version {version} was overwritten in the sender's shared snapshot before this receiver "
                f"had copied it (the sender stopped waiting for this receiver: it was too slow); version "
                f"{held} stays published"
            )
        return slot

    def lies_whole(self, mapping: Any, version: int) -> bool:
        return bool(mapping.written() == mapping.writing() == version)
