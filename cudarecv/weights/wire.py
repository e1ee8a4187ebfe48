"""What weight sync puts on the wire besides the schema (:mod:`cudarecv.weights.schema`): the handshake's
preamble and answer, the per-push header, the receiver's messages and the relay trailers, each a fixed record
(:mod:`cudarecv.core.records`), never unpickled. The preamble announces the schema's length, the sender's
message size and its mode (``sync`` or ``latest``), so every push's lengths are known to the receiver before
the first push.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import TYPE_CHECKING

from torch import Tensor

from ..core.errors import OutOfStepError, SchemaError
from ..core.records import Record
from ..core.tags import SESSIONS, relay_tags, session_tags
from .schema import MAX_BYTES, MAX_SCHEMA_BYTES

if TYPE_CHECKING:
    from ..cuda.digest import Pending


@dataclass(frozen=True)
class SessionTags:
    """The tags of one sender-receiver session after the handshake.

    Each session has its own, so a receive left posted by an earlier session on the
    same group (a receiver never closed) cannot take this session's messages.
    """

    session: int
    header: int
    payload: int
    ask: int

    @classmethod
    def of(cls, session: int) -> SessionTags:
        return cls(session, *session_tags(session))

    def relay(self, version: int) -> tuple[int, int]:
        """Relay fan-out: the payload and trailer tags of ``version``'s push on every hop of the chain."""
        return relay_tags(self.session, version)


STATUS_SIZE = 256
MODES = ("sync", "latest")
FANOUTS = ("auto", "star", "relay")

# -- per-push header ---------------------------------------------------------------
FORMAT = 5  # 4: a relayed header names its hop (the receiver's place in the chain); 5: delta pushes


class Flag(IntFlag):
    """A push header's flags: a digest follows the payload; relayed; in a shared segment; the payload is a patch
    against version ``base``; the sender wants the receiver's word on the version (a delta session's); the sender
    rings the receiver's doorbell from the next push on (:mod:`cudarecv.samehost.doorbell`)."""

    VERIFY = 1
    RELAY = 2
    SHARED = 4
    PATCH = 8
    ACK = 16
    BELL = 32


class HeaderKind(IntEnum):
    """A push header's kind: a version follows; the sender closed; the answer to ``BYE``."""

    PUSH = 0
    CLOSED = 1
    RELEASED = 2


PUSH, CLOSED, RELEASED = (
    HeaderKind  # (each message's kinds by name at module level too, as ``re`` has its flags)
)
_OUT_OF_STEP = "not drained, the link is out of step"
HEADER = Record("weight-push header", b"CDRS", "HHIQQQ16s16siiiiIQQ", size=112, hint=_OUT_OF_STEP)
HEADER_SIZE = HEADER.size


