"""Which sender ranks a sharded pull asks next, and for which version (:class:`Lineup`): how a receiver gets one
version from every sender rank, also when it takes longer than a trainer step.

Each sender rank is a plain latest-mode sender: asked for a version newer than ``f`` (its *floor*), it answers
with its newest at once if that is past ``f``, else at the moment it publishes one (``f + 1``). A receiver
publishes only a version that every rank's pieces have, so it asks in *rounds* (every rank of a round asked at
once, each on its own thread) until they agree:

1. **First round**: every rank, for a version newer than the one published. Asked at one moment, ranks that push
   in step (an FSDP2 trainer) mostly answer the same version.
2. **Catch up**: the ranks behind the newest version seen, ``top``, for a version of at least ``top`` (floor
   ``top - 1``), never the ranks that hold it. A rank that was really behind (it had not published ``top`` yet)
   answers ``top`` as it publishes it: they agree. This is what a receiver faster than a trainer step needs.
3. **Ahead**: if a rank asked to catch up answered past ``top``, the trainers moved on while this receiver took a
   round: asking the ranks behind again would bring each one's newest, ahead of the others' again, for as long as
   the trainers push (the pull this replaces did that). So the next round asks *every* rank for a version none
   of them has reached yet: at least ``top + gap``, ``gap`` the versions the trainers pushed during the last
   round (plus one). Each rank then answers at the moment it publishes that version, so all answer the same one,
   whatever the receiver's speed. A rank already past it answers its newest at once; then ``gap`` doubles (at
   least the last round's advance) and the round is asked again.

Sync mode never needs more than the first two: every rank sends every version in order.

The price of *ahead*: it waits for the trainers' next ``gap`` versions (one round's worth), and if they stop
pushing before that version, the pull waits until they push again or close (``SenderClosed``); the caller's
``pull(timeout=...)`` still returns in time (``WaitTimeout``, the pull goes on).

Example:
    >>> lineup = Lineup(published=4, ahead=True)
    >>> lineup.first([4, 4])          # index of the sender rank's receiver -> floor
    {0: 4, 1: 4}
    >>> lineup.next([7, 8])           # rank 0 is behind: ask it for 8 or newer
    {0: 7}
    >>> lineup.next([11, 8])          # it answered 11: the trainers moved 3 versions in a round
    {0: 14, 1: 14}
    >>> lineup.next([15, 15])         # both answered 15 as they published it: publish 15
    {}
"""

from __future__ import annotations

from typing import Sequence

#: the most versions an *ahead* round may ask beyond the newest seen (a bound on how long it can wait)
MAX_GAP = 1 << 16


class Lineup:
    """The rounds of one sharded pull (see the module docstring): :meth:`first`, then :meth:`next` after each
    round with the version each sender rank's receiver holds, until it returns ``{}`` (they agree on a version
    newer than ``published``). ``ahead``: whether sender ranks are asked past the newest seen (latest mode)."""

    def __init__(self, published: int, ahead: bool) -> None:
        self.published = published
        self._may_go_ahead = ahead
        #: the last round's asks: the index of a sender rank's receiver -> the floor it was asked past
        self.floors: dict[int, int] = {}
        self.rounds = 0
        #: ``"first"``, ``"catch up"`` or ``"ahead"``: what the last round was
        self.phase = "first"
        self._gap = 1
        self._top = published  # the newest version any rank held before the last round

    def first(self, held: Sequence[int]) -> dict[int, int]:
        """The first round's asks, ``held`` being the version each sender rank's pieces in the spare buffer have
        (the published one, or newer where a pull that failed left pieces)."""
        top = max(held)
        goal = max(top, self.published + 1)
        return self._asking("first", top, {i: goal - 1 for i, v in enumerate(held) if v < goal})

    def next(self, held: Sequence[int]) -> dict[int, int]:
        """The next round's asks after the last round landed (``held`` as for :meth:`first`); ``{}`` once every
        sender rank holds one version newer than the published one."""
        top = max(held)
        if min(held) == top > self.published:
            self.floors = {}
            return {}
        if self.phase == "first" or not self._may_go_ahead:
            return self._asking("catch up", top, {i: top - 1 for i, v in enumerate(held) if v < top})
        # a rank asked to catch up (or to wait ahead) answered past what it was asked for: the trainers push
        # faster than this receiver takes a round, so every rank is asked for a version none has reached yet
        advance = top - self._top
        self._gap = min(max(self._gap * 2 if self.phase == "ahead" else 1, advance + 1), MAX_GAP)
        floor = top + self._gap - 1
        return self._asking("ahead", top, {i: floor for i in range(len(held))})

    def _asking(self, phase: str, top: int, floors: dict[int, int]) -> dict[int, int]:
        self.phase, self._top, self.floors = phase, top, floors
        self.rounds += 1
        return floors
