"""The same-host transport's own records: the receiver's words back (ANSWER to an offer, DONE with a transfer)
and the sender's READY (its payload is in the segment). Fixed structs with a magic and a CRC, checked before a
field is used; a record that is not one makes the link out of step.
"""

from __future__ import annotations

import struct
import zlib
from enum import IntEnum

from ..core.errors import OutOfStepError

_BACK = struct.Struct("<4sHHQ")  # magic, kind, status, the transfer number it is about
BACK_SIZE = 32
_READY = struct.Struct("<4sIQQQ")  # magic, message index, transfer number, offset, length
READY_SIZE = 48


class Word(IntEnum):
    """What a receiver's word back is."""

    ANSWER = 0  #: to an offer: did it map the segments
    DONE = 1  #: with a transfer: it read the segment (or the sender's storage or memory), which may be written again


class Status(IntEnum):
    """A word's status."""

    OK = 0  #: mapped (ANSWER) or read (DONE)
    NO = 1  #: never on this link direction (another machine or user, a receiver on the wire), or not read (DONE)
    DIRECT = 2  #: OK, and the receiver reads the sender's host leaves and storages itself
    DIRECT_STORAGES = 3  #: OK, and the receiver reads the sender's consolidated host storages itself
    NO_NOW = 4  #: not these segments (they could not be opened now: memory, descriptors): offer again later


def _sealed(body: bytes, size: int) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body)) + bytes(size - len(body) - 4)


def _opened(raw: bytes, record: struct.Struct, magic: bytes, what: str) -> tuple:
    (crc,) = struct.unpack_from("<I", raw, record.size)
    fields = record.unpack_from(raw)
    if fields[0] != magic or zlib.crc32(raw[:record.size]) != crc:
        raise OutOfStepError(f"the message is no cudarecv {what} (bad magic or checksum): the link is out of step")
    return fields[1:]


def back(word: Word, status: Status, seq: int) -> bytes:
    """A receiver's word back about transfer ``seq``."""
    return _sealed(_BACK.pack(b"CDRB", word, status, seq), BACK_SIZE)


def read_back(raw: bytes, word: Word, seq: int) -> Status:
    """The status of the word back in ``raw`` (at least :data:`BACK_SIZE` bytes; more must be zeros), checked to be
    ``word`` about transfer ``seq``; raises :class:`OutOfStepError` otherwise."""
    if any(raw[BACK_SIZE:]):
        raise OutOfStepError("the receiver's same-host message is longer than its 32 bytes: out of step")
    got, status, got_seq = _opened(raw[:BACK_SIZE], _BACK, b"CDRB", "same-host answer")
    if (got, got_seq) != (word, seq) or status not in Status._value2member_map_:
        raise OutOfStepError(f"the receiver's same-host message is kind {got} (status {status}) for transfer "
                             f"{got_seq}, expected kind {int(word)} for {seq}: the link is out of step")
    return Status(status)


def ready(seq: int, total: int) -> bytes:
    """The sender's READY: every byte of transfer ``seq`` (``total`` of them) is in its segment."""
    return _sealed(_READY.pack(b"CDRP", 0, seq, 0, total), READY_SIZE)


def read_ready(raw: bytes, seq: int, total: int) -> None:
    """Check the READY in ``raw`` against the plan (transfer ``seq``, ``total`` bytes); raises
    :class:`OutOfStepError` for anything else."""
    if any(raw[READY_SIZE:]):
        raise OutOfStepError("a READY message is longer than its 48 bytes: the link is out of step")
    got = _opened(raw[:READY_SIZE], _READY, b"CDRP", "READY message")
    want = (0, seq, 0, total)
    if tuple(got) != want:
        raise OutOfStepError(f"READY message 0 names (index, transfer, offset, length) {tuple(got)}, "
                             f"the plan {want}: not read; the link is out of step")
