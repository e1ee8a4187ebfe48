"""The same-host transport's own records (:class:`~cudarecv.core.records.Record`): the receiver's words back
(ANSWER to an offer, DONE with a transfer) and the sender's READY (its payload is in the segment); a record that
is not one makes the link out of step.
"""

from __future__ import annotations

from enum import IntEnum

from ..core.errors import OutOfStepError
from ..core.records import Record

BACK = Record(
    "same-host answer", b"CDRB", "HHQ", size=32
)  # kind, status, the transfer number it is about
BACK_SIZE = BACK.size
READY = Record(
    "READY message", b"CDRP", "IQQQ", size=48
)  # message index, transfer number, offset, length
READY_SIZE = READY.size


class Word(IntEnum):
    """What a receiver's word back is."""

    ANSWER = 0  #: to an offer: did it map the segments
    DONE = 1  #: with a transfer: it read the segment (or the sender's storage or memory), which may be written again


class Status(IntEnum):
    """A word's status."""

    OK = 0  #: mapped (ANSWER) or read (DONE)
    NO = 1  #: never on this link direction (another machine or user, a receiver on the wire), or not read (DONE)
    DIRECT = 2  #: OK, and the receiver reads the sender's host leaves and storages itself
    DIRECT_STORAGES = (
        3  #: OK, and the receiver reads the sender's consolidated host storages itself
    )
    NO_NOW = 4  #: not these segments (they could not be opened now: memory, descriptors): offer again later


def back(word: Word, status: Status, seq: int) -> bytes:
    """A receiver's word back about transfer ``seq``."""
    return BACK.pack(word, status, seq)


def read_back(raw: bytes, word: Word, seq: int) -> Status:
    """The status of the word back in ``raw`` (at least :data:`BACK_SIZE` bytes; more must be zeros), checked to be
    ``word`` about transfer ``seq``; raises :class:`OutOfStepError` otherwise."""
    got, status, got_seq = BACK.unpack(raw)
    if (got, got_seq) != (word, seq) or status not in Status._value2member_map_:
        raise OutOfStepError(
            f"the receiver's same-host message is kind {got} (status {status}) for transfer "
            f"{got_seq}, expected kind {int(word)} for {seq}: the link is out of step"
        )
    return Status(status)


def ready(seq: int, total: int) -> bytes:
    """The sender's READY: every byte of transfer ``seq`` (``total`` of them) is in its segment."""
    return READY.pack(0, seq, 0, total)


def read_ready(raw: bytes, seq: int, total: int) -> None:
    """Check the READY in ``raw`` against the plan (transfer ``seq``, ``total`` bytes); raises
    :class:`OutOfStepError` for anything else."""
    got = READY.unpack(raw)
    want = (0, seq, 0, total)
    if tuple(got) != want:
        raise OutOfStepError(
            f"READY message 0 names (index, transfer, offset, length) {tuple(got)}, "
            f"the plan {want}: not read; the link is out of step"
        )
