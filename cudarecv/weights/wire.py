"""What weight sync puts on the wire: the handshake schema (JSON) and the per-push header.

Nothing here is ever unpickled: the schema is JSON, parsed and checked field by
field (a peer cannot make a receiver run code, unlike ``init_remote``, which
unpickles); the push header is a fixed 96-byte record. The handshake opens with
a fixed preamble: the schema's length, the sender's message size and its mode
(``sync`` or ``latest``), so every push's lengths are known to the receiver
before the first push.

After the handshake the receiver always has one header receive posted, so the
sender can end the link at any time:

- the sender's headers (:class:`PushHeader`) are of three kinds: a push (the
  payload follows), ``CLOSED`` (the sender closed) or ``RELEASED`` (the answer
  to the receiver's ``BYE``);
- the receiver's messages (:func:`ask_message`) are ``ASK`` (latest mode: "send
  me a version newer than v") and ``BYE`` (the receiver closes). The sender
  always has one receive posted for them.

Each side sends its last message once: the receiver one ``BYE``, the sender one
of ``CLOSED`` and ``RELEASED``; once both are through, nothing is left posted.

Layout of the sender's storage: the leaves in stock send order, each at an
offset aligned to 16 bytes, in one uint8 buffer. Both ends build their views
from the same :class:`Schema`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Sequence

import torch
from torch import Tensor

from ..core.errors import OutOfStepError, SchemaError
from ..core.records import Record
from ..core.tags import SESSIONS, session_tags

ALIGN = 16
MAX_SCHEMA_BYTES = 64 << 20
MAX_BYTES = 1 << 48  # a total or a leaf larger than this is no real model: refused before anything is sized


@dataclass(frozen=True)
class SessionTags:
    """The tags of one sender-receiver session after the handshake.

    Each session has its own, so a receive left posted by an earlier session on the
    same group (a receiver never closed) cannot take this session's messages.
    """

    header: int
    payload: int
    ask: int
    trailer: int  # relay fan-out: what follows a push's chunks from the previous hop

    @classmethod
    def of(cls, session: int) -> "SessionTags":
        return cls(*session_tags(session))


STATUS_SIZE = 256
MODES = ("sync", "latest")
FANOUTS = ("auto", "star", "relay")

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
)}


def _check_size(value: object, what: str) -> int:
    """A byte count or dimension read from the wire: an int (not a bool or float) in 0..MAX_BYTES."""
    if type(value) is not int or not 0 <= value <= MAX_BYTES:
        raise SchemaError(f"{what} is {value!r}: not an int in 0..2**48")
    return value


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
            raise SchemaError(f"malformed weight schema: {type(error).__name__}: {error}"[:200]) from None
        expected = cls.of([l.key for l in schema.leaves], [_Shape(l.dtype, l.shape) for l in schema.leaves])
        if schema != expected or schema.to_json() != raw or schema.fingerprint.hex() != fingerprint:
            raise SchemaError("the weight schema does not check out (offsets, total bytes or fingerprint)")
        return schema

    @classmethod
    def _parse(cls, raw: bytes) -> tuple["Schema", object]:
        doc = json.loads(raw.decode())
        if not isinstance(doc, dict) or doc.get("format") != "cudarecv-weights" or doc.get("version") != 1:
            raise SchemaError("not a cudarecv weight schema")
        items, total = doc["leaves"], doc["total_bytes"]
        if not isinstance(items, list) or not items:
            raise SchemaError("the weight schema has no leaves: weight sync needs at least one tensor")
        _check_size(total, "total_bytes")
        leaves, seen = [], set()
        for item in items:
            key, dtype, shape = item["key"], item["dtype"], item["shape"]
            if not (isinstance(key, list) and key and all(isinstance(k, str) and k for k in key)):
                raise SchemaError(f"bad key {key!r}: a list of non-empty strings")
            name = ".".join(key)
            if tuple(key) in seen:
                raise SchemaError(f"key {name!r} appears twice")
            seen.add(tuple(key))
            if dtype not in _DTYPES:
                raise SchemaError(f"unknown dtype {dtype!r} for {name!r}")
            if not isinstance(shape, list) or len(shape) > 64:
                raise SchemaError(f"bad shape {shape!r} for {name!r}")
            for size in shape:
                _check_size(size, f"a dimension of {name!r}")
            leaf = Leaf(tuple(key), _DTYPES[dtype], tuple(shape), _check_size(item["offset"], f"the offset of {name!r}"))
            _check_size(leaf.nbytes, f"the size of {name!r}")
            leaves.append(leaf)
        for key in seen:  # a key that is also the prefix of another would be a tensor and a tensordict
            for cut in range(1, len(key)):
                if key[:cut] in seen:
                    raise SchemaError(f"key {'.'.join(key[:cut])!r} is a leaf and also holds {'.'.join(key)!r}")
        return cls(tuple(leaves), total), doc["fingerprint"]

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
        mine = {tuple(map(str, k)): (t.dtype, tuple(t.shape)) for k, t in zip(keys, tensors)}
        theirs = {l.key: (l.dtype, l.shape) for l in self.leaves}
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
                return f"key {name!r}: the sender sends {d1} {list(s1)}, expected {d2} {list(s2)}"
        return None


# -- per-push header ---------------------------------------------------------------
FORMAT = 3


class Flag(IntFlag):
    """A push header's flags: a digest follows the payload; relayed; in a shared segment."""

    VERIFY = 1
    RELAY = 2
    SHARED = 4


