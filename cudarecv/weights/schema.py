"""The weights' structure as it travels in the handshake: :class:`Schema` (keys, dtypes, shapes, offsets, total
bytes, fingerprint), as JSON parsed and checked field by field, never unpickled.

Layout of the sender's storage: the leaves in stock send order, each at an offset aligned to 16 bytes, in one
uint8 buffer. Both ends build their views from the same :class:`Schema`.

A version travels in messages of at most the sender's ``bucket_bytes``: cut evenly from the whole storage, or, in a
*leafwise* schema (a sharded sender's pieces, ``"messages": "leaf"`` in the JSON), from each leaf's bytes alone, so
that a receiver can land each message where its leaf goes (:meth:`Schema.cut`); the padding between leaves is then
never sent, and ``verify``'s digest is that of the messages' digests, in order.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..core.errors import ArgumentError, SchemaError
from ..plan.header import MAX_MESSAGES, check_pieces, cut, piece_sizes

ALIGN = 16
MAX_SCHEMA_BYTES = 64 << 20
MAX_BYTES = (
    1 << 48
)  # a total or a leaf larger than this is no real model: refused before anything is sized


DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    )
}


#: the dtypes a sender's ``wire_dtype`` may be (a leaf in one of them travels in it when it is another of them)
WIRE_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def on_wire(dtype: torch.dtype, wire_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a leaf of ``dtype`` travels in: ``wire_dtype`` for a floating-point leaf (of :data:`WIRE_DTYPES`),
    its own for the others (integers, bools, complex, float8) and without one."""
    return wire_dtype if wire_dtype is not None and dtype in WIRE_DTYPES else dtype


