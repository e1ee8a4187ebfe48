"""What weight sync puts on the wire: the handshake schema (JSON) and the per-push header.

Nothing here is ever unpickled: the schema is JSON, parsed and checked field by
field (a peer cannot make a receiver run code, unlike ``init_remote``, which
unpickles); the push header is a fixed 96-byte record.

Layout of the sender's storage: the leaves in stock send order, each at an
offset aligned to 16 bytes, in one uint8 buffer. Both ends build their views
from the same :class:`Schema`.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

ALIGN = 16
MAX_SCHEMA_BYTES = 64 << 20
TAG_BASE = 1 << 29  # weight-sync tags: apart from stock tags and the fast wire's (>= 2**30)
TAG_PREAMBLE, TAG_SCHEMA, TAG_STATUS, TAG_HEADER, TAG_PAYLOAD = (TAG_BASE + k for k in range(5))
STATUS_SIZE = 256

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
)}


class SchemaError(ValueError):
    """The two ends disagree on the weights' structure (raised at the handshake)."""


@dataclass(frozen=True)
class _Shape:
    """What :meth:`Schema.of` reads of a tensor, to recompute a received layout."""

    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Leaf:
    key: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    @property
    def name(self) -> str:
        return ".".join(self.key)


@dataclass(frozen=True)
class Schema:
    """Keys, dtypes, shapes and offsets of the weights, their total bytes and fingerprint."""

    leaves: tuple[Leaf, ...]
    total: int

    @classmethod
    def of(cls, keys: Sequence[tuple], tensors: Sequence[Tensor]) -> "Schema":
        leaves, offset = [], 0
        for key, t in zip(keys, tensors):
            if str(t.dtype).removeprefix("torch.") not in _DTYPES:
                raise SchemaError(f"leaf {'.'.join(map(str, key))!r} has dtype {t.dtype}, which weight sync does not carry")
            leaves.append(Leaf(tuple(str(k) for k in key), t.dtype, tuple(t.shape), offset))
            offset += -(-leaves[-1].nbytes // ALIGN) * ALIGN
        return cls(tuple(leaves), offset)

    def to_json(self) -> bytes:
        doc = {
            "format": "cudarecv-weights",
            "version": 1,
            "total_bytes": self.total,
            "fingerprint": self.fingerprint.hex(),
            "leaves": [
                {"key": list(l.key), "dtype": str(l.dtype).removeprefix("torch."), "shape": list(l.shape),
                 "offset": l.offset, "nbytes": l.nbytes}
                for l in self.leaves
            ],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Schema":
        """Parse and check a received schema; raises :class:`SchemaError` on anything off."""
        try:
            doc = json.loads(raw.decode())
            if doc.get("format") != "cudarecv-weights" or doc.get("version") != 1:
                raise SchemaError(f"not a cudarecv weight schema (format {doc.get('format')!r})")
            leaves = []
            for item in doc["leaves"]:
                key, dtype, shape = item["key"], item["dtype"], item["shape"]
                if not (isinstance(key, list) and key and all(isinstance(k, str) for k in key)):
                    raise SchemaError(f"bad key {key!r}")
                if dtype not in _DTYPES:
                    raise SchemaError(f"unknown dtype {dtype!r} for {'.'.join(key)!r}")
                if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
                    raise SchemaError(f"bad shape {shape!r} for {'.'.join(key)!r}")
                leaves.append(Leaf(tuple(key), _DTYPES[dtype], tuple(shape), int(item["offset"])))
            schema = cls(tuple(leaves), int(doc["total_bytes"]))
        except SchemaError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise SchemaError(f"malformed weight schema: {error!r}") from None
        expected = cls.of([l.key for l in schema.leaves], [_Shape(l.dtype, l.shape) for l in schema.leaves])
        if (schema != expected or schema.to_json() != raw or schema.fingerprint.hex() != doc["fingerprint"]):
            raise SchemaError("the weight schema does not check out (offsets, total bytes or fingerprint)")
        return schema

    @property
    def fingerprint(self) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for l in self.leaves:
            h.update(json.dumps([l.key, str(l.dtype), l.shape, l.offset]).encode())
        h.update(struct.pack("<q", self.total))
        return h.digest()

    def views(self, storage: Tensor) -> list[Tensor]:
        """Each leaf as a typed view into ``storage`` (uint8, ``total`` bytes)."""
        return [storage[l.offset:l.offset + l.nbytes].view(l.dtype).view(l.shape) for l in self.leaves]

    def first_difference(self, keys: Sequence[tuple], tensors: Sequence[Tensor]) -> str | None:
        """How ``tensors`` (named by ``keys``) differ from the schema, naming the first differing key."""
        mine = {".".join(map(str, k)): (t.dtype, tuple(t.shape)) for k, t in zip(keys, tensors)}
        theirs = {l.name: (l.dtype, l.shape) for l in self.leaves}
        for name in sorted(set(mine) | set(theirs)):
            if name not in theirs:
                return f"key {name!r} is expected but the sender does not send it"
            if name not in mine:
                return f"key {name!r} is sent but not expected"
            if mine[name] != theirs[name]:
                (d1, s1), (d2, s2) = theirs[name], mine[name]
                return f"key {name!r}: the sender sends {d1} {list(s1)}, expected {d2} {list(s2)}"
        return None


# -- per-push header ---------------------------------------------------------------
_HEADER = struct.Struct("<4sHHIQQQ16s16s")
HEADER_SIZE = 96
MAGIC = b"CDRS"
FLAG_VERIFY = 1


class PushHeaderError(ValueError):
    """A push header that does not match the handshake (the payload was drained)."""


@dataclass(frozen=True)
class PushHeader:
    version: int
    total: int
    piece: int
    fingerprint: bytes
    checksum: bytes = bytes(16)
    verify: bool = False

    def pack(self) -> bytes:
        body = _HEADER.pack(MAGIC, 1, FLAG_VERIFY if self.verify else 0, 0, self.version, self.total,
                            self.piece, self.fingerprint, self.checksum)
        return body + struct.pack("<I", zlib.crc32(body)) + bytes(HEADER_SIZE - _HEADER.size - 4)

    @classmethod
    def unpack(cls, raw: bytes) -> "PushHeader":
        body = raw[: _HEADER.size]
        (crc,) = struct.unpack_from("<I", raw, _HEADER.size)
        magic, fmt, flags, _, version, total, piece, fingerprint, checksum = _HEADER.unpack(body)
        if magic != MAGIC or fmt != 1 or zlib.crc32(body) != crc or piece <= 0:
            raise PushHeaderError("the message is not a cudarecv weight-push header (bad magic or checksum)")
        return cls(version, total, piece, fingerprint, checksum, bool(flags & FLAG_VERIFY))


def checksum(storage: Tensor) -> bytes:
    """A 16-byte position-sensitive checksum of ``storage`` (uint8, length a multiple of 16),
    computed with torch on the storage's own device: detects corruption, not an adversary."""
    words = storage.view(torch.int64)
    cols = 256 if words.numel() % 256 == 0 else 2
    grid = words.view(-1, cols)
    weights_rows = torch.arange(1, grid.shape[0] + 1, device=storage.device, dtype=torch.int64)
    weights_cols = torch.arange(1, cols + 1, device=storage.device, dtype=torch.int64)
    by_row = (grid.sum(1) * weights_rows).sum()
    by_col = (grid.sum(0) * weights_cols).sum()
    return struct.pack("<qq", int(by_row), int(by_col))


def status_message(ok: bool, text: str = "") -> bytes:
    """The receiver's answer to the handshake: a flag and a reason, fixed size."""
    data = (b"\x01" if ok else b"\x00") + text.encode()[: STATUS_SIZE - 1]
    return data + bytes(STATUS_SIZE - len(data))


def read_status(raw: bytes) -> tuple[bool, str]:
    return raw[0] == 1, raw[1:].rstrip(b"\x00").decode(errors="replace")


def preamble(schema_bytes: int) -> bytes:
    return struct.pack("<4sIQ", b"CDRH", 1, schema_bytes)


def read_preamble(raw: bytes) -> int:
    magic, fmt, length = struct.unpack("<4sIQ", raw)
    if magic != b"CDRH" or fmt != 1:
        raise SchemaError("the first message is not a cudarecv weight-sync handshake: is the peer a WeightSender?")
    if not 0 < length <= MAX_SCHEMA_BYTES:
        raise SchemaError(f"announced schema of {length} bytes is out of range")
    return length


