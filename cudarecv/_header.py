"""The fast wire's header: a fixed 64-byte binary record, never pickle.

Layout (little-endian)::

    magic     4s   b"CDRV"
    version   u16  1
    kind      u16  1 = buckets (non-consolidated), 2 = chunks (consolidated storage)
    leaves    u32  number of leaves
    reserved  u32  0
    total     u64  payload bytes
    piece     u64  bytes per payload message (the sender's bucket_bytes)
    schema    16s  blake2b-128 of the schema (keys, dtypes, shapes, byte counts, offsets)
    crc       u32  crc32 of the 52 bytes above
    padding   12x

Nothing read from the wire is ever unpickled: the receiver compares the record
with the one it computes for its own tensordict.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch

from ._walk import Path

MAGIC = b"CDRV"
VERSION = 1
KIND_BUCKETS = 1
KIND_CHUNKS = 2
KIND_NAMES = {KIND_BUCKETS: "buckets (non-consolidated)", KIND_CHUNKS: "chunks (consolidated)"}
_BODY = struct.Struct("<4sHHIIQQ16s")
_CRC = struct.Struct("<I")
SIZE = 64


class HeaderError(ValueError):
    """A fast-wire header that does not match the receiver (its payload was drained)."""


@dataclass(frozen=True)
class Header:
    """What one fast-wire transfer announces before its payload."""

    kind: int
    leaves: int
    total: int
    piece: int
    schema: bytes

    def with_piece(self, piece: int) -> "Header":
        """This header for messages of ``piece`` bytes."""
        return replace(self, piece=piece)

    def pack(self) -> bytes:
        body = _BODY.pack(MAGIC, VERSION, self.kind, self.leaves, 0, self.total, self.piece, self.schema)
        return body + _CRC.pack(zlib.crc32(body)) + bytes(SIZE - len(body) - _CRC.size)

    @classmethod
    def unpack(cls, raw: bytes) -> "Header":
        """Parse and check a received record; raises :class:`HeaderError` if it is not one."""
        body, (crc,) = raw[: _BODY.size], _CRC.unpack_from(raw, _BODY.size)
        magic, version, kind, leaves, _, total, piece, schema = _BODY.unpack(body)
        if magic != MAGIC or zlib.crc32(body) != crc:
            raise HeaderError(
                "the first message is not a cudarecv header (bad magic or checksum): the "
                "sender does not use the fast wire; pass the same bucket_bytes on both sides"
            )
        if version != VERSION or kind not in KIND_NAMES or piece <= 0:
            raise HeaderError(f"unsupported cudarecv header (version {version}, kind {kind})")
        return cls(kind, leaves, total, piece, schema)

    def pieces(self) -> list[int]:
        """The byte count of each payload message."""
        return piece_sizes(self.total, self.piece)


def piece_sizes(total: int, piece: int) -> list[int]:
    """``total`` bytes cut into messages of at most ``piece`` bytes."""
    full, rest = divmod(total, piece)
    return [piece] * full + ([rest] if rest else [])


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