def check_size(value: object, what: str) -> int:
    """A byte count or dimension read from the wire: an int (not a bool or float) in 0..MAX_BYTES."""
    if type(value) is not int or not 0 <= value <= MAX_BYTES:
        raise SchemaError(f"{what} is {value!r}: not an int in 0..2**48")
    return value


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN`: the room a leaf takes in a storage."""
    return -(-nbytes // ALIGN) * ALIGN


class Shaped(Protocol):
    """What :meth:`Schema.of` reads of each leaf: a tensor, or a :class:`_Shape` standing for one."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shape(self) -> Sequence[int]: ...


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
    leafwise: bool = False  # messages cut from each leaf's bytes (see the module docstring)

    @classmethod
    def of(
        cls,
        keys: Sequence[tuple[str, ...]],
        tensors: Sequence[Shaped],
        leafwise: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> Schema:
        """The schema of ``tensors`` named by ``keys``; ``wire_dtype``: its floating-point leaves travel (and land) in
        that dtype (:func:`on_wire`)."""
        leaves, offset = [], 0
        for key, t in zip(keys, tensors):
            if str(t.dtype).removeprefix("torch.") not in DTYPES:
                raise SchemaError(
                    f"leaf {'.'.join(map(str, key))!r} has dtype {t.dtype}, which weight sync does not carry"
                )
            dtype = on_wire(t.dtype, wire_dtype)
            leaves.append(Leaf(tuple(str(k) for k in key), dtype, tuple(t.shape), offset))
            offset += aligned(leaves[-1].nbytes)
        return cls(tuple(leaves), offset, leafwise)

    def to_json(self) -> bytes:
        doc = {
            "format": "cudarecv-weights",
            "version": 1,
            "total_bytes": self.total,
            "fingerprint": self.fingerprint.hex(),
            "leaves": [
                {
                    "key": list(leaf.key),
                    "dtype": str(leaf.dtype).removeprefix("torch."),
                    "shape": list(leaf.shape),
                    "offset": leaf.offset,
                    "nbytes": leaf.nbytes,
                }
                for leaf in self.leaves
            ],
        }
        if self.leafwise:
            doc["messages"] = "leaf"
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Schema:
        """Parse and check a received schema; raises :class:`SchemaError` on anything off.

        Checked before anything is sized from it: strict types, at least one leaf,
        keys that are unique and none the prefix of another (each leaf is a tensor,
        not also a nested tensordict), sizes below :data:`MAX_BYTES`, and offsets,
        total and fingerprint recomputed from keys, dtypes and shapes.
        """
        try:
            schema, fingerprint = cls._parse(raw)
        except SchemaError:
            raise
        except Exception as error:  # noqa: BLE001 - json and int() raise many kinds (RecursionError too)
            raise SchemaError(
                f"malformed weight schema: {type(error).__name__}: {error}"[:200]
            ) from None
        expected = cls.of(
            [leaf.key for leaf in schema.leaves],
            [_Shape(leaf.dtype, leaf.shape) for leaf in schema.leaves],
            schema.leafwise,
        )
        if schema != expected or schema.to_json() != raw or schema.fingerprint.hex() != fingerprint:
            raise SchemaError(
                "the weight schema does not check out (offsets, total bytes or fingerprint)"
            )
        return schema

    @classmethod
    def _parse(cls, raw: bytes) -> tuple[Schema, object]:
        doc = json.loads(raw.decode())
        if (
            not isinstance(doc, dict)
            or doc.get("format") != "cudarecv-weights"
            or doc.get("version") != 1
        ):
            raise SchemaError("not a cudarecv weight schema")
        items, total, messages = doc["leaves"], doc["total_bytes"], doc.get("messages", "even")
        if messages not in ("even", "leaf"):
            raise SchemaError(f"unknown message cut {messages!r}: 'even' or 'leaf'")
        if not isinstance(items, list) or not items:
            raise SchemaError(
                "the weight schema has no leaves: weight sync needs at least one tensor"
            )
        check_size(total, "total_bytes")
        leaves, seen = [], set()
        for item in items:
            key, dtype, shape = item["key"], item["dtype"], item["shape"]
            if not (isinstance(key, list) and key and all(isinstance(k, str) and k for k in key)):
                raise SchemaError(f"bad key {key!r}: a list of non-empty strings")
            name = ".".join(key)
            if tuple(key) in seen:
                raise SchemaError(f"key {name!r} appears twice")
            seen.add(tuple(key))
            if dtype not in DTYPES:
                raise SchemaError(f"unknown dtype {dtype!r} for {name!r}")
            if not isinstance(shape, list) or len(shape) > 64:
                raise SchemaError(f"bad shape {shape!r} for {name!r}")
            for size in shape:
                check_size(size, f"a dimension of {name!r}")
            leaf = Leaf(
                tuple(key),
                DTYPES[dtype],
                tuple(shape),
                check_size(item["offset"], f"the offset of {name!r}"),
            )
            check_size(leaf.nbytes, f"the size of {name!r}")
            leaves.append(leaf)
        for (
            key
        ) in seen:  # a key that is also the prefix of another would be a tensor and a tensordict
            for end in range(1, len(key)):
                if key[:end] in seen:
                    raise SchemaError(
                        f"key {'.'.join(key[:end])!r} is a leaf and also holds {'.'.join(key)!r}"
                    )
        return cls(tuple(leaves), total, messages == "leaf"), doc["fingerprint"]

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """A hash of every leaf's key, dtype, shape and offset (computed once: every push's header and every
        pull's check read it, and at 2000 leaves it takes about 10 ms)."""
        h = hashlib.blake2b(digest_size=16)
        for leaf in self.leaves:
            h.update(json.dumps([leaf.key, str(leaf.dtype), leaf.shape, leaf.offset]).encode())
        h.update(struct.pack("<q", self.total))
        if self.leafwise:
            h.update(b"messages: leaf")
        return h.digest()

    def views(self, storage: Tensor) -> list[Tensor]:
        """Each leaf as a typed view into ``storage`` (uint8, ``total`` bytes)."""
        return [
            storage[leaf.offset : leaf.offset + leaf.nbytes].view(leaf.dtype).view(leaf.shape)
            for leaf in self.leaves
        ]

    def messages(self, bucket_bytes: int) -> list[tuple[int, int]]:
        """Where each message a version travels in lies in the storage, and its byte count (``bucket_bytes``: the sender's
        message size)."""
        spans = (
            [(0, self.total)]
            if not self.leafwise
            else [(leaf.offset, leaf.nbytes) for leaf in self.leaves]
        )
        found = []
        for start, length in spans:
            for size in piece_sizes(length, bucket_bytes):
                found.append((start, size))
                start += size
        return found

    def message_sizes(self, bucket_bytes: int) -> list[int]:
        """The byte count of each message a version travels in."""
        return [size for _, size in self.messages(bucket_bytes)]

    def cut(self, storage: Tensor, bucket_bytes: int) -> list[Tensor]:
        """The messages of a version held in ``storage`` (uint8, laid out as this schema), as views of it."""
        if not self.leafwise:
            return cut(storage, bucket_bytes)
        return self.cut_leaves(
            [storage[leaf.offset : leaf.offset + leaf.nbytes] for leaf in self.leaves], bucket_bytes
        )

    def cut_leaves(self, leaf_bytes: Sequence[Tensor], bucket_bytes: int) -> list[Tensor]:
        """A leafwise schema's messages as views of each leaf's bytes (1-d uint8, wherever each lies)."""
        return [m for b in leaf_bytes for m in cut(b, bucket_bytes)]

    def check_pieces(self, bucket_bytes: int) -> None:
        """Refuse a ``bucket_bytes`` that cuts a version into more than :data:`MAX_MESSAGES` messages."""
        if not self.leafwise:
            check_pieces(self.total, bucket_bytes, "weights")
        elif (count := len(self.messages(bucket_bytes))) > MAX_MESSAGES:
            raise ArgumentError(
                f"`bucket_bytes={bucket_bytes}` cuts {len(self.leaves)} pieces of weights into "
                f"{count} messages, more than the {MAX_MESSAGES} a version "
                "may have (a piece takes one at least): pass a larger bucket_bytes, or fewer leaves"
            )

    def first_difference(self, keys: Sequence[tuple], tensors: Sequence[Tensor]) -> str | None:
        """How ``tensors`` (named by ``keys``) differ from the schema, naming the first differing key."""
        mine = {tuple(map(str, k)): (t.dtype, tuple(t.shape)) for k, t in zip(keys, tensors)}
        theirs = {leaf.key: (leaf.dtype, leaf.shape) for leaf in self.leaves}
        if not mine:
            return "`expect` has no tensors"
        for key in sorted(set(mine) | set(theirs)):
            name = ".".join(key)
            if key not in theirs:
                return f"key {name!r} is expected but the sender does not send it"
            if key not in mine:
                return f"key {name!r} is sent but not expected"
            if mine[key] != theirs[key]:
                (d1, s1), (d2, s2) = theirs[key], mine[key]
                hint = (
                    " (a sender's `wire_dtype` casts its floating-point leaves: expect them in that dtype)"
                    if s1 == s2 and d1 in WIRE_DTYPES and d2 in WIRE_DTYPES
                    else ""
                )
                return f"key {name!r}: the sender sends {d1} {list(s1)}, expected {d2} {list(s2)}{hint}"
        return None