@dataclass(frozen=True)
class PushHeader:
    version: int
    total: int
    bucket_bytes: int
    fingerprint: bytes
    checksum: bytes = bytes(16)
    verify: bool = False
    kind: HeaderKind = PUSH
    #: relay fan-out: the payload comes from rank ``up`` (in the group; a receiver that joined through a store:
    #: its join number, the sender's is 0), is forwarded to ``down`` (-1: none), and ends with a trailer on each
    #: hop; the receiver then tells the sender what became of it. ``hop``: its place in the chain (0: first);
    #: ``wait_ms``: how long it waits for its version once this header came (:func:`hop_limit` of the sender's
    #: timeout: every hop of a chain on the sender's clock, whatever the receivers' own timeouts)
    relayed: bool = False
    up: int = -1
    down: int = -1
    hop: int = 0
    wait_ms: int = 0
    #: same-host transport: the version is in the sender's shared segment ``segment`` (nothing follows)
    shared: bool = False
    segment: int = -1
    #: delta (:mod:`cudarecv.weights.delta`): the payload is a patch of ``patch`` bytes (in messages of
    #: ``bucket_bytes``) that turns version ``base``, which the receiver holds, into this one (0: the version
    #: itself); ``ack``: the receiver says GOT on it (the sender learns which version each receiver holds)
    base: int = 0
    patch: int = 0
    ack: bool = False
    #: shared memory: the next pushes come by this receiver's doorbell, not on the link (the header that says so
    #: comes on the link; the receiver's word on it too)
    bell: bool = False

    def pack(self) -> bytes:
        flags = (
            (_VERIFY if self.verify else 0)
            | (_RELAY if self.relayed else 0)
            | (_SHARED if self.shared else 0)
            | (_PATCH if self.patch else 0)
            | (_ACK if self.ack else 0)
            | (_BELL if self.bell else 0)
        )
        return HEADER.pack(
            FORMAT,
            flags,
            self.kind,
            self.version,
            self.total,
            self.bucket_bytes,
            self.fingerprint,
            self.checksum,
            self.up,
            self.down,
            self.segment,
            self.hop,
            self.wait_ms,
            self.base,
            self.patch,
        )

    @classmethod
    def unpack(cls, raw: bytes) -> PushHeader:
        """The header in ``raw``; :class:`OutOfStepError` if it is none or its fields are not a header's."""
        (
            fmt,
            flags,
            kind,
            version,
            total,
            bucket_bytes,
            fingerprint,
            checksum,
            up,
            down,
            segment,
            hop,
            wait_ms,
            base,
            patch,
        ) = HEADER.unpack(raw)
        if (
            fmt != FORMAT
            or bucket_bytes <= 0
            or hop < 0
            or kind not in _KINDS
            or flags & ~_FLAGS
            or bool(flags & Flag.PATCH) != (patch > 0)
            or (base > 0) != (patch > 0)
            or (flags & Flag.BELL and not flags & Flag.SHARED)
        ):
            raise OutOfStepError(
                f"a weight-push header of format {fmt}, kind {kind}, flags {flags}, {bucket_bytes}-byte "
                f"messages is not this cudarecv version's: {_OUT_OF_STEP}"
            )
        # (plain int tests: an IntFlag's operators cost microseconds each, on every push's path)
        return cls(
            version,
            total,
            bucket_bytes,
            fingerprint,
            checksum,
            bool(flags & _VERIFY),
            _KINDS[kind],
            bool(flags & _RELAY),
            up,
            down,
            hop,
            wait_ms,
            bool(flags & _SHARED),
            segment,
            base,
            patch,
            bool(flags & _ACK),
            bool(flags & _BELL),
        )


_KINDS = {int(k): k for k in HeaderKind}
_VERIFY, _RELAY, _SHARED, _PATCH, _ACK, _BELL = (int(f) for f in Flag)
_FLAGS = _VERIFY | _RELAY | _SHARED | _PATCH | _ACK | _BELL


MAX_WAIT_MS = 2**32 - 1  # a header's ``wait_ms`` field (about 50 days)


def hop_limit(timeout: float, hop: int) -> float:
    """How long hop ``hop`` of a relay chain waits for its version (``timeout``: the sender's push timeout):
    ``timeout`` more than the hop before it, so a hop that times out on a stopped receiver before it still has
    ``timeout`` to tell the hops after it (its trailer says BROKEN) and the sender (its word says LOST), and they
    never time out on a live one. The sender waits for hop ``hop``'s word as long as hop ``hop + 1`` waits."""
    return timeout * (hop + 1)


# -- the receiver's messages -----------------------------------------------------------
ASK_RECORD = Record("receiver message", b"CDRA", "IQiiQ", size=40)
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
    #: on a ``GOT``: the version whose snapshot the (zero-copy) receiver let go of as it published this one (0:
    #: none), what a ``FREED`` before the ``GOT`` would say: one message and one wake-up of the sender's listener
    freed: int = 0


def ask_message(
    kind: AskKind, version: int = 0, status: Got = LANDED, rank: int = -1, freed: int = 0
) -> bytes:
    """``ASK`` for a version newer than ``version`` (latest mode), ``BYE`` (the receiver closes),
    ``GOT`` (relay fan-out, shared memory: ``version`` landed, was rejected, or was lost because ``rank``
    upstream failed; ``freed``: and the receiver let go of the shared snapshot of that version) or ``FREED`` (a
    zero-copy receiver let go of the shared snapshot of ``version``)."""
    return ASK_RECORD.pack(kind, version, status, rank, freed)


def read_ask(raw: bytes) -> Ask:
    """The :class:`Ask` of a receiver's message; raises :class:`OutOfStepError` if it is none."""
    kind, version, status, rank, freed = ASK_RECORD.unpack(raw)
    if kind not in iter(AskKind) or status not in iter(Got) or (freed and kind != GOT):
        raise OutOfStepError(
            f"a receiver message of kind {kind}, status {status}, freed {freed} is no cudarecv ask: "
            "the link is out of step"
        )
    return Ask(AskKind(kind), version, Got(status), rank, freed)


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
        raise OutOfStepError(
            f"a relay trailer of status {status} is no cudarecv trailer: the link is out of step"
        )
    return Trailer(status), version, rank


