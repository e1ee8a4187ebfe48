"""CUDA IPC: the sender's GPU snapshots exported once (:mod:`cudarecv.samehost.cuda_ipc`), opened once by
receivers on its node; a push sends the header alone, and the receiver's stream waits for the sender's write
(an interprocess event) before it copies the version out. A snapshot a dropped receiver may still copy from is
never written again (no stamps on GPU memory): the sender replaces it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...core.protocol import Protocol
from ...core.transfer import CUDA_IPC
from ...samehost import cuda_ipc
from ...wire.staging import Lane
from .base import HeaderOnly, Need

if TYPE_CHECKING:
    from ..slots import Slot


class CudaIpc(HeaderOnly):
    """GPU weights, receivers on the sender's node (on any link: the offer is read on the host)."""

    name = CUDA_IPC
    priority = 20

    def usable(self, need: Need) -> bool:
        return need.device.type == "cuda" and cuda_ipc.available(need.device) is None

    def takes(self, offer: bytes) -> bool:
        return cuda_ipc.is_device_offer(offer)

    def segments(self, total: int, device: torch.device, count: int) -> list[Any]:
        return [cuda_ipc.DeviceSegment(total, device) for _ in range(count)]

    def offer(self, segments: list[Any]) -> bytes:
        return cuda_ipc.offer(segments)

    def after_write(self, segment: Any, version: int, stream: Any) -> None:
        segment.written.record(stream)  # receivers' copies wait for it

    def map(self, offer: bytes, total: int, device: torch.device | None) -> list[Any]:
        assert device is not None  # (a receiver always says where its weights live)
        return cuda_ipc.map_offer(offer, total, device)

    def land(
        self, mapping: Any, slot: Slot, total: int, version: int, lane: Lane, held: int
    ) -> Protocol:
        # (after the writer's event; from another GPU of the node, device-to-device: samehost.cuda_ipc)
        with mapping.reading(lane.stream), lane.on_stream():
            slot.fill(mapping.data[:total])
        return slot
        yield  # (a generator)
