"""A doorbell between a weight sender and a receiver on its machine: the per-version header and the receiver's word
on it through a small shared page, each woken by a futex, instead of two gloo messages.

A push to a receiver that reads the sender's shared snapshot (:mod:`cudarecv.weights.transports.shared_memory`)
sends nothing but a header, and the receiver answers with a word (GOT). On gloo each of those is a message: the
sender's send, gloo's socket thread in the receiver, the thread waiting on the receive, and back the same way, a
wake-up of a thread (a scheduler slice on a loaded machine) at every step. Through the doorbell the sender writes
the header into the page and wakes the one thread that waits for it, which copies the version out and writes its
word back the same way: one wake-up each way, no socket.

The receiver makes the page (a :class:`~cudarecv.samehost.shared_memory.Segment`: anonymous, sealed, with a nonce)
and offers it in its handshake answer; the sender maps it read-write. Its words:

==============  =========  ==========================================================================
word            written by what
==============  =========  ==========================================================================
``DOWN_SEQ``    sender     how many headers it rang
``DOWN``        sender     the last header rung (written before ``DOWN_SEQ`` moves: an ordered store)
``DOWN_WAKE``   both       the futex the receiver sleeps on: moved by a ring, and by the receiver's own
                           thread that heard the link speak
``UP_SEQ``      receiver   how many words it answered
``UP``          receiver   its last word
``UP_WAKE``     both       the futex the sender sleeps on: moved by a word, and by the sender's listener
                           that found the receiver gone
``TAKEN``       sender     how many of the receiver's words on the link (all but latest mode's ASK) its
                           listener has read: the receiver lets go of those sends (:class:`~cudarecv.weights.link.Unanswered`)
==============  =========  ==========================================================================

A sleeper reads its wake word, looks whether what it waits for came, and sleeps only while the word still holds
what it read: a wake that comes in between is never lost. Both writers of a wake word add to it atomically, so
neither's move is lost; a sleeper also looks again by itself every so often.

One header is rung at a time: the sender rings the next only once the receiver's word on the last one came (or it
dropped the receiver), so a slot each way is enough. Both ends check what they read (a header's and a word's
magic and CRC); a peer that dies is found by the gloo link beside the doorbell (the sender's listener, the
receiver's standing header receive), which wakes the sleeper. Everything here needs the native build (its ordered
stores and loads) and futexes; :func:`available` says why not.
"""

from __future__ import annotations

import ctypes
import os
import threading

from ..core.errors import OutOfStepError
from ..core.host_copy import NATIVE, bump, observe, publish, swap_if
from . import shared_memory as host

# (offsets in the segment's payload: each side's words on cache lines of their own)
DOWN_SEQ, DOWN_WAKE, DOWN = 0, 8, 64
UP_SEQ, UP_WAKE, UP = 192, 200, 256
TAKEN, LATEST = 384, 392
ASKED = 448
SLOT = 128  # the most bytes a header or a word takes
CAPACITY = 512
_LOW = 0xFFFFFFFF  # a futex is the low 32 bits of its 8-byte word (little-endian)


def available() -> str | None:
    """Why no doorbell can ring here, or None."""
    if not NATIVE:
        return "cudarecv's native build is missing (its ordered stores and loads)"
    if not host.futexes():
        return f"futexes are not known on {os.uname().machine}"
    return host.available()


class _Page:
    """The words of one doorbell page: the payload of ``mapped`` (a segment or mapping, kept mapped while the page
    is referenced: a thread that wakes a sleeper may still touch it after its owner closed)."""

    def __init__(self, mapped: host.Segment | host.Mapping) -> None:
        self._mapped = mapped
        self._base = mapped.data.data_ptr()

    def load(self, word: int) -> int:
        return observe(self._base + word)

    def store(self, word: int, value: int) -> None:
        publish(self._base + word, value)

    def write(self, at: int, raw: bytes) -> None:
        if len(raw) > SLOT:
            raise ValueError(f"{len(raw)} bytes do not fit a doorbell slot of {SLOT}")
        ctypes.memmove(self._base + at, raw, len(raw))

    def read(self, at: int, n: int) -> bytes:
        return ctypes.string_at(self._base + at, n)

    def sleep(self, word: int, seen: int, timeout: float) -> None:
        """Sleep while ``word`` holds ``seen``, at most ``timeout`` s."""
        host.sleep_on(self._base + word, seen & _LOW, timeout)

    def swap_if(self, word: int, expected: int, desired: int) -> int:
        """:func:`~cudarecv.core.host_copy.swap_if` on ``word``: what it held (``expected``: replaced)."""
        return swap_if(self._base + word, expected, desired)

    def bump(self, word: int) -> None:
        """Move wake word ``word`` and wake whoever sleeps on it (an atomic add: two ends that move it at once
        both move it, so a sleeper that read the word after one of them still wakes)."""
        bump(self._base + word)
        host.wake(self._base + word)


