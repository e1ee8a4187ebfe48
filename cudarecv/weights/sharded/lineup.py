"""Which sender ranks a sharded pull asks next, and for which version (:class:`Lineup`): how a receiver gets one
version from every sender rank, also when it takes longer than a trainer step.

Each sender rank is a plain latest-mode sender: asked for a version newer than ``f`` (its *floor*), it answers
with its newest at once if that is past ``f``, else at the moment it publishes one. A receiver publishes only a
version that every rank's pieces have, so it asks in *rounds* (every rank of a round asked at one moment, each on
its own thread) until they agree:

1. **First round**: every rank, for a version newer than the one published. Ranks that push in step (an FSDP2
   trainer's) answer the same version unless a push fell between the moments they answered.
2. **Catch up**: the ranks behind the newest version seen, ``top``, for ``top`` or newer (floor ``top - 1``);
   not the ranks that hold it. A rank that was really behind (it had not published ``top`` yet) answers ``top``
   as it publishes it, and they agree: all a receiver faster than a trainer step needs.
3. **Fresh rounds**: a rank asked to catch up answered past ``top``: the trainers moved on while this receiver
   took a round, so asking the ranks behind again would bring each one's newest, ahead of the others' again,
   for as long as the trainers push (the pull this replaces did that, and never ended while they pushed). So
   every rank is asked again, at one moment, for ``top`` or newer: the ranks that hold ``top`` too, which send it
   again if they have nothing newer. The answers are the ranks' newest versions at one moment, which agree unless
   a push fell between them, and, once the trainers stop, their last version. Rounds go on so until they agree.

Only versions that a rank has been seen to hold are asked for, never one past them: a trainer that stops pushing
never leaves a pull waiting for a version that does not come. The price: a round of the ranks' newest versions
misses when a push falls between the moments they answer (ranks that push within ``d`` s of each other, every
``s`` s: about ``d / s`` of the rounds), and a receiver whose asks never reach the ranks at one moment gets no
version while they push (each pull still returns in time: ``WaitTimeout``, the pull going on).

Not chosen: asking a rank for exactly the version another sent (a sender rank answers with its newest; its older
snapshot buffers are rewritten within a step or two, and an ask cannot name one), and asking every rank for a
version none has reached yet (each would answer as it publishes it, so all alike however slow the receiver, but
trainers that stop before that version would leave the pull waiting for good, their last version never taken).

A rank that cannot take the version it holds again (a zero-copy receiver of a sender rank on this machine: that
version lies in the sender's snapshot) is not asked in a fresh round while it holds ``top``; its pulls are
copies of a header, far shorter than a trainer step, so catching up serves it. Sync mode only ever catches up:
every rank sends every version, in order.

Example:
    >>> lineup = Lineup(published=4, latest=True, retake={0, 1})
    >>> lineup.first([4, 4])          # index of the sender rank's receiver -> the floor it is asked past
    {0: 4, 1: 4}
    >>> lineup.next([7, 8])           # rank 0 is behind: ask it for 8 or newer
    {0: 7}
    >>> lineup.next([11, 8])          # it answered 11: the trainers move on faster than a round: ask both afresh
    {0: 10, 1: 10}
    >>> lineup.next([15, 15])         # both answered their newest, 15: publish 15
    {}
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


class Lineup:
    """The rounds of one sharded pull (see the module docstring): :meth:`first`, then :meth:`next` after each round
    with the version each sender rank's receiver holds, until it returns ``{}`` (they hold one version newer than
    ``published``). ``latest``: latest mode (fresh rounds may follow); ``retake``: the indices of the receivers
    that may take the version they hold again (not zero-copy)."""

    def __init__(self, published: int, latest: bool, retake: Collection[int]) -> None:
        self.published = published
        self._latest, self._retake = latest, frozenset(retake)
        #: the last round's asks: the index of a sender rank's receiver -> the floor it was asked past
        self.floors: dict[int, int] = {}
        self.rounds = 0
        #: ``"first"``, ``"catch up"`` or ``"fresh"``: what the last round was
        self.phase = "first"

    def first(self, held: Sequence[int]) -> dict[int, int]:
        """The first round's asks, ``held`` being the version each sender rank's pieces in the spare buffer have
        (the published one, or newer where a pull that failed left pieces)."""
        goal = max(max(held), self.published + 1)
        return self._asking("first", {i: goal - 1 for i, v in enumerate(held) if v < goal})

    def next(self, held: Sequence[int]) -> dict[int, int]:
        """The next round's asks after the last round landed (``held`` as for :meth:`first`); ``{}`` once every
        sender rank holds one version newer than the published one."""
        top = max(held)
        if min(held) == top > self.published:
            self.floors = {}
            return {}
        if self.phase == "first" or not self._latest:
            return self._asking("catch up", {i: top - 1 for i, v in enumerate(held) if v < top})
        # a rank asked to catch up (or afresh) answered past what the others hold: the trainers push faster than
        # this receiver takes a round, so every rank is asked at one moment, the ones holding `top` too
        return self._asking(
            "fresh", {i: top - 1 for i, v in enumerate(held) if v < top or i in self._retake}
        )

    def _asking(self, phase: str, floors: dict[int, int]) -> dict[int, int]:
        self.phase, self.floors = phase, floors
        self.rounds += 1
        return floors
