"""What a transfer's protocol is and may yield besides works: a generator of ``Work``-like objects (see
:mod:`cudarecv.core.transfer`), :class:`StartClock` and :class:`Stage`; and how a transfer keeps its error
without frames."""

from __future__ import annotations

import copy
import traceback
import typing
from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from typing import Any

from .errors import Error


class Work(typing.Protocol):
    """What a protocol yields: torch.distributed's ``Work`` (a posted send or receive) or one of cudarecv's
    own that look like it (:class:`StartClock`, :class:`Stage`, a CUDA event's, a word from a peer)."""

    def is_completed(self) -> bool: ...

    def wait(self, timeout: timedelta = ...) -> bool: ...


#: a transfer's protocol: each step yields the works to see done before the next; it returns the transfer's
#: result (what the caller gets from ``wait()``: the received tensordict, a version, None for a send)
Protocol = Generator[Sequence[Work], None, Any]
#: rewrites a transfer's error (e.g. to name the peer); gets the error and the seconds since the start
ErrorHook = Callable[[BaseException, float], BaseException]
#: hands a job to a thread its owner keeps (e.g. one per peer)
Submit = Callable[[Callable[[], None]], None]


class StartClock:
    """A work a protocol yields to start its transfer's own clock now, with ``timeout`` (seconds).

    Until then a transfer created with ``timeout=math.inf`` has no deadline of its own.

    Example:
        >>> header = yield from read_bytes(...)      # may wait for as long as the caller likes
        >>> yield [StartClock(timeout)]              # the payload must come within timeout
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


class Stage:
    """A work a protocol yields to say what it waits for from now on (what its own timeout names).

    Example:
        >>> yield [Stage("drain of a mismatched payload")]  # a timeout then says so, not "the header"
    """

    def __init__(self, what: object) -> None:  # (its str() as it stands when a timeout names it)
        self.what = what

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


def frameless(error: BaseException) -> None:
    """Drop the tracebacks of ``error`` and of every error it was caused by or raised during; one not
    cudarecv's (a bug, gloo's) keeps where it was raised as a note, in text."""
    todo, seen = [error], set()
    while todo:
        item = todo.pop()
        if item is not None and id(item) not in seen:
            seen.add(id(item))
            if (
                item.__traceback__ is not None
                and not isinstance(item, Error)
                and hasattr(item, "add_note")
            ):
                frames = "".join(traceback.format_tb(item.__traceback__))
                item.add_note(f"raised at (in cudarecv's transfer):\n{frames}")
            item.__traceback__ = None
            todo += [e for e in (item.__cause__, item.__context__) if e is not None]


def again(error: BaseException) -> BaseException:
    """A copy of a transfer's stored ``error`` to raise (its type, message, attributes, cause and context),
    so the stored one never takes on the frames it is raised through."""
    again = copy.copy(error)
    again.__cause__, again.__context__ = error.__cause__, error.__context__
    again.__suppress_context__ = error.__suppress_context__
    return again
