"""The one codec of cudarecv's fixed binary records (never pickle): a 4-byte magic, little-endian fields (a
``struct`` format), a CRC32 of both, zero padding to a fixed size. :meth:`Record.unpack` checks all of it, the
length first, before a field is used: the only outcomes for any byte string are the fields or the record's
error (:class:`~cudarecv.core.errors.OutOfStepError` by default), never another exception. What the fields
may hold is each message's own check (its module), done before anything is sized from them.

Example:
    >>> ASK = Record("ask", b"CDRA", "IQii", size=32)
    >>> ASK.unpack(ASK.pack(0, 7, 0, -1))
    (0, 7, 0, -1)
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

from .errors import Error, OutOfStepError

_CRC = struct.Struct("<I")


class Record:
    """A fixed binary record (see the module docstring). ``name`` says what it is in errors; ``crc=False`` for a
    record whose every field is checked anyway (a handshake's preamble); ``error`` is raised for anything else, its
    message ending with ``hint`` (what it means for the link, and the likely fix)."""

    def __init__(
        self,
        name: str,
        magic: bytes,
        fields: str,
        size: int | None = None,
        crc: bool = True,
        error: type[Error] = OutOfStepError,
        hint: str = "the link is out of step",
    ) -> None:
        if len(magic) != 4:
            raise ValueError("a record's magic is 4 bytes")
        self.name, self.magic, self.crc, self.error, self.hint = name, magic, crc, error, hint
        self.fields = struct.Struct("<4s" + fields)
        body = self.fields.size + (_CRC.size if crc else 0)
        self.size = body if size is None else size
        if self.size < body:
            raise ValueError(f"{name}: {self.size} bytes cannot hold its {body}")

    def pack(self, *values: object) -> bytes:
        """The record of ``values`` (the fields after the magic), padded to :attr:`size`."""
        body = self.fields.pack(self.magic, *values)
        if self.crc:
            body += _CRC.pack(zlib.crc32(body))
        return body + bytes(self.size - len(body))

    def unpack(self, raw: bytes | bytearray | memoryview) -> tuple:
        """The fields of ``raw`` after the magic: ``raw`` holds :attr:`size` bytes (more only as zeros: a receive
        buffer's room), the magic, the CRC and zero padding; else :attr:`error` saying the message is none."""
        raw = bytes(raw)
        if len(raw) < self.size:
            raise self.error(
                f"a {self.name} of {len(raw)} bytes is shorter than its {self.size}: {self.hint}"
            )
        if any(raw[self.size :]):
            raise self.error(
                f"a message is longer than the {self.size} bytes of a {self.name}: {self.hint}"
            )
        end = self.fields.size
        if raw[:4] != self.magic or (
            self.crc and _CRC.unpack_from(raw, end)[0] != zlib.crc32(raw[:end])
        ):
            what = "bad magic or checksum" if self.crc else "bad magic"
            raise self.error(f"the message is not a cudarecv {self.name} ({what}): {self.hint}")
        if any(raw[end + (_CRC.size if self.crc else 0) : self.size]):
            raise self.error(f"a {self.name}'s padding is not zeros: {self.hint}")
        return self.fields.unpack_from(raw)[1:]


class Table(Record):
    """A record whose last field is a count of entries (each an ``each`` struct, at most ``most``) that follow it,
    then the CRC of all of it: an offer of segments. No padding: the length is the count's, exactly.

    Example:
        >>> OFFER = Table("offer", b"CDRO", "HI", each="iQ", most=4)
        >>> OFFER.unpack(OFFER.pack(1, entries=[(3, 4096)]))
        ((1,), [(3, 4096)])
    """

    def __init__(
        self,
        name: str,
        magic: bytes,
        fields: str,
        each: str,
        most: int,
        error: type[Error] = OutOfStepError,
        hint: str = "the link is out of step",
    ) -> None:
        super().__init__(name, magic, fields + "I", error=error, hint=hint)
        self.each, self.most = struct.Struct("<" + each), most

    def size_of(self, count: int) -> int:
        """The bytes of a table of ``count`` entries."""
        return self.fields.size + count * self.each.size + _CRC.size

    def pack(self, *values: object, entries: Sequence[tuple] = ()) -> bytes:
        """The table of ``values`` (the fields after the magic, less the count) and ``entries``."""
        body = self.fields.pack(self.magic, *values, len(entries)) + b"".join(
            self.each.pack(*e) for e in entries
        )
        return body + _CRC.pack(zlib.crc32(body))

    def peek(self, raw: bytes) -> tuple | None:
        """The fields of ``raw`` unchecked (to tell which table it is), or None if it is too short to hold them."""
        return self.fields.unpack_from(raw)[1:-1] if len(raw) >= self.fields.size else None

    def unpack(self, raw: bytes | bytearray | memoryview) -> tuple[tuple, list[tuple]]:
        """``(fields, entries)`` of ``raw``, its length checked against the count (at most :attr:`most`) before an
        entry is read, then the magic and CRC; else :attr:`error`."""
        raw = bytes(raw)
        if len(raw) < self.size_of(0):
            raise self.error(
                f"a {self.name} of {len(raw)} bytes is shorter than its {self.size_of(0)}: {self.hint}"
            )
        *values, count = self.fields.unpack_from(raw)
        if count > self.most or len(raw) != self.size_of(count):
            raise self.error(
                f"a {self.name} of {len(raw)} bytes says it holds {count} entries (at most {self.most}): "
                f"{self.hint}"
            )
        end = len(raw) - _CRC.size
        if values[0] != self.magic or _CRC.unpack_from(raw, end)[0] != zlib.crc32(raw[:end]):
            raise self.error(
                f"the message is not a cudarecv {self.name} (bad magic or checksum): {self.hint}"
            )
        entries = [
            self.each.unpack_from(raw, self.fields.size + i * self.each.size) for i in range(count)
        ]
        return tuple(values[1:]), entries
