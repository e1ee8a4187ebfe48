"""Small control messages (headers, handshakes, answers) on a link.

:func:`wire_bytes` turns bytes into a tensor the wire can send; :func:`read_bytes`
receives one message back as bytes. On gloo the receive buffer has room to spare
(:data:`ROOM`): gloo kills the process (``SIGABRT``) when a message is longer than
the buffer posted for it, so a peer speaking another protocol or version that sends
a somewhat longer message on the same tag gets an exception instead. NCCL carries
no message lengths: there both ends use the exact size.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch
from torch import Tensor

from ..core import streams
from ..core.protocol import Work
from .staging import Lane, recv_into

ROOM = 4096  # bytes past the expected size that a control receive still takes (gloo)


def wire_bytes(lane: Lane, data: bytes) -> Tensor:
    """``data`` as a tensor the wire can send: host memory for gloo; for NCCL a device
    copy made on the transfer stream (from page-locked memory, so the host does not wait).

    The device tensor is allocated on the transfer stream, the stream that writes it and that NCCL's stream
    waits for before its send reads it: once the caller drops it (right after posting), the caching allocator
    hands its block out again only to work queued on the transfer stream after it (and ``Work.wait()`` orders
    the transfer stream after the send; until then torch's NCCL group keeps the posted tensor). Allocated on
    the caller's current stream instead, its block went back to that stream at once: a tensor the caller
    allocated next could take it while the copy and the send were still queued, and have the header written
    over it (or the send read the caller's bytes).
    """
    host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if not lane.nccl:
        return host
    with lane.on_stream():
        device = torch.empty(len(data), dtype=torch.uint8, device=lane.cuda.device)
        device.copy_(host.pin_memory(), non_blocking=True)
    return device


def read_bytes(
    lane: Lane, size: int, tag: int, what: str, error: Callable[[str], Exception]
) -> Generator[Sequence[Work], None, bytes]:
    """Receive one message of ``size`` bytes with ``tag`` and return its bytes (a sub-protocol).

    A shorter message comes back zero-filled (its parser rejects it); on gloo a
    longer one (up to ``ROOM`` bytes more) raises ``error(text)`` naming ``what``.
    On NCCL the message lands in device memory and comes back to the host through
    page-locked memory on the transfer stream; the host waits for it in a later
    step, never in the call that posts the receive.
    """
    if not lane.nccl:
        raw = torch.zeros(size + ROOM, dtype=torch.uint8)
        yield from recv_into(lane, [raw], [tag])
        data = raw.numpy()
        if data[size:].any():
            raise error(
                f"the {what} message is longer than its {size} bytes: the peer speaks another "
                "protocol or version on this tag"
            )
        return data[:size].tobytes()
    with lane.on_stream():  # (allocated on the stream whose work writes it, as in wire_bytes)
        raw = torch.empty(size, dtype=torch.uint8, device=lane.cuda.device)
    host = lane.pool.buffers("pinned", size, count=1)[0]
    yield from recv_into(lane, [raw], [tag])
    with lane.on_stream():
        host.copy_(raw, non_blocking=True)
        arrived = streams.record(lane.cuda)
    yield [streams.EventWork(arrived)]
    return host.numpy().tobytes()
