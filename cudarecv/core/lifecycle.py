"""Lifecycles as state machines: an ``enum`` of states and the moves allowed between them, in one place.

A thing with a lifecycle (a receiver as its sender sees it, a same-host channel, a joined receiver's
membership) keeps its state in a :class:`Lifecycle`: the only way to change the state is :meth:`Lifecycle.move`,
which refuses a move its table does not list (:class:`IllegalMove`, a bug in cudarecv, never the user's). The
table is the lifecycle's whole description: :func:`mermaid` writes it as the state diagram that
docs/design.md shows, and a test checks that the page and the table agree.

Example:
    >>> import enum
    >>> class Door(enum.Enum):
    ...     OPEN = "open"
    ...     SHUT = "shut"
    >>> MOVES = {Door.OPEN: {Door.SHUT}, Door.SHUT: {Door.OPEN}}
    >>> door = Lifecycle("door", Door.SHUT, MOVES)
    >>> door.move(Door.OPEN)
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Collection, Mapping
from typing import Generic, TypeVar

from .errors import Error

S = TypeVar("S", bound=enum.Enum)

#: the moves allowed out of each state (a state with no entry, or an empty one, is final)
Moves = Mapping[S, Collection[S]]


class IllegalMove(Error, RuntimeError):
    """A lifecycle was asked for a move its table does not allow: a bug in cudarecv (please report it)."""

    link_usable = False


class Lifecycle(Generic[S]):
    """The state of one thing (``what`` names it in errors) and the moves its table allows.

    Thread-safe: a move is checked and made under a lock, so two threads that race to move the same
    thing (a listener that finds the link dead, a push that times out) cannot both leave a state;
    :meth:`move_if` is the race's form (the loser learns it lost, nothing is raised).
    """

    def __init__(self, what: str, initial: S, moves: Moves[S]) -> None:
        self.what = what
        self._moves = moves
        self._state = initial
        self._lock = threading.Lock()

    @property
    def state(self) -> S:
        return self._state

    def allows(self, to: S) -> bool:
        """Whether the table allows moving from the current state to ``to``."""
        return to in self._moves.get(self._state, ())

    def move(self, to: S) -> S:
        """Move to ``to``; return the state left. Raises :class:`IllegalMove` if the table does not allow it."""
        with self._lock:
            was = self._state
            if to not in self._moves.get(was, ()):
                raise IllegalMove(
                    f"{self.what}: no move from {was.name} to {to.name} "
                    f"(allowed: {', '.join(s.name for s in self._moves.get(was, ())) or 'none, final'})"
                )
            self._state = to
            return was

    def move_if(self, to: S, *, frm: Collection[S] | None = None) -> bool:
        """Move to ``to`` if the table allows it (and the state is one of ``frm``, when given); return whether
        it moved. For moves that race (two threads ending the same thing): the loser does nothing."""
        with self._lock:
            if frm is not None and self._state not in frm:
                return False
            if to not in self._moves.get(self._state, ()):
                return False
            self._state = to
            return True

    def __repr__(self) -> str:
        return f"Lifecycle({self.what!r}, {self._state.name})"


def mermaid(moves: Moves[S], initial: S) -> str:
    """The table as a mermaid ``stateDiagram-v2`` block's body (one line per move, sorted), as docs/design.md
    shows it: ``[*] --> INITIAL`` first, final states ``--> [*]``."""
    lines = [f"[*] --> {initial.name}"]
    states = {initial, *moves, *(t for targets in moves.values() for t in targets)}
    for state in sorted(states, key=lambda s: s.name):
        targets = moves.get(state, ())
        lines += sorted(f"{state.name} --> {t.name}" for t in targets)
        if not targets:
            lines.append(f"{state.name} --> [*]")
    return "\n".join(lines)
