"""The native fast wire (``bucket_bytes=N`` on both ends; stock peers cannot read it).

One transfer is a 64-byte header (:mod:`cudarecv.plan.header`) then the payload in
messages of at most N bytes:

- *buckets*: a non-consolidated tensordict's leaves back to back in stock order,
  packed into a reused staging buffer (large leaves span several messages);
- *chunks*: a consolidated storage, sent and received in place.

The receiver takes the header first and checks it against its own tensordict.
On a mismatch it receives the payload into a scratch buffer (so the link stays
in step), leaves its tensordict untouched and raises :class:`HeaderError`.
The payload size follows the sender's ``bucket_bytes``; the receiver's only
selects the fast wire.

Tags: the header on ``HEADER_TAGS + init_tag``, every payload message on
``PIECE_TAGS + init_tag`` (messages with one tag are matched in order). Headers
and payloads can never take each other's tag, whatever ``init_tag`` and
``bucket_bytes``; transfers with different ``init_tag`` share no tag at all, so
on gloo they may be in flight on one link at once and be waited in any order.
NCCL ignores tags and matches messages in posting order: there a receiver must
post its fast-wire receives in the order of the sender's sends; the header
carries the ``init_tag``, and a receive that took another transfer's header
raises :class:`~cudarecv.core.errors.OutOfStepError` saying so.
``pseudo_rand`` does not change fast-wire tags.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor

from ..core.errors import HeaderError, OutOfStepError
from ..core.protocol import Protocol, Stage
from ..core.tags import header_tag, piece_tag
from ..plan.header import KIND_NAMES, SIZE, Header, drain_limit, piece_sizes
from ..plan.plan import Plan
from .control import read_bytes, wire_bytes
from .staging import Lane, drain, recv_into, send_from

OFFER_SIZE = 512  # a same-host offer (:mod:`cudarecv.samehost.sides`), which may follow a header on its tag


def staging_place(lane: Lane, plan: Plan) -> str:
    """Where the buckets' staging buffer lives: on the wire's side of the link."""
    if lane.nccl:
        return str(plan.device) if plan.device.type == "cuda" else str(lane.stream.device)
    return "pinned" if plan.device.type == "cuda" else "cpu"


def send(lane: Lane, header: Header, pieces: list[Tensor], init_tag: int,
         pack: Callable[[], None] | None = None, offer: bytes | None = None) -> Protocol:
    """Send ``header`` then ``pieces``, all posted in the first step.

    ``pack()`` (if given) writes the pieces; it runs once the header is
    posted, so the receiver checks the header and posts its receives meanwhile.
    ``offer`` (a same-host offer, :mod:`cudarecv.samehost.sides`) goes right after the header.
    """
    messages = [header.pack()] + ([offer] if offer is not None else [])
    head = yield from send_from(lane, [wire_bytes(lane, m) for m in messages], [header_tag(init_tag)] * len(messages),
                                defer=True)
    if pack is not None:
        pack()
    yield from send_from(lane, pieces, [piece_tag(init_tag)] * len(pieces))
    if head:
        yield head
    return None


def _too_long(text: str) -> OutOfStepError:
    return OutOfStepError(f"{text} (not drained, the link is out of step)")


def recv(lane: Lane, expected: Header, pieces_for: Callable[[int], list[Tensor]], init_tag: int,
         result: object, landed: Callable[[int, int], None] | None = None, side: Any = None,
         allow: bool = False, copy_shared: Callable[..., None] | None = None, route: Any = None,
         table: Any = None) -> Protocol:
    """Receive a header, check it against ``expected``, then the payload.

    ``pieces_for(piece_bytes)`` returns the receive buffers for the sender's
    message size; ``landed(piece_bytes, i)`` (if given) runs as soon as piece i
    is in, while the next pieces are still on the wire. A mismatched payload is
    drained (the link stays in step) if it is at most :func:`drain_limit` bytes.

    Same-host transport (:mod:`cudarecv.samehost.sides`): ``side`` is the link's receiving
    side, which takes an offer that follows a header (accepting it if ``allow``)
    and a payload that comes through a shared segment (``copy_shared`` copies it
    out, or the leaves of ``table`` are read straight from the sender); ``route.transport`` then says so.
    """
    raw = yield from read_bytes(lane, SIZE, header_tag(init_tag), "fast-wire header", _too_long)
    header = Header.unpack(raw)
    if header.init_tag != init_tag:  # (on gloo the tags keep transfers apart; NCCL matches in posting order)
        raise OutOfStepError(
            f"this receive (init_tag {init_tag}) took the fast-wire header of the sender's transfer with init_tag "
            f"{header.init_tag}: NCCL ignores tags and matches messages in posting order, so fast-wire receives "
            "must be posted in the order of the sender's sends (not drained, the link is out of step)")
    tag = piece_tag(init_tag)
    problem = _mismatch(expected, header)
    if header.offer:
        if side is None:
            raise OutOfStepError("the sender offers shared memory on a link that cannot take it: out of step")
        offer = yield from read_bytes(lane, OFFER_SIZE, header_tag(init_tag), "same-host offer", _too_long)
        side.take_offer(lane, offer, allow, header)
    if header.transport:
        if side is None:
            raise OutOfStepError("the payload comes through shared memory on a link that has none: out of step")
        took = yield from side.receive(lane, header, init_tag, copy_shared, problem, route, table)
        if took:
            if problem:
                raise _rejected(problem)
            return result
    if problem:
        limit = drain_limit(expected.total)
        if header.total > limit:
            raise OutOfStepError(
                f"{problem}; its {header.total} bytes are more than this receiver drains ({limit}): "
                "not drained, the link is out of step; the tensordict was left untouched"
            )
        yield [Stage(f"drain of a mismatched fast-wire payload ({header.total} bytes on tag {tag}; {problem})")]
        yield from drain(lane, piece_sizes(header.total, header.piece), tag)
        raise _rejected(problem)
    pieces = pieces_for(header.piece)
    on_piece = None if landed is None else (lambda i: landed(header.piece, i))
    yield from recv_into(lane, pieces, [tag] * len(pieces), landed=on_piece)
    return result


def _rejected(problem: str) -> HeaderError:
    return HeaderError(f"{problem}: the payload was drained and the tensordict left untouched; "
                       "receive into a tensordict with the sender's keys, shapes and dtypes "
                       "(and, consolidated, the same layout)")


def _mismatch(expected: Header, got: Header) -> str | None:
    def describe(h: Header) -> str:
        return f"{KIND_NAMES[h.kind]} of {h.leaves} leaves, {h.total} bytes, schema {h.schema.hex()}"

    if (expected.kind, expected.leaves, expected.total, expected.schema) != (
        got.kind, got.leaves, got.total, got.schema
    ):
        return f"fast-wire mismatch: the sender sends {describe(got)}; this tensordict expects {describe(expected)}"
    return None