class Mailbox:
    """The receiver's end: it makes the page, offers it, waits for headers and answers them."""

    def __init__(self) -> None:
        self._segment = host.Segment(CAPACITY)
        self._page = _Page(self._segment)
        self._seen = 0  # headers taken

    def offer(self) -> str:
        """What the sender needs to map the page (one line of text, in the handshake's answer)."""
        segment = self._segment
        assert segment.fd is not None, "offered after close"
        return f"bell {os.getpid()} {segment.fd} {segment.nonce.hex()}"

    def rung(self) -> bool:
        """Whether a header came that was not taken yet."""
        return self._page.load(DOWN_SEQ) != self._seen

    def take(self) -> bytes:
        """The header that came (:meth:`rung` said so); unchecked: its parser checks it."""
        seq = self._page.load(DOWN_SEQ)  # (loaded before the header: ordered)
        raw = self._page.read(DOWN, SLOT)
        self._seen = seq
        return raw

    def wakes(self) -> int:
        """The wake word, to read before looking whether a header came (then :meth:`sleep`)."""
        return self._page.load(DOWN_WAKE)

    def sleep(self, wakes: int, timeout: float) -> None:
        """Sleep until a header comes or :meth:`kick` wakes this (the wake word moved from ``wakes``), at most
        ``timeout`` s."""
        self._page.sleep(DOWN_WAKE, wakes, timeout)

    def kick(self) -> None:
        """Wake a thread asleep in :meth:`sleep` (something came by another way: the gloo link)."""
        self._page.bump(DOWN_WAKE)

    def answer(self, raw: bytes) -> None:
        """Say ``raw`` (a word on the header taken) and wake the sender."""
        self._page.write(UP, raw)
        self._page.store(UP_SEQ, self._page.load(UP_SEQ) + 1)
        self._page.bump(UP_WAKE)

    def taken(self) -> int:
        """How many of this receiver's gloo words the sender's listener has read."""
        return self._page.load(TAKEN)

    def ask(self, floor: int) -> bool:
        """Latest mode: ask by the doorbell for a version newer than ``floor``. Whether the ask stands (the push that
        publishes such a version rings its header); False: the sender has published one already (``LATEST``), the
        ask is withdrawn and goes on the link (the sender's listener answers it now). Raises
        :class:`~cudarecv.core.errors.OutOfStepError` if an earlier ask still stands (one pull at a time asks)."""
        page, want = self._page, floor + 1
        held = page.swap_if(ASKED, 0, want)
        if held != 0:
            raise OutOfStepError(
                f"a doorbell ask past version {held - 1} still stands as another is made: out of step"
            )
        if page.swap_if(LATEST, 0, 0) <= floor:  # (a full barrier: after the store above)
            return True
        # withdrawn, unless the sender took it meanwhile
        return page.swap_if(ASKED, want, 0) != want

    def close(self) -> None:
        """Let go of the page's descriptor (the page is unmapped with the last reference to this mailbox; the
        sender keeps its own mapping)."""
        self._segment.close_fd()


class Bell:
    """The sender's end: the receiver's page, mapped read-write from its offer."""

    def __init__(self, offer: str) -> None:
        """Map the page ``offer`` names; raises :class:`~.shared_memory.MappingError` if it cannot."""
        try:
            tag, pid, fd, nonce = offer.split(" ")
            if tag != "bell":
                raise ValueError(tag)
            mapping = host.Mapping(int(pid), int(fd), CAPACITY, bytes.fromhex(nonce), writable=True)
        except ValueError as error:
            raise host.MappingError(f"a doorbell offer {offer!r} is malformed: {error}") from None
        self._page = _Page(mapping)
        self._seen = self._page.load(UP_SEQ)
        self._rung = self._page.load(DOWN_SEQ)
        self._lock = threading.Lock()

    def ring(self, raw: bytes) -> None:
        """Send header ``raw`` and wake the receiver."""
        self._page.write(DOWN, raw)
        self._rung += 1
        self._page.store(DOWN_SEQ, self._rung)
        self._page.bump(DOWN_WAKE)

    def answered(self) -> bool:
        """Whether a word came that :meth:`heard` has not returned yet."""
        return self._page.load(UP_SEQ) != self._seen

    def heard(self) -> bytes | None:
        """The receiver's word that came since the last call, or None (once each, whichever thread asks)."""
        with self._lock:
            seq = self._page.load(UP_SEQ)
            if seq == self._seen:
                return None
            self._seen = seq
            return self._page.read(UP, SLOT)

    def wakes(self) -> int:
        """The wake word, to read before looking whether a word came (then :meth:`sleep`)."""
        return self._page.load(UP_WAKE)

    def sleep(self, wakes: int, timeout: float) -> None:
        """Sleep until the receiver answers or :meth:`kick` wakes this (the wake word moved from ``wakes``), at
        most ``timeout`` s."""
        self._page.sleep(UP_WAKE, wakes, timeout)

    def kick(self) -> None:
        """Wake a thread asleep in :meth:`sleep` (the listener found the receiver gone, or leaving)."""
        self._page.bump(UP_WAKE)

    def took(self, count: int) -> None:
        """Say that the listener has read ``count`` of the receiver's gloo words."""
        self._page.store(TAKEN, count)

    def say_latest(self, version: int) -> None:
        """Latest mode, under the sender's lock: say that ``version`` is the newest published (a full barrier)."""
        page = self._page
        # (only this end changes it: the receiver's look, a swap of 0 for 0, leaves it as it was)
        page.swap_if(LATEST, page.swap_if(LATEST, 0, 0), version)

    def published(self, version: int) -> int | None:
        """Latest mode, under the sender's lock: say that ``version`` is the newest published, then take the
        receiver's ask if it asked for a version older than it. The floor of the ask taken (the push answers it by
        this doorbell), or None."""
        self.say_latest(version)
        page = self._page
        asked = page.swap_if(ASKED, 0, 0)  # (a full barrier: after the store above)
        if asked == 0 or asked - 1 >= version or page.swap_if(ASKED, asked, 0) != asked:
            return None  # no ask, one past a version not published yet (sharded), or withdrawn just now
        return asked - 1