class HeaderKind(IntEnum):
    """A push header's kind: a version follows; the sender closed; the answer to ``BYE``."""

    PUSH = 0
    CLOSED = 1
    RELEASED = 2


PUSH, CLOSED, RELEASED = HeaderKind  # (each message's kinds by name at module level too, as ``re`` has its flags)
_OUT_OF_STEP = "not drained, the link is out of step"
HEADER = Record("weight-push header", b"CDRS", "HHIQQQ16s16siii", size=96, hint=_OUT_OF_STEP)
HEADER_SIZE = HEADER.size


@dataclass(frozen=True)
class PushHeader:
    version: int
    total: int
    piece: int
    fingerprint: bytes
    checksum: bytes = bytes(16)
    verify: bool = False
    kind: HeaderKind = PUSH
    #: relay fan-out: the payload comes from rank ``up`` (in the group), is forwarded to ``down`` (-1: none),
    #: and ends with a trailer on each hop; the receiver then tells the sender what became of it
    relayed: bool = False
    up: int = -1
    down: int = -1
    #: same-host transport: the version is in the sender's shared segment ``segment`` (nothing follows)
    shared: bool = False
    segment: int = -1

    def pack(self) -> bytes:
        flags = ((Flag.VERIFY if self.verify else 0) | (Flag.RELAY if self.relayed else 0)
                 | (Flag.SHARED if self.shared else 0))
        return HEADER.pack(FORMAT, flags, self.kind, self.version, self.total, self.piece, self.fingerprint,
                           self.checksum, self.up, self.down, self.segment)

    @classmethod
    def unpack(cls, raw: bytes) -> "PushHeader":
        """The header in ``raw``; :class:`OutOfStepError` if it is none or its fields are not a header's."""
        fmt, flags, kind, version, total, piece, fingerprint, checksum, up, down, segment = HEADER.unpack(raw)
        if fmt != FORMAT or piece <= 0 or kind not in iter(HeaderKind) or flags & ~(Flag.VERIFY | Flag.RELAY | Flag.SHARED):
            raise OutOfStepError(f"a weight-push header of format {fmt}, kind {kind}, flags {flags}, {piece}-byte "
                                 f"messages is not this cudarecv version's: {_OUT_OF_STEP}")
        flags = Flag(flags)
        return cls(version, total, piece, fingerprint, checksum, Flag.VERIFY in flags, HeaderKind(kind),
                   Flag.RELAY in flags, up, down, Flag.SHARED in flags, segment)


# -- the receiver's messages -----------------------------------------------------------
ASK_RECORD = Record("receiver message", b"CDRA", "IQii", size=32)
ASK_SIZE = ASK_RECORD.size


class AskKind(IntEnum):
    """A receiver's message: latest mode's ask; the receiver closes; relay fan-out and shared memory: what became
    of a version; zero-copy: the receiver no longer reads the snapshot of a version."""

    ASK = 0
    BYE = 1
    GOT = 2
    FREED = 3


class Got(IntEnum):
    """A ``GOT``'s status: published; rejected (drained, still in step); lost upstream."""

    LANDED = 0
    REJECTED = 1
    LOST = 2


ASK, BYE, GOT, FREED = AskKind
LANDED, REJECTED, LOST = Got


@dataclass(frozen=True)
class Ask:
    """A receiver's message: ``kind``, a ``version``, and for ``GOT`` a ``status`` and the rank it names."""

    kind: AskKind
    version: int = 0
    status: Got = LANDED
    rank: int = -1


def ask_message(kind: AskKind, version: int = 0, status: Got = LANDED, rank: int = -1) -> bytes:
    """``ASK`` for a version newer than ``version`` (latest mode), ``BYE`` (the receiver closes),
    ``GOT`` (relay fan-out, shared memory: ``version`` landed, was rejected, or was lost because ``rank``
    upstream failed) or ``FREED`` (a zero-copy receiver let go of the shared snapshot of ``version``)."""
    return ASK_RECORD.pack(kind, version, status, rank)


def read_ask(raw: bytes) -> Ask:
    """The :class:`Ask` of a receiver's message; raises :class:`OutOfStepError` if it is none."""
    kind, version, status, rank = ASK_RECORD.unpack(raw)
    if kind not in iter(AskKind) or status not in iter(Got):
        raise OutOfStepError(f"a receiver message of kind {kind}, status {status} is no cudarecv ask: "
                             "the link is out of step")
    return Ask(AskKind(kind), version, Got(status), rank)


