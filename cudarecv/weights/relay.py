"""Relay fan-out, the receiver's part: a push's chunks forwarded to the next receiver as they land.

With ``WeightSender(..., fanout="relay")`` the sender sends each push's payload
to the first receiver of a chain only; every receiver receives chunk i from the
hop before it while it forwards chunk i - 1 to the hop after it, so every host
sends and receives the model about once, whatever the number of receivers.
Each push's header (from the sender, to every receiver) names the two hops.

On each hop the chunks are followed by a *trailer*: ``INTACT``, or ``BROKEN``
naming the rank that failed upstream. A receiver whose upstream link fails
mid-push still sends the hop after it the chunks it owes (whatever its buffer
holds) and a ``BROKEN`` trailer, so every receiver downstream of a dead one
learns at once which rank failed, with its links in step. A receiver publishes
a version only once its own trailer says ``INTACT`` and its own checks passed.

:class:`Relay` tracks one push through this receiver: the pull's protocol
calls :meth:`Relay.landed` for each chunk (on the thread that receives), and
:meth:`Relay.forward` is the protocol that sends them on, on a thread of its
own (the receiver's forwarder), so forwarding goes on whatever the receiver's
caller does once ``pull()`` has returned.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch
from torch import Tensor

from ..core import streams
from ..wire.control import wire_bytes
from ..wire.staging import Lane, send_from
from .wire import BROKEN, INTACT, trailer_message


class Relay:
    """One push's chunks on their way through this receiver to ``down`` (see the module docstring)."""

    def __init__(self, down: Lane, pieces: Sequence[Tensor], tag: int, trailer_tag: int, version: int) -> None:
        self.down = down
        self.pieces = pieces
        self.tag, self.trailer_tag, self.version = tag, trailer_tag, version
        self._cond = threading.Condition()
        self._events: list[Any] = []  # per landed chunk: the CUDA event after which it is there (or None)
        self._broken: int | None = None  # the rank that failed upstream, once known
        self._ended = False

    def landed(self, i: int) -> None:
        """Chunk ``i`` is in its piece (called in order, on the stream that wrote it, if any)."""
        stream = self.down.stream
        event = streams.record(torch.cuda.current_stream(stream.device)) if stream is not None else None
        with self._cond:  # the receive lands chunks in order: the i-th call is chunk i
            self._events.append(event)
            self._cond.notify_all()

    def end(self, broken: int | None = None) -> None:
        """Every chunk has landed (``broken=None``), or the push failed upstream at rank ``broken``."""
        with self._cond:
            self._ended = True
            if broken is not None and self._broken is None:
                self._broken = broken
            self._cond.notify_all()

    def forward(self) -> Any:
        """The protocol that sends every chunk on as it lands, then the trailer."""
        pending: list[Any] = []
        for i, piece in enumerate(self.pieces):
            yield [_Landed(self, i)]
            with self._cond:
                event = self._events[i] if i < len(self._events) else None
            if event is not None:
                self.down.stream.wait_event(event)  # the chunk's bytes (or a broken push's leftovers)
            works = yield from send_from(self.down, [piece], [self.tag], defer=True)
            pending.extend(works or ())
        yield [_Landed(self, len(self.pieces))]  # the push has ended: intact, or broken upstream
        with self._cond:
            status, rank = (INTACT, -1) if self._broken is None else (BROKEN, self._broken)
        works = yield from send_from(self.down, [wire_bytes(self.down, trailer_message(self.version, status, rank))],
                                     [self.trailer_tag], defer=True)
        pending.extend(works or ())
        if pending:
            yield pending


class _Landed:
    """A work that completes when chunk ``i`` has landed, or the push has ended (``i`` = the
    number of chunks: only then)."""

    def __init__(self, relay: Relay, i: int) -> None:
        self.relay, self.i = relay, i

    def _ready(self) -> bool:
        return self.relay._ended or len(self.relay._events) > self.i

    def is_completed(self) -> bool:
        with self.relay._cond:
            return self._ready()

    def wait(self, timeout: Any = None) -> bool:
        with self.relay._cond:
            self.relay._cond.wait_for(self._ready)  # the pull always ends the relay (landed or broken)
        return True
