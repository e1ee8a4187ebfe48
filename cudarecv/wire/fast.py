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

from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..core.errors import HeaderError, OutOfStepError
from ..core.protocol import Protocol, Stage
from ..core.tags import header_tag, piece_tag
from ..plan import describe
from ..plan.header import KIND_NAMES, SIZE, Header, PayloadKind, drain_limit, messages, piece_sizes
from ..plan.plan import Plan
from . import layouts
from .control import read_bytes, wire_bytes
from .staging import Lane, drain, recv_into, send_from

OFFER_SIZE = (
    512  # a same-host offer (:mod:`cudarecv.samehost.sides`), which may follow a header on its tag
)


def staging_place(lane: Lane, plan: Plan) -> str:
    """Where the buckets' staging buffer lives: on the wire's side of the link."""
    if lane.nccl:
        return str(plan.device) if plan.device.type == "cuda" else str(lane.cuda.device)
    return "pinned" if plan.device.type == "cuda" else "cpu"


def send(
    lane: Lane,
    header: Header,
    pieces: list[Tensor],
    init_tag: int,
    pack: Callable[[], None] | None = None,
    offer: bytes | None = None,
) -> Protocol:
    """Send ``header`` then ``pieces``, all posted in the first step.

    ``pack()`` (if given) writes the pieces; it runs once the header is
    posted, so the receiver checks the header and posts its receives meanwhile.
    ``offer`` (a same-host offer, :mod:`cudarecv.samehost.sides`) goes right after the header.
    """
    header, first = layouts.announce(
        lane.link, header, offer
    )  # the header, the offer, perhaps its layout
    head = yield from send_from(
        lane, [wire_bytes(lane, m) for m in first], [header_tag(init_tag)] * len(first), defer=True
    )
    if pack is not None:
        pack()
    yield from send_from(lane, pieces, [piece_tag(init_tag)] * len(pieces))
    if head:
        yield head
    return None


def _too_long(text: str) -> OutOfStepError:
    return OutOfStepError(f"{text} (not drained, the link is out of step)")


def recv(
    lane: Lane,
    expected: Header,
    pieces_for: Callable[[int], list[Tensor]],
    init_tag: int,
    result: object,
    landed: Callable[[int, int], None] | None = None,
    side: Any = None,
    allow: bool = False,
    copy_shared: Callable[..., None] | None = None,
    route: Any = None,
    table: Any = None,
) -> Protocol:
    """Receive a header, check it against ``expected``, then the payload.

    ``pieces_for(bucket_bytes)`` returns the receive buffers for the sender's
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
    if (
        header.init_tag != init_tag
    ):  # (on gloo the tags keep transfers apart; NCCL matches in posting order)
        raise OutOfStepError(
            f"this receive (init_tag {init_tag}) took the fast-wire header of the sender's transfer with init_tag "
            f"{header.init_tag}: NCCL ignores tags and matches messages in posting order, so fast-wire receives "
            "must be posted in the order of the sender's sends (not drained, the link is out of step)"
        )
    tag = piece_tag(init_tag)
    if header.offer:
        if side is None:
            raise OutOfStepError(
                "the sender offers shared memory on a link that cannot take it: out of step"
            )
        offer = yield from read_bytes(
            lane, OFFER_SIZE, header_tag(init_tag), "same-host offer", _too_long
        )
        side.take_offer(lane, offer, allow, header)
    if header.described:
        yield from layouts.take(lane, header, init_tag, _too_long)
    problem = _mismatch(expected, header, layouts.passed(lane.link, header.schema))
    payload = PayloadStage(header, tag)
    yield [Stage(payload)]  # from here a failure is the payload's, not the header's
    if header.transport:
        if side is None:
            raise OutOfStepError(
                "the payload comes through shared memory on a link that has none: out of step"
            )
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
        yield [
            Stage(
                f"drain of a mismatched fast-wire payload ({header.total} bytes on tag {tag}; {problem})"
            )
        ]
        yield from drain(lane, piece_sizes(header.total, header.bucket_bytes), tag)
        raise _rejected(problem)
    pieces = pieces_for(header.bucket_bytes)

    def on_piece(i: int) -> None:
        payload.landed = i + 1
        if landed is not None:
            landed(header.bucket_bytes, i)

    # (on gloo the host sees each message land: it counts them, so a failure names the one it waited for)
    payload.counted = not lane.nccl and (landed is not None or lane.stream is None)
    yield from recv_into(
        lane,
        pieces,
        [tag] * len(pieces),
        landed=on_piece if payload.counted or landed is not None else None,
    )
    return result


class PayloadStage:
    """What a fast-wire receive waits for once its header is in (a :class:`~cudarecv.core.protocol.Stage`'s
    text, as it goes): the payload, and on gloo which message of it (those before it are in). A same-host
    route says its own stage on top of this one."""

    def __init__(self, header: Header, tag: int) -> None:
        self.kind = "bucket" if header.kind == PayloadKind.BUCKETS else "chunk"
        self.count, self.bucket_bytes, self.tag = (
            messages(header.total, header.bucket_bytes),
            header.bucket_bytes,
            tag,
        )
        self.counted = False  # whether the messages in are counted (the host sees each land: gloo)
        self.landed = 0  # messages in, in order

    def __str__(self) -> str:
        if not self.counted or self.count == 0:
            return f"receive of the fast-wire payload ({self.count} {self.kind}s of {self.bucket_bytes} bytes on tag {self.tag})"
        return (
            f"receive of the fast-wire payload, {self.kind} {min(self.landed + 1, self.count)} of {self.count} "
            f"({self.landed} in; {self.bucket_bytes} bytes each on tag {self.tag})"
        )


def _rejected(problem: str) -> HeaderError:
    return HeaderError(
        f"{problem}: the payload was drained and the tensordict left untouched; "
        "receive into a tensordict with the sender's keys, shapes and dtypes "
        "(and, consolidated, the same layout)"
    )


def _mismatch(expected: Header, got: Header, theirs: bytes | None) -> str | None:
    """What differs between the sender's header ``got`` and this receive's ``expected`` (None: nothing): the first
    key that differs and how on both sides, from the sender's layout ``theirs`` (:mod:`.layouts`), then both
    headers in short."""

    def summary(h: Header) -> str:
        return (
            f"{KIND_NAMES[h.kind]} of {h.leaves} leaves, {h.total} bytes, schema {h.schema.hex()}"
        )

    if (expected.kind, expected.leaves, expected.total, expected.schema) == (
        got.kind,
        got.leaves,
        got.total,
        got.schema,
    ):
        return None
    both = f"the sender sends {summary(got)}; this tensordict expects {summary(expected)}"
    if expected.kind != got.kind:
        return f"fast-wire mismatch: {both}"
    sender = None if theirs is None else describe.parse(theirs)
    ours = None if expected.describe is None else describe.parse(expected.describe())
    detail = None if sender is None or ours is None else describe.difference(sender, ours)
    if (
        detail is None
    ):  # (not told: it was described to a receive that did not keep it, or an older schema)
        return (
            f"fast-wire mismatch ({both}); the sender's keys are not known here (it describes a layout once per "
            "link, and this process did not keep it), compare the tensordicts' keys, shapes and dtypes"
        )
    return f"fast-wire mismatch at {detail} ({both})"
