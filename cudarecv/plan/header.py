"""The fast wire's header: a fixed 64-byte binary record, never pickle.

Layout (little-endian)::

    magic     4s   b"CDRV"
    version   u16  2
    kind      u16  1 = buckets (non-consolidated), 2 = chunks (consolidated storage)
    leaves    u32  number of leaves
    route     u32  where the payload is: byte 0 the transport (0 the wire, 1 a shared
                   segment, 2 the sender's storage in shared memory, 3 the sender's leaves,
                   read directly: :mod:`cudarecv.samehost.sides`),
                   byte 1 the segment or storage slot, bit 16 an offer follows
    total     u64  payload bytes
    piece     u64  bytes per payload message (the sender's bucket_bytes)
    schema    16s  blake2b-128 of the schema (keys, dtypes, shapes, byte counts, offsets)
    seq       u64  the sender's transfer number on this link (shared segments)
    crc       u32  crc32 of the 56 bytes above
    padding   4x

Nothing read from the wire is ever unpickled: the receiver compares the record
with the one it computes for its own tensordict. Nothing is sized from a record
before it is checked: a piece count above :data:`MAX_MESSAGES` (which senders
refuse too) is a lie, and a receiver drains a mismatched payload only up to
:func:`drain_limit` bytes.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch

from ..core.errors import ArgumentError, OutOfStepError
from .walk import Path

MAGIC = b"CDRV"
VERSION = 2
KIND_BUCKETS = 1
KIND_CHUNKS = 2
KIND_NAMES = {KIND_BUCKETS: "buckets (non-consolidated)", KIND_CHUNKS: "chunks (consolidated)"}
_BODY = struct.Struct("<4sHHIIQQ16sQ")
_CRC = struct.Struct("<I")
SIZE = 64
MAX_MESSAGES = 1 << 16  # payload messages per transfer: a bound both ends enforce
#: senders' storages a fast-wire link keeps mapped at once (route 2); a receiver keeps the memory of each
#: mapped, even once the sender has let go of it, until another storage takes its slot
STORAGE_SLOTS = 2
DRAIN_FLOOR = 1 << 20  # a receiver drains a mismatched payload of up to max(2 x its own size, this)


def messages(total: int, piece: int) -> int:
    """How many messages of at most ``piece`` bytes carry ``total`` bytes."""
    return -(-total // piece)


def drain_limit(own_total: int) -> int:
    """The most bytes a receiver expecting ``own_total`` drains from a mismatched sender."""
    return max(2 * own_total, DRAIN_FLOOR)


@dataclass(frozen=True)
class Header:
    """What one fast-wire transfer announces before its payload."""

    kind: int
    leaves: int
    total: int
    piece: int
    schema: bytes
    #: 0: the payload follows on the wire; 1: in shared segment ``segment``; 2: in storage slot ``segment``;
    #: 3: in the sender's leaves, read directly
    transport: int = 0
    segment: int = 0
    offer: bool = False  #: an offer of shared segments follows the header (:mod:`cudarecv.samehost.sides`)
    seq: int = 0

    def with_piece(self, piece: int) -> "Header":
        """This header for messages of ``piece`` bytes."""
        return replace(self, piece=piece)

    def pack(self) -> bytes:
        route = self.transport | self.segment << 8 | int(self.offer) << 16
        body = _BODY.pack(MAGIC, VERSION, self.kind, self.leaves, route, self.total, self.piece, self.schema,
                          self.seq)
        return body + _CRC.pack(zlib.crc32(body)) + bytes(SIZE - len(body) - _CRC.size)

    @classmethod
    def unpack(cls, raw: bytes) -> "Header":
        """Parse and check a received record; raises :class:`OutOfStepError` if it is not one,
        or if its lengths are impossible (more than :data:`MAX_MESSAGES` messages)."""
        body, (crc,) = raw[: _BODY.size], _CRC.unpack_from(raw, _BODY.size)
        magic, version, kind, leaves, route, total, piece, schema, seq = _BODY.unpack(body)
        out_of_step = "not drained, the link is out of step"
        if magic != MAGIC or zlib.crc32(body) != crc:
            raise OutOfStepError(
                "the first message is not a cudarecv header (bad magic or checksum): the "
                "sender does not use the fast wire; pass the same bucket_bytes on both sides "
                f"({out_of_step})"
            )
        if version != VERSION or kind not in KIND_NAMES:
            raise OutOfStepError(f"unsupported cudarecv header (version {version}, kind {kind}; {out_of_step})")
        if piece <= 0 or messages(total, piece) > MAX_MESSAGES:
            raise OutOfStepError(
                f"the header announces {total} bytes in messages of {piece} bytes, more than the "
                f"{MAX_MESSAGES} messages a transfer may have: a corrupt or hostile sender ({out_of_step})"
            )
        transport, segment, offer = route & 0xFF, route >> 8 & 0xFF, bool(route >> 16 & 1)
        if transport > 3 or segment >= {2: STORAGE_SLOTS, 3: 1}.get(transport, 2) or route >> 17:
            raise OutOfStepError(f"the header names an unknown payload route {route:#x} ({out_of_step})")
        return cls(kind, leaves, total, piece, schema, transport, segment, offer, seq)


def piece_sizes(total: int, piece: int) -> list[int]:
    """``total`` bytes cut into messages of at most ``piece`` bytes."""
    full, rest = divmod(total, piece)
    return [piece] * full + ([rest] if rest else [])


def cut(buffer: torch.Tensor, piece: int) -> list[torch.Tensor]:
    """``buffer`` as views of at most ``piece`` bytes each, in order."""
    sizes = piece_sizes(buffer.numel(), piece)
    return list(buffer.split(sizes)) if sizes else []


def check_pieces(total: int, bucket_bytes: int, what: str = "payload") -> None:
    """A sender's ``bucket_bytes`` must not cut ``total`` bytes into more than :data:`MAX_MESSAGES`."""
    count = messages(total, bucket_bytes)
    if count > MAX_MESSAGES:
        raise ArgumentError(
            f"`bucket_bytes={bucket_bytes}` cuts the {total}-byte {what} into {count} messages, more than "
            f"the {MAX_MESSAGES} a transfer may have: pass bucket_bytes >= {messages(total, MAX_MESSAGES)}"
        )


def schema_digest(paths: Sequence[Path], tensors: Sequence[torch.Tensor],
                  offsets: Iterable[int] | None = None, storage_bytes: int = 0) -> bytes:
    """A 16-byte fingerprint of the leaves' keys, dtypes, shapes and byte counts.

    With ``offsets`` (consolidated storage), each leaf's byte offset in the
    storage and the storage size are part of it too.
    """
    h = hashlib.blake2b(digest_size=16)
    offs = list(offsets) if offsets is not None else None
    for i, (path, t) in enumerate(zip(paths, tensors)):
        h.update("\x1f".join(map(str, path)).encode())
        h.update(b"\x00" + str(t.dtype).encode() + b"\x00")
        h.update(struct.pack(f"<{t.dim() + 1}q", t.dim(), *t.shape))
        h.update(struct.pack("<q", t.numel() * t.element_size()))
        if offs is not None:
            h.update(struct.pack("<q", offs[i]))
    if offs is not None:
        h.update(struct.pack("<q", storage_bytes))
    return h.digest()
