"""The fast wire's header: a fixed 64-byte binary record (:class:`~cudarecv.core.records.Record`), never pickle.

Layout (little-endian)::

    magic        4s   b"CDRV"
    version      u16  4 (since 3 the record carries init_tag, since 4 a description of the sender's
                      layout may follow; a peer of another version is out of step)
    kind         u16  1 = buckets (non-consolidated), 2 = chunks (consolidated storage)
    leaves       u32  number of leaves
    route        u32  where the payload is: byte 0 a :class:`PayloadRoute` (the wire, a shared
                      host segment, the sender's storage in shared memory, the sender's leaves
                      read directly, a CUDA IPC segment: :mod:`cudarecv.samehost`),
                      byte 1 the segment or storage slot, bit 16 an offer follows, bit 17 the
                      sender's layout follows (after the offer, if any: :mod:`cudarecv.wire.layouts`)
    total        u64  payload bytes
    bucket_bytes u64  bytes per payload message (the sender's bucket_bytes)
    schema       16s  blake2b-128 of the schema (keys, dtypes, shapes, byte counts, offsets)
    seq          u64  the sender's transfer number on this link (shared segments)
    init_tag     u32  the transfer's init_tag (NCCL ignores tags: a receiver checks it took its own transfer)
    crc          u32  crc32 of the 60 bytes above

Nothing read from the wire is ever unpickled: the receiver compares the record
with the one it computes for its own tensordict. Nothing is sized from a record
before it is checked: a piece count above :data:`MAX_MESSAGES` (which senders
refuse too) is a lie, and a receiver drains a mismatched payload only up to
:func:`drain_limit` bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum

import torch

from ..core.errors import ArgumentError, OutOfStepError
from ..core.records import Record
from .walk import Path


class PayloadRoute(IntEnum):
    """Where a fast-wire transfer's payload is (the header's route byte)."""

    WIRE = 0  #: the messages after the header, on the process group
    SEGMENT = 1  #: a shared host segment of the sender's (memfd)
    STORAGE = 2  #: the sender's consolidated storage, where torch keeps it in shared memory
    DIRECT = (
        3  #: the sender's leaves (or private storage), read by the receiver with process_vm_readv
    )
    DEVICE_SEGMENT = 4  #: a CUDA IPC segment of the sender's


MAGIC = b"CDRV"
VERSION = 4  # 3: the init_tag is in the record; 4: a description of the sender's layout may follow (route bit 17)


class PayloadKind(IntEnum):
    """How a fast-wire transfer's payload is cut: leaves packed into buckets, or a consolidated storage's chunks."""

    BUCKETS = 1
    CHUNKS = 2


KIND_BUCKETS, KIND_CHUNKS = PayloadKind  # (by name at module level too, as ``re`` has its flags)
KIND_NAMES = {KIND_BUCKETS: "buckets (non-consolidated)", KIND_CHUNKS: "chunks (consolidated)"}
RECORD = Record(
    "header",
    MAGIC,
    "HHIIQQ16sQI",
    size=64,
    hint="the sender does not use the fast wire; pass the same bucket_bytes on both sides "
    "(not drained, the link is out of step)",
)
SIZE = RECORD.size
MAX_MESSAGES = 1 << 16  # payload messages per transfer: a bound both ends enforce
#: senders' storages a fast-wire link keeps mapped at once (the storage route); a receiver keeps the memory of each
#: mapped, even once the sender has let go of it, until another storage takes its slot
STORAGE_SLOTS = 2
#: the slots of each route's segment byte
ROUTE_SLOTS = {
    PayloadRoute.WIRE: 1,
    PayloadRoute.SEGMENT: 2,
    PayloadRoute.STORAGE: STORAGE_SLOTS,
    PayloadRoute.DIRECT: 1,
    PayloadRoute.DEVICE_SEGMENT: 2,
}

DRAIN_FLOOR = 1 << 20  # a receiver drains a mismatched payload of up to max(2 x its own size, this)


def messages(total: int, bucket_bytes: int) -> int:
    """How many messages of at most ``bucket_bytes`` bytes carry ``total`` bytes."""
    return -(-total // bucket_bytes)


def drain_limit(own_total: int) -> int:
    """The most bytes a receiver expecting ``own_total`` drains from a mismatched sender."""
    return max(2 * own_total, DRAIN_FLOOR)


@dataclass(frozen=True)
class Header:
    """What one fast-wire transfer announces before its payload."""

    kind: PayloadKind
    leaves: int
    total: int
    bucket_bytes: int
    schema: bytes
    #: where the payload is (:class:`PayloadRoute`), in slot ``segment``
    transport: int = PayloadRoute.WIRE
    segment: int = 0
    offer: bool = (
        False  #: an offer of shared segments follows the header (:mod:`cudarecv.samehost.sides`)
    )
    seq: int = 0
    init_tag: int = 0  #: the transfer's ``init_tag`` (set by the sender: :meth:`for_transfer`)
    described: bool = False  #: the sender's layout follows the header (and the offer) on its tag
    #: the layout of the tensordict this header was made for (:func:`cudarecv.plan.describe.describe`), made when
    #: asked (a sender's first transfer of its schema on a link, a receiver's mismatch); never on the wire itself
    describe: Callable[[], bytes] | None = field(default=None, compare=False, repr=False)

    def for_transfer(self, bucket_bytes: int, init_tag: int) -> Header:
        """This header for a transfer with ``init_tag`` in messages of ``bucket_bytes`` bytes."""
        return replace(self, bucket_bytes=bucket_bytes, init_tag=init_tag)

    def pack(self) -> bytes:
        route = (
            self.transport | self.segment << 8 | int(self.offer) << 16 | int(self.described) << 17
        )
        return RECORD.pack(
            VERSION,
            self.kind,
            self.leaves,
            route,
            self.total,
            self.bucket_bytes,
            self.schema,
            self.seq,
            self.init_tag,
        )

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        """Parse and check a received record; raises :class:`OutOfStepError` if it is not one,
        or if its lengths are impossible (more than :data:`MAX_MESSAGES` messages)."""
        version, kind, leaves, route, total, bucket_bytes, schema, seq, init_tag = RECORD.unpack(
            raw
        )
        out_of_step = "not drained, the link is out of step"
        if version != VERSION or kind not in KIND_NAMES:
            raise OutOfStepError(
                f"unsupported cudarecv header (version {version}, kind {kind}; {out_of_step})"
            )
        if bucket_bytes <= 0 or messages(total, bucket_bytes) > MAX_MESSAGES:
            raise OutOfStepError(
                f"the header announces {total} bytes in messages of {bucket_bytes} bytes, more than the "
                f"{MAX_MESSAGES} messages a transfer may have: a corrupt or hostile sender ({out_of_step})"
            )
        transport, segment, offer = route & 0xFF, route >> 8 & 0xFF, bool(route >> 16 & 1)
        if (
            transport not in ROUTE_SLOTS
            or segment >= ROUTE_SLOTS[PayloadRoute(transport)]
            or route >> 18
        ):
            raise OutOfStepError(
                f"the header names an unknown payload route {route:#x} ({out_of_step})"
            )
        return cls(
            PayloadKind(kind),
            leaves,
            total,
            bucket_bytes,
            schema,
            PayloadRoute(transport),
            segment,
            offer,
            seq,
            init_tag,
            bool(route >> 17 & 1),
        )


def piece_sizes(total: int, bucket_bytes: int) -> list[int]:
    """``total`` bytes cut into messages of at most ``bucket_bytes`` bytes."""
    full, rest = divmod(total, bucket_bytes)
    return [bucket_bytes] * full + ([rest] if rest else [])


def cut(buffer: torch.Tensor, bucket_bytes: int) -> list[torch.Tensor]:
    """``buffer`` as views of at most ``bucket_bytes`` bytes each, in order."""
    sizes = piece_sizes(buffer.numel(), bucket_bytes)
    return list(buffer.split(sizes)) if sizes else []


def check_pieces(total: int, bucket_bytes: int, what: str = "payload") -> None:
    """A sender's ``bucket_bytes`` must not cut ``total`` bytes into more than :data:`MAX_MESSAGES`."""
    count = messages(total, bucket_bytes)
    if count > MAX_MESSAGES:
        raise ArgumentError(
            f"`bucket_bytes={bucket_bytes}` cuts the {total}-byte {what} into {count} messages, more than "
            f"the {MAX_MESSAGES} a transfer may have: pass bucket_bytes >= {messages(total, MAX_MESSAGES)}"
        )


def schema_digest(
    paths: Sequence[Path],
    tensors: Sequence[torch.Tensor],
    offsets: Iterable[int] | None = None,
    storage_bytes: int = 0,
) -> bytes:
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
