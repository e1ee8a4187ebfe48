"""What a weight sender's mechanisms share: its :class:`Session` (schema, tags, lock, settings, version) and its
view of each receiver (:class:`Member`), whose lifecycle is :class:`Standing` and its table :data:`MOVES`."""

from __future__ import annotations

import enum
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.driver import Driver
from ..core.errors import UsageError
from ..core.lifecycle import Lifecycle
from ..wire.staging import Lane
from .options import Fanout, Mode
from .schema import Schema
from .transports.base import Transport
from .transports.registry import WIRE
from .wire import LANDED, Ask, SessionTags

if TYPE_CHECKING:
    from ..core.transfer import Transfer
    from ..samehost.doorbell import Bell
    from .snapshots import Snapshot


class Standing(enum.Enum):
    """Where a receiver stands with its sender (the sender's view; docs/design.md draws :data:`MOVES`)."""

    #: its handshake answered, not served yet (a joiner's admission may still let go of it)
    ENROLLED = "enrolled"
    #: every push goes to it (latest mode: every reply it asks for)
    SERVED = "served"
    #: it said BYE: nothing new is sent to it; the sender's RELEASED follows what is in flight to it
    LEAVING = "leaving"
    #: the sender said CLOSED (its close()); the receiver's BYE, in answer, still to come. Counted as served:
    #: it got every version up to the close
    CLOSING = "closing"
    #: both last words said (its BYE and the sender's RELEASED or CLOSED): nothing is left posted for it
    DONE = "done"
    #: dropped for a failure (its link died, it lied, timed out or stopped beating) that no push's error named
    DROPPED = "dropped"
    #: dropped for a failure, and a push's error (or its future's) named it to the caller
    NAMED = "named"


#: the moves a receiver's standing may make; a failure drops a receiver until the sender's last word is said
MOVES: dict[Standing, frozenset[Standing]] = {
    Standing.ENROLLED: frozenset({Standing.SERVED}),
    Standing.SERVED: frozenset(
        {Standing.LEAVING, Standing.CLOSING, Standing.DROPPED, Standing.NAMED}
    ),
    # (a push still in flight to it may fail: dropped)
    Standing.LEAVING: frozenset({Standing.DONE, Standing.DROPPED, Standing.NAMED}),
    Standing.CLOSING: frozenset({Standing.DONE}),
    Standing.DROPPED: frozenset({Standing.NAMED}),
}

#: the standings a push and a reply go to
SERVED = frozenset({Standing.SERVED, Standing.CLOSING})
#: dropped for a failure, named or not: its threads may wait on its link for good
FAILED = frozenset({Standing.DROPPED, Standing.NAMED})
#: the sender's last word (CLOSED or RELEASED) still to say
OWED = frozenset({Standing.SERVED, Standing.LEAVING})
#: what a receiver that is no longer served says, once it has closed (rather than failed)
CLOSED_BY_RECEIVER = "closed by its receiver"


