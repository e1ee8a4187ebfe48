"""The native fast wire (``bucket_bytes=N`` on both ends; stock peers cannot read it).

One transfer is a 64-byte header (:mod:`._header`) then the payload in
messages of at most N bytes:

- *buckets*: a non-consolidated tensordict's leaves back to back in stock order,
  packed into a reused staging buffer (large leaves span several messages);
- *chunks*: a consolidated storage, sent and received in place.

The receiver takes the header first and checks it against its own tensordict.
On a mismatch it receives the payload into a scratch buffer (so the link stays
in step), leaves its tensordict untouched and raises :class:`HeaderError`.
The payload size follows the sender's ``bucket_bytes``; the receiver's only
selects the fast wire.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from . import _cuda
from ._handle import Protocol
from ._header import KIND_NAMES, SIZE, Header, HeaderError
from ._plan import Plan
from ._staging import Lane, drain, recv_into, send_from

TAG_BASE = 1 << 30  # fast-wire tags live above every stock tag
MAX_INIT_TAG = 1 << 29


def check_init_tag(init_tag: int, pseudo_rand: bool) -> None:
    """Fast-wire tags are ``TAG_BASE + tag_sequence(init_tag, ...)`` and must fit an int32."""
    if not pseudo_rand and not 0 <= init_tag < MAX_INIT_TAG:
        raise ValueError(
            f"`init_tag={init_tag}` is out of range for the fast wire (bucket_bytes): "
            f"pass 0 <= init_tag < {MAX_INIT_TAG}"
        )


def _tags(plan: Plan, init_tag: int, pseudo_rand: bool, pieces: int) -> list[int]:
    return [TAG_BASE + t for t in plan.tags(init_tag, 1 + pieces, pseudo_rand)]


def staging_place(lane: Lane, plan: Plan) -> str:
    """Where the buckets' staging buffer lives: on the wire's side of the link."""
    if lane.nccl:
        return str(plan.device) if plan.device.type == "cuda" else str(lane.stream.device)
    return "pinned" if plan.device.type == "cuda" else "cpu"


def wire_bytes(lane: Lane, data: bytes) -> Tensor:
    """``data`` as a tensor the wire can send: host memory for gloo; for NCCL a device
    copy made on the transfer stream (from page-locked memory, so the host does not wait)."""
    host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if not lane.nccl:
        return host
    device = torch.empty(len(data), dtype=torch.uint8, device=lane.stream.device)
    with lane.on_stream():
        device.copy_(host.pin_memory(), non_blocking=True)
    return device


def send(lane: Lane, plan: Plan, header: Header, pieces: list[Tensor], init_tag: int,
         pseudo_rand: bool, pack: Callable[[], None] | None = None) -> Protocol:
    """Send ``header`` then ``pieces``, all posted in the first step.

    ``pack()`` (if given) writes the pieces; it runs once the header is
    posted, so the receiver checks the header and posts its receives meanwhile.
    """
    tags = _tags(plan, init_tag, pseudo_rand, len(pieces))
    head = yield from send_from(lane, [wire_bytes(lane, header.pack())], tags[:1], defer=True)
    if pack is not None:
        pack()
    yield from send_from(lane, pieces, tags[1:])
    if head:
        yield head
    return None


def read_bytes(lane: Lane, size: int, tag: int) -> Any:
    """Receive one ``size``-byte message and return its bytes (a sub-protocol).

    On NCCL the message lands in device memory and comes back to the host
    through page-locked memory on the transfer stream; the host waits for it in
    a later step, never in the call that posts the receive.
    """
    if not lane.nccl:
        raw = torch.empty(size, dtype=torch.uint8)
        yield from recv_into(lane, [raw], [tag])
        return raw.numpy().tobytes()
    raw = torch.empty(size, dtype=torch.uint8, device=lane.stream.device)
    host = lane.pool.buffers("pinned", size, count=1)[0]
    yield from recv_into(lane, [raw], [tag])
    with lane.on_stream():
        host.copy_(raw, non_blocking=True)
        arrived = _cuda.record(lane.stream)
    yield [_cuda.EventWork(arrived)]
    return host.numpy().tobytes()


def recv(lane: Lane, plan: Plan, expected: Header, pieces_for: Callable[[int], list[Tensor]],
         init_tag: int, pseudo_rand: bool, result: object,
         landed: Callable[[int, int], None] | None = None) -> Protocol:
    """Receive a header, check it against ``expected``, then the payload.

    ``pieces_for(piece_bytes)`` returns the receive buffers for the sender's
    message size; ``landed(piece_bytes, i)`` (if given) runs as soon as piece i
    is in, while the next pieces are still on the wire.
    """
    header = Header.unpack((yield from read_bytes(lane, SIZE, _tags(plan, init_tag, pseudo_rand, 0)[0])))
    tags = _tags(plan, init_tag, pseudo_rand, len(header.pieces()))
    problem = _mismatch(expected, header)
    if problem:
        yield from drain(lane, header.pieces(), tags[1:])
        raise HeaderError(
            f"{problem}: the payload was drained and the tensordict left untouched; "
            "receive into a tensordict with the sender's keys, shapes and dtypes "
            "(and, consolidated, the same layout)"
        )
    on_piece = None if landed is None else (lambda i: landed(header.piece, i))
    yield from recv_into(lane, pieces_for(header.piece), tags[1:], landed=on_piece)
    return result


def _mismatch(expected: Header, got: Header) -> str | None:
    def describe(h: Header) -> str:
        return f"{KIND_NAMES[h.kind]} of {h.leaves} leaves, {h.total} bytes, schema {h.schema.hex()}"

    if (expected.kind, expected.leaves, expected.total, expected.schema) != (
        got.kind, got.leaves, got.total, got.schema
    ):
        return f"fast-wire mismatch: the sender sends {describe(got)}; this tensordict expects {describe(expected)}"
    return None