# -- relay fan-out: what follows a push's chunks on each hop ---------------------------
TRAILER = Record("relay trailer", b"CDRT", "IQi", size=32)
TRAILER_SIZE = TRAILER.size


class Trailer(IntEnum):
    """A relay trailer's status: the chunks before it are the version's; they are not (``rank`` upstream failed)."""

    INTACT = 0
    BROKEN = 1


INTACT, BROKEN = Trailer


def trailer_message(version: int, status: Trailer = INTACT, rank: int = -1) -> bytes:
    """The last message of a push on a relay hop: whether the chunks before it are intact."""
    return TRAILER.pack(status, version, rank)


def read_trailer(raw: bytes) -> tuple[Trailer, int, int]:
    """``(status, version, rank)`` of a relay trailer; raises :class:`OutOfStepError` if it is none."""
    status, version, rank = TRAILER.unpack(raw)
    if status not in iter(Trailer):
        raise OutOfStepError(f"a relay trailer of status {status} is no cudarecv trailer: the link is out of step")
    return Trailer(status), version, rank


def checksum(storage: Tensor) -> bytes:
    """The 16-byte BLAKE3 digest of ``storage``, computed on its own device (see :mod:`cudarecv.cuda.digest`)."""
    from ..cuda.digest import digest

    return digest(storage)


class Answer(IntEnum):
    """The receiver's answer to the handshake: the weights do not match; ok; the receiver failed."""

    REFUSED = 0
    ACCEPTED = 1
    FAILED = 2


REFUSED, ACCEPTED, FAILED = Answer
ANSWER = Record("handshake answer", b"CDRN", f"B{STATUS_SIZE - 9}s", size=STATUS_SIZE,
                hint="is the peer a WeightReceiver of this cudarecv version?")
REASON_BYTES = STATUS_SIZE - 9  # what fits after the magic and status, before the CRC


def status_message(status: Answer, text: str = "") -> bytes:
    """The receiver's answer to the handshake: a status and a reason (UTF-8, cut to fit), fixed size."""
    return ANSWER.pack(status, text.encode()[:REASON_BYTES].decode(errors="ignore").encode())


def read_status(raw: bytes) -> tuple[Answer, str]:
    """``(status, text)``: the reason of a refusal or failure; for ``ACCEPTED``, the receiver's :func:`host_id`.
    Raises :class:`OutOfStepError` if ``raw`` is no answer (its length, magic, CRC or status is off)."""
    status, reason = ANSWER.unpack(raw)
    if status not in iter(Answer):
        raise OutOfStepError(f"the handshake's answer of status {status} is not a cudarecv WeightReceiver's: "
                             "is the peer one of this cudarecv version?")
    return Answer(status), reason.rstrip(b"\x00").decode(errors="replace")


PREAMBLE = Record("weight-sync handshake", b"CDRH", "IQQIII", crc=False,
                  hint="is the peer a WeightSender of this cudarecv version?")
PREAMBLE_SIZE = PREAMBLE.size
PREAMBLE_FORMAT = 5  # 5: the handshake's answer is a record (magic, CRC)


@dataclass(frozen=True)
class Offer:
    """What a preamble announces: the schema's length, the bytes per push message, the mode, the session,
    and the length of the same-host offer that follows the schema (0: none; :mod:`cudarecv.samehost.shared_memory`)."""

    length: int
    piece: int
    mode: str
    session: int
    shared: int = 0


def preamble(schema_bytes: int, piece: int, mode: str, session: int = 0, shared: int = 0) -> bytes:
    """The handshake's first message (see :class:`Offer`)."""
    return PREAMBLE.pack(PREAMBLE_FORMAT, schema_bytes, piece, MODES.index(mode), session, shared)


def read_preamble(raw: bytes) -> Offer:
    """The :class:`Offer` of a received preamble; raises :class:`OutOfStepError` if the peer is no
    weight sender of this version (the lengths are the receiver's to check: :func:`check_offer`)."""
    fmt, length, piece, mode, session, shared = PREAMBLE.unpack(raw)
    if fmt != PREAMBLE_FORMAT or mode >= len(MODES) or session >= SESSIONS:
        raise OutOfStepError(f"a weight-sync handshake of format {fmt}, mode {mode}, session {session} is not this "
                             f"cudarecv version's: {PREAMBLE.hint}")
    return Offer(length, piece, MODES[mode], session, shared)


def check_offer(length: int, piece: int) -> None:
    """The lengths a preamble announces must be plausible before anything is sized from them."""
    if not 0 < length <= MAX_SCHEMA_BYTES or not 0 < piece <= MAX_BYTES:
        raise SchemaError(f"the handshake announces a schema of {length} bytes and {piece}-byte messages: "
                          "out of range")
