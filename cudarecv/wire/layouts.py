"""The sender's layout on the fast wire: sent once per link and schema, kept by the receiver for its mismatches.

A header names its schema by a 16-byte fingerprint only. So that a receiver whose tensordict does not match can
say which key differs and how, on both sides (:mod:`cudarecv.plan.describe`), the sender sends its layout's
description the first time a link (group, peer) carries a schema: the header's bit says so, and two messages follow
the header (and the offer, if any) on the header's tag, its length (8 bytes) and itself. The receiver reads them
whatever its own tensordict (the link stays in step) and keeps the last :data:`KEEP` descriptions per link. Both
ends remember schemas in the order their headers pass, so they forget alike; a schema the receiver no longer knows
is said by fingerprint (honestly: "not known here"). Steady state costs nothing: a schema already described goes
with its header alone.
"""

from __future__ import annotations

import dataclasses
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from typing import Any

from ..core.link import Link
from ..core.protocol import Work
from ..core.tags import header_tag
from ..plan.describe import MAX_DESCRIPTION
from ..plan.header import Header
from .control import read_bytes
from .staging import Lane

KEEP = 16  # schemas remembered per link at each end
_LENGTH = struct.Struct("<Q")

# per group (weakly) and peer: the schemas this process described as a sender, and those it learned as a receiver
_SENT: weakref.WeakKeyDictionary[Any, dict[int, OrderedDict[bytes, None]]] = (
    weakref.WeakKeyDictionary()
)
_KNOWN: weakref.WeakKeyDictionary[Any, dict[int, OrderedDict[bytes, bytes]]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def _of(registry: weakref.WeakKeyDictionary, link: Link) -> OrderedDict:
    """``registry``'s schemas of ``link`` (under :data:`_LOCK`)."""
    return registry.setdefault(link.pg, {}).setdefault(link.peer, OrderedDict())


def _seen(schemas: OrderedDict, schema: bytes, value: Any) -> None:
    """``schema`` passed now: the newest, the oldest forgotten past :data:`KEEP` (under :data:`_LOCK`)."""
    schemas[schema] = value
    schemas.move_to_end(schema)
    while len(schemas) > KEEP:
        schemas.popitem(last=False)


def announce(link: Link, header: Header, offer: bytes | None = None) -> tuple[Header, list[bytes]]:
    """The header to send and the messages that go on its tag, in order: the header, ``offer`` (a same-host offer,
    if any), and the first time this link carries the header's schema its layout (its length, then itself)."""
    tail: list[bytes] = []
    with _LOCK:
        sent = _of(_SENT, link)
        first = header.schema not in sent
        _seen(sent, header.schema, None)
    if first and header.describe is not None:
        raw = header.describe()
        if (
            len(raw) <= MAX_DESCRIPTION
        ):  # (a larger one is not sent: a mismatch is then said by fingerprint)
            header = dataclasses.replace(header, described=True)
            tail = [_LENGTH.pack(len(raw)), raw]
    return header, [header.pack(), *([] if offer is None else [offer]), *tail]


def take(
    lane: Lane, header: Header, init_tag: int, error: Callable[[str], Exception]
) -> Generator[Sequence[Work], None, None]:
    """A sub-protocol: the sender's layout after ``header`` (it said one follows), read and kept for the link;
    ``error(text)`` is raised for a length past :data:`~cudarecv.plan.describe.MAX_DESCRIPTION` (not read: the
    link is out of step)."""
    tag = header_tag(init_tag)
    raw = yield from read_bytes(lane, _LENGTH.size, tag, "layout length", error)
    (size,) = _LENGTH.unpack(raw)
    if not 0 < size <= MAX_DESCRIPTION:
        raise error(f"the sender announces a layout of {size} bytes, not 1 to {MAX_DESCRIPTION}")
    described = yield from read_bytes(lane, size, tag, "sender's layout", error)
    with _LOCK:
        _seen(_of(_KNOWN, lane.link), header.schema, described)


def passed(link: Link, schema: bytes) -> bytes | None:
    """A header of ``schema`` was received on ``link``: the sender's layout of it if this process was told
    (it is the newest now), else None."""
    with _LOCK:
        known = _of(_KNOWN, link)
        described = known.get(schema)
        if described is not None:
            known.move_to_end(schema)
        return described