def checksum(messages: Sequence[Tensor], whole: Tensor | None = None) -> bytes:
    """The 16-byte BLAKE3 digest of a version, computed on its device (see :mod:`cudarecv.cuda.digest`): of
    ``whole``, the one storage its messages cut evenly; else (a leafwise schema) of its ``messages``' digests in
    order, each hashed where it landed."""
    return checksum_pending(messages, whole).value()


def checksum_pending(messages: Sequence[Tensor], whole: Tensor | None = None) -> Pending:
    """:func:`checksum`, started on the current stream: yield its ``work`` (the device's results back on the host,
    one event for every message), then read its ``value()``."""
    from ..cuda.digest import digest_parts_pending

    return digest_parts_pending(
        [whole] if whole is not None else [m.contiguous() for m in messages]
    )


class Answer(IntEnum):
    """The receiver's answer to the handshake: the weights do not match; ok; the receiver failed."""

    REFUSED = 0
    ACCEPTED = 1
    FAILED = 2


REFUSED, ACCEPTED, FAILED = Answer
REASON_BYTES = STATUS_SIZE - 9  # what fits after the magic and status, before the CRC
ANSWER = Record(
    "handshake answer",
    b"CDRN",
    f"B{REASON_BYTES}s",
    size=STATUS_SIZE,
    hint="is the peer a WeightReceiver of this cudarecv version?",
)


def status_message(status: Answer, text: str = "") -> bytes:
    """The receiver's answer to the handshake: a status and a reason (UTF-8, cut to fit), fixed size."""
    return ANSWER.pack(status, text.encode()[:REASON_BYTES].decode(errors="ignore").encode())


def read_status(raw: bytes) -> tuple[Answer, str]:
    """``(status, text)``: the reason of a refusal or failure; for ``ACCEPTED``, the receiver's :func:`host_id`.
    Raises :class:`OutOfStepError` if ``raw`` is no answer (its length, magic, CRC or status is off)."""
    status, reason = ANSWER.unpack(raw)
    if status not in iter(Answer):
        raise OutOfStepError(
            f"the handshake's answer of status {status} is not a cudarecv WeightReceiver's: "
            "is the peer one of this cudarecv version?"
        )
    return Answer(status), reason.rstrip(b"\x00").decode(errors="replace")


PREAMBLE = Record(
    "weight-sync handshake",
    b"CDRH",
    "IQQIII",
    crc=False,
    hint="is the peer a WeightSender of this cudarecv version?",
)
PREAMBLE_SIZE = PREAMBLE.size
PREAMBLE_FORMAT = 8  # 5: the handshake's answer is a record (magic, CRC); 6: push header format 4; 7: format 5; 8: doorbells


@dataclass(frozen=True)
class Offer:
    """What a preamble announces: the schema's length, the bytes per push message, the mode, the session,
    and the length of the same-host offer that follows the schema (0: none; :mod:`cudarecv.samehost.shared_memory`)."""

    length: int
    bucket_bytes: int
    mode: str
    session: int
    shared: int = 0


def preamble(
    schema_bytes: int, bucket_bytes: int, mode: str, session: int = 0, shared: int = 0
) -> bytes:
    """The handshake's first message (see :class:`Offer`)."""
    return PREAMBLE.pack(
        PREAMBLE_FORMAT, schema_bytes, bucket_bytes, MODES.index(mode), session, shared
    )


def read_preamble(raw: bytes) -> Offer:
    """The :class:`Offer` of a received preamble; raises :class:`OutOfStepError` if the peer is no
    weight sender of this version (the lengths are the receiver's to check: :func:`check_offer`)."""
    fmt, length, bucket_bytes, mode, session, shared = PREAMBLE.unpack(raw)
    if fmt != PREAMBLE_FORMAT or mode >= len(MODES) or session >= SESSIONS:
        raise OutOfStepError(
            f"a weight-sync handshake of format {fmt}, mode {mode}, session {session} is not this "
            f"cudarecv version's: {PREAMBLE.hint}"
        )
    return Offer(length, bucket_bytes, MODES[mode], session, shared)


def check_offer(length: int, bucket_bytes: int) -> None:
    """The lengths a preamble announces must be plausible before anything is sized from them."""
    if not 0 < length <= MAX_SCHEMA_BYTES or not 0 < bucket_bytes <= MAX_BYTES:
        raise SchemaError(
            f"the handshake announces a schema of {length} bytes and {bucket_bytes}-byte messages: "
            "out of range"
        )