class Member:
    """The sender's view of one receiver: its lane, its driver, where it stands (:class:`Standing`, changed by
    :meth:`move` alone) and, per version, what it asked, said and holds."""

    def __init__(
        self, lane: Lane, host: str = "", ident: int | None = None, pid: int | None = None
    ) -> None:
        self._lane: Lane | None = lane  # (None once let go of: :meth:`let_go`)
        #: its rank in the group, or (a receiver that joined through a store) its number among the joins
        self.rank = lane.link.peer if ident is None else ident
        self.host, self.pid = host, pid
        #: how errors and the log name it
        self.who = (
            f"rank {self.rank}" if ident is None else f"receiver {ident} (host {host}, pid {pid})"
        )
        self.driver = Driver(f"cudarecv-push-{self.rank}")
        self._standing = Lifecycle(self.who, Standing.ENROLLED, MOVES)
        self._failure: str | None = None  # the failure that dropped it (DROPPED, NAMED)
        #: latest mode: it wants a version newer than this
        self.asked: int | None = None
        #: latest mode: a reply to it is on its driver (one at a time; it may ask again meanwhile)
        self.replying = False
        self.listener: threading.Thread | None = None
        #: relay, shared memory, delta: the receiver's last word on a version (GOT)
        self.got: Ask | None = None
        #: the bytes of the last push's payload to it (a patch's, the version's; 0: a header alone)
        self.payload = 0
        #: what carries its pushes: the session's transport if it took the offer (and no relay chain needs it on
        #: the wire), else the wire
        self.transport: Transport = WIRE
        #: zero-copy: it publishes the versions where they lie in the segments
        self.alias = False
        #: zero-copy: the snapshot of each version it may still read
        self.holding: dict[int, Snapshot] = {}
        #: the last transfer of a version to it (a push's or a reply's): failed at once when its listener finds
        #: the link dead, so that no push waits its whole timeout on a send to a dead receiver
        self.sending: Transfer | None = None
        #: a non-blocking push of this version to it, a header alone, waits for its word: its listener drives that
        #: transfer to its end on the word (no thread hands it on; see :func:`~.serving.answered`)
        self.awaiting: int | None = None
        #: shared memory: the doorbell it offered, mapped (None: none; :mod:`cudarecv.samehost.doorbell`)
        self.bell: Bell | None = None
        #: its doorbell rings: a push's header said so on the link, and its word on that push came
        self.rings = False

    @property
    def held(self) -> int | None:
        """Delta: the version its last word said it published (None: none known, or it did not publish the version
        its word was on: its next push is whole)."""
        got = self.got
        return got.version if got is not None and got.status == LANDED else None

    @property
    def lane(self) -> Lane:
        """Its lane, until the sender's close lets go of it."""
        if self._lane is None:
            raise UsageError(f"the weight sender closed: {self.who} has no link any more")
        return self._lane

    def let_go(self) -> None:
        """At the sender's close: let go of its lane and last transfer (a process group kept alive past
        destroy_process_group() by objects in reference cycles is destroyed at interpreter exit, where gloo aborts
        the process)."""
        self._lane, self.sending, self.bell = None, None, None

    # -- its lifecycle -----------------------------------------------------------------------------------
    @property
    def standing(self) -> Standing:
        return self._standing.state

    def move(self, to: Standing, why: str | None = None) -> Standing:
        """The one way a receiver's standing changes; ``why`` the failure that drops it (DROPPED, NAMED).
        Returns the standing left; :class:`~cudarecv.core.lifecycle.IllegalMove` if :data:`MOVES` has no such
        move (a bug)."""
        self._note(to, why)
        return self._standing.move(to)

    def move_if(
        self, to: Standing, frm: Collection[Standing] | None = None, why: str | None = None
    ) -> bool:
        """:meth:`move` where threads race (a listener that finds the link dead, a push that fails, the last
        word): moves only if :data:`MOVES` allows it from where it stands (one of ``frm``, if given)."""
        self._note(to, why)
        return self._standing.move_if(to, frm=frm)

    def _note(self, to: Standing, why: str | None) -> None:
        """Before a move to a failed standing: its failure, the first one named (read only once failed, so a
        move refused leaves nothing to see, and no reader of a failed member finds none)."""
        if to in FAILED and self._failure is None:
            self._failure = why or f"{self.who} failed"

    @property
    def served(self) -> bool:
        """Pushes (and replies) go to it."""
        return self.standing in SERVED

    @property
    def failed(self) -> bool:
        """Dropped for a failure (not told the sender's last word): its threads may wait on its link for good."""
        return self.standing in FAILED

    @property
    def ended(self) -> bool:
        """No longer served and nothing left to tell it: it failed, or both last words were said."""
        return self.standing in FAILED or self.standing is Standing.DONE

    @property
    def why(self) -> str | None:
        """Why it is no longer served (None: it is): the failure that dropped it, or that it closed."""
        if self.standing in FAILED:
            return self._failure
        return None if self.served or self.standing is Standing.ENROLLED else CLOSED_BY_RECEIVER


@dataclass
class Session:
    """A sender's state that its mechanisms (snapshots, fan-out, serving, drops) share; guarded by ``cond``."""

    schema: Schema
    bucket_bytes: int
    tags: SessionTags
    timeout: float
    verify: bool
    mode: Mode
    fanout: Fanout
    #: where the snapshots lie, offered to every receiver (the wire: the sender's own)
    transport: Transport
    cond: threading.Condition = field(default_factory=threading.Condition)
    members: list[Member] = field(default_factory=list)
    version: int = 0
    chain: list[int] = field(
        default_factory=list
    )  # the ranks (ids) of the last push's relay chain, in order
    #: the ranks (ids) that got the last blocking sync push, whole and checked (None: no such push yet)
    reached: list[int] | None = None
    closed: bool = False
    #: receivers join and leave through a store: a push never raises for one that failed (it is dropped and
    #: logged), and one with no receiver at all is no error
    elastic: bool = False
    #: pushes on the wire send what changed since the version each receiver holds (:mod:`.delta`)
    delta: bool = False

    def ranks(self) -> list[int]:
        """The ranks of the receivers still served."""
        return [m.rank for m in self.members if m.served]

    def held(self) -> list[tuple[int, int]]:
        """Under the lock: (rank, version) of every snapshot a zero-copy receiver holds."""
        return sorted({(m.rank, v) for m in self.members for v in m.holding})
