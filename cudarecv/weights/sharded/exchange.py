"""The layout exchange of a sharded weight sync, ahead of each pair's handshake: every sender rank sends its
:class:`~cudarecv.weights.sharded.layout.Layout` to every receiver, and each receiver answers every sender with
the layout it wants (or why it refuses), once it has read them all. Each message is a length record, then the
JSON, on :data:`~cudarecv.core.tags.TAG_LAYOUT`.

Both ends go through their peers in rank order (senders the receivers, receivers the senders), so nobody waits
for a peer that waits for someone later: no deadlock, whatever the numbers of senders and receivers.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

from ...core.errors import ArgumentError, Error, ReceiverFailed, SchemaError
from ...core.link import Link, resolve
from ...core.records import Record
from ...core.tags import TAG_LAYOUT
from ...wire.control import read_bytes
from ...wire.staging import Lane
from ..link import check_peers, run, send_bytes
from ..schema import MAX_SCHEMA_BYTES
from .layout import Layout

LENGTH = Record(
    "sharded layout length",
    b"CDRL",
    "Q",
    hint="is the peer a sharded WeightSender or WeightReceiver "
    "(`src` a list) of this cudarecv version?",
)
WHAT = "sharded weight-sync layout exchange"


def peer_links(
    value: object, group_value: object, group: object, name: str, group_name: str
) -> tuple[list[int], list[Link], bool]:
    """The peers given as ``name`` (global ranks) or ``group_name`` (ranks in ``group``), exactly one, and their
    links, both in rank order (the order every exchange goes in); and whether they were global ranks."""
    peers, group_peers = check_peers(value, name), check_peers(group_value, group_name)
    if (peers is None) == (group_peers is None):
        raise ArgumentError(
            f"pass exactly one of `{name}` and `{group_name}` (a rank or a list of ranks)"
        )
    if peers is not None:
        ranks, links = peers, [resolve(p, None, group, name, group_name) for p in peers]
    else:
        assert group_peers is not None  # (exactly one of the two: checked above)
        ranks, links = group_peers, [resolve(None, p, group, name, group_name) for p in group_peers]
    order = sorted(range(len(links)), key=lambda i: links[i].peer)
    return [ranks[i] for i in order], [links[i] for i in order], peers is not None


def _send(lane: Lane, raw: bytes, timeout: float, silent: str) -> None:
    run(send_bytes(lane, LENGTH.pack(len(raw)), TAG_LAYOUT), lane, timeout, WHAT, silent)
    run(send_bytes(lane, raw, TAG_LAYOUT), lane, timeout, WHAT, silent)


def _read(lane: Lane, timeout: float, silent: str) -> bytes:
    (length,) = LENGTH.unpack(
        run(
            read_bytes(lane, LENGTH.size, TAG_LAYOUT, "layout length", SchemaError),
            lane,
            timeout,
            WHAT,
            silent,
        )
    )
    if not 0 < length <= MAX_SCHEMA_BYTES:
        raise SchemaError(
            f"rank {lane.link.peer} announces a layout of {length} bytes: out of range"
        )
    return run(
        read_bytes(lane, length, TAG_LAYOUT, "layout", SchemaError), lane, timeout, WHAT, silent
    )


def offer(lanes: list[Lane], layout: Layout, timeout: float) -> list[Layout]:
    """A sender rank's end: send ``layout`` to every receiver, then read what each wants. Raises
    :class:`SchemaError` or :class:`ReceiverFailed` naming a receiver that refused or failed."""
    raw = layout.to_json()
    for lane in lanes:
        _send(
            lane,
            raw,
            timeout,
            "took no layout (is it a WeightReceiver with `src` a list of this mesh's ranks?)",
        )
    wanted = []
    for lane in lanes:
        answer = _read(lane, timeout, "sent no layout")
        refusal = _refusal(answer)
        if refusal is not None:
            kind, reason = refusal
            error = SchemaError if kind == "refused" else ReceiverFailed
            raise error(
                f"receiver rank {lane.link.peer} {'rejected the weights' if kind == 'refused' else 'could not start'}: "
                f"{reason}"
            )
        wanted.append(Layout.from_json(answer))
    return wanted


def _refusal(raw: bytes) -> tuple[str, str] | None:
    """``(kind, reason)`` of a receiver's refusal (``"refused"`` or ``"failed"``), None for a layout."""
    try:
        doc = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return None  # (the layout's own parse says what is wrong)
    if (
        isinstance(doc, dict)
        and set(doc) == {"kind", "refused"}
        and doc["kind"] in ("refused", "failed")
    ):
        return doc["kind"], str(doc["refused"])[:2000]
    return None


def answer(
    lanes: list[Lane], timeout: float, want: Callable[[list[Layout]], Layout]
) -> tuple[list[Layout], Layout]:
    """A receiver's end: read every sender's layout, decide what it wants (``want`` may raise: a
    :class:`SchemaError` is sent back as a refusal, anything else as a failure) and answer every sender."""
    layouts = [
        Layout.from_json(_read(lane, timeout, "sent no layout (is it a sharded WeightSender?)"))
        for lane in lanes
    ]
    try:
        wanted = want(layouts)
    except Exception as error:
        kind = "refused" if isinstance(error, SchemaError) else "failed"
        text = str(error) if kind == "refused" else f"{type(error).__name__}: {error}"
        refusal = json.dumps({"kind": kind, "refused": text}).encode()
        for lane in lanes:
            with contextlib.suppress(
                Error
            ):  # a sender gone: the reason is this side's error, raised below
                _send(lane, refusal, timeout, "took no answer")
        raise
    raw = wanted.to_json()
    for lane in lanes:
        _send(lane, raw, timeout, "took no answer")
    return layouts, wanted
