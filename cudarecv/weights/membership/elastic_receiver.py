"""A receiver that joins a named sender through a store: :class:`ElasticReceiver`
(``ElasticReceiver(store, "policy")``).

It finds the sender's newest generation in the store (:mod:`.directory`), takes a join number, forms the gloo
pair with the sender on a prefix of the store and runs a plain :class:`~cudarecv.WeightReceiver` over it. When
that sender goes (it closed, died, was fenced, or dropped this receiver) and a new one takes the name (a
trainer that restarted), the next :meth:`~ElasticReceiver.pull` joins it and goes on; the last version stays
readable meanwhile, and the version published only increases: a version that is not newer than the one held is
never published (:attr:`~ElasticReceiver.td` never goes back to older weights).

A join runs on a thread of its own (within the receiver's ``timeout``): a pull waits for it only as long as its
own ``timeout`` and otherwise raises :class:`~cudarecv.WaitTimeout`, the join going on for the next pull;
``close()`` from another thread ends a wait for a sender at once, and a join that ends after the close is let go
of, never served.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from tensordict import TensorDict

from ...core.checks import check_timeout
from ...core.errors import (
    BrokenError,
    PeerError,
    RelayLost,
    SenderClosed,
    TransferTimeout,
    UsageError,
    WaitTimeout,
)
from ...core.groups import store_group
from ...core.lifecycle import Lifecycle
from ...core.log import logger
from ...core.shutdown import start_thread
from ..options import TransportPolicy, check_options
from ..receiver import WeightReceiver
from .directory import Directory
from .edges import Edges
from .heartbeat import Heartbeat

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed import Store
    from typing_extensions import Self

    from ...core.transfer import Transfer

#: what a pull raises when its sender is gone, after which it looks for a new sender under the name
GONE = (SenderClosed, PeerError, TransferTimeout, BrokenError)
#: the steps of a join that may each take the receiver's ``timeout``: finding the sender, forming the pair, the
#: handshake
JOIN_STEPS = 3


class Membership(enum.Enum):
    """Where a receiver that joins through a store stands with the senders of its name (docs/design.md draws
    :data:`MOVES`)."""

    #: its first join, in the constructor
    JOINING = "joining"
    #: a sender's receiver serves its pulls, no join under way
    JOINED = "joined"
    #: its sender is gone (closed, died, fenced, or dropped it): a join of the newest sender under way
    LOST = "lost"
    #: the generation it tried took no join (it died): waiting for the next one to take the name
    WAITING = "waiting"
    #: the join failed (a pull raised why the last sender is gone): the next pull joins again
    ORPHANED = "orphaned"
    #: closed (by its user, or its constructor failed): a join that ends now is let go of
    CLOSED = "closed"


#: the moves a joined receiver's membership may make
MOVES: dict[Membership, frozenset[Membership]] = {
    Membership.JOINING: frozenset({Membership.JOINED, Membership.CLOSED}),
    Membership.JOINED: frozenset({Membership.LOST, Membership.CLOSED}),
    Membership.LOST: frozenset(
        {Membership.JOINED, Membership.WAITING, Membership.ORPHANED, Membership.CLOSED}
    ),
    Membership.WAITING: frozenset({Membership.JOINED, Membership.ORPHANED, Membership.CLOSED}),
    Membership.ORPHANED: frozenset({Membership.LOST, Membership.CLOSED}),
}


@dataclass
class Joining:
    """A join under way on a thread of its own (:meth:`ElasticReceiver._join`): ``cause`` is why (the last
    sender's failure, or None: the first join); ``error`` what made it fail, once ``done`` is set."""

    cause: BaseException | None
    done: threading.Event
    error: BaseException | None = None
    thread: threading.Thread | None = None


class JoinedReceiver(WeightReceiver):
    """The plain receiver an :class:`ElasticReceiver` runs over its pair with the sender it joined: receiver
    ``ident`` of generation ``generation``, whose links to its neighbours in a relay chain form through the store
    too (:class:`.edges.Edges`)."""

    def __init__(self, group: dist.ProcessGroup, edges: Edges, **options: Any) -> None:
        self._edges = edges  # (before the handshake: the relay's hop is built with it)
        super().__init__(group=group, group_src=0, **options)

    def _relay_links(self) -> Edges:
        return self._edges

    def leave(self, told: bool) -> None:
        """Close it once another join serves (``told``: the sender said it dropped this one, so nobody answers a
        farewell: none is said, and nothing waits for its threads)."""
        self._close(farewell=not told)


class ElasticReceiver:
    """A weight receiver that joins the :class:`~cudarecv.ElasticSender` named ``name`` in ``store``, and joins
    again (its next generation) when that sender is gone (see the module docstring, and docs/weight-sync.md).

    Args:
        store: a ``torch.distributed`` store the sender reaches too (a client of the trainer's ``TCPStore``).
        name: the sender's name in the store.

    Keyword Args:
        device, pin_memory, expect, timeout, stream, transport, zero_copy: as :class:`~cudarecv.WeightReceiver`'s
            (``timeout`` bounds each step of a join too: finding the sender, forming the pair, the handshake).

    Example:
        >>> store = torch.distributed.TCPStore("trainer-host", 29600, is_master=False)
        >>> receiver = cudarecv.ElasticReceiver(store, "policy", expect=policy)
        >>> receiver.pull()              # the newest version (latest mode), or the next push (sync)
        >>> receiver.load_into(policy)
    """

    def __init__(
        self,
        store: Store,
        name: str,
        *,
        device: Any = None,
        pin_memory: bool = False,
        expect: Any = None,
        timeout: float = 60.0,
        stream: Any = None,
        transport: TransportPolicy = "auto",
        zero_copy: bool = False,
    ) -> None:
        self.timeout: float = check_options(timeout=timeout)["timeout"]
        self._directory = Directory(store, name, self.timeout)
        # every join's receiver is built with these
        self._options: dict[str, Any] = dict(
            device=device,
            pin_memory=pin_memory,
            expect=expect,
            stream=stream,
            transport=transport,
            zero_copy=zero_copy,
        )
        self._lock = (
            threading.Lock()
        )  # (the receiver joined, the join under way, closing: one change at a time)
        self._closing = threading.Event()  # (set with CLOSED: it ends a wait for a sender at once)
        self._membership = Lifecycle(f"receiver of {name!r}", Membership.JOINING, MOVES)
        self._current: JoinedReceiver | None = None
        self._previous: JoinedReceiver | None = (
            None  # the last sender's, readable while it holds the newer version
        )
        #: the generation of the sender joined, and this receiver's number among its joins
        self.generation, self.id = 0, 0
        self._dead = 0  # a generation found dead (it took no join): never joined again
        self._joining: Joining | None = None
        #: the last join's thread: it closes the receiver it replaced after pulls go on (close() joins it)
        self._rejoined: threading.Thread | None = None
        self._heartbeat = Heartbeat(self._directory)  # (the sender drops one that stops beating)
        try:
            joining = Joining(None, threading.Event())
            self._join(
                joining, again=False
            )  # (on the caller's thread: nobody can close it before it returns)
            if joining.error is not None:
                raise joining.error
        except BaseException:
            self.close()
            raise

    # -- joining (on a thread of its own) -----------------------------------------------------------------
    def _start_join(self, cause: BaseException | None, again: bool) -> Joining:
        """Start joining the newest sender of the name (``again``: the one joined may still serve, so that one
        included), unless a join is under way already: the join under way."""
        with self._lock:
            if self._joining is None:
                self._membership.move_if(Membership.LOST)  # (closed meanwhile: the join sees it)
                self._joining = Joining(cause, threading.Event())
                self._joining.thread = self._rejoined = start_thread(
                    self._join, f"cudarecv-rejoin-{self._directory.name}", (self._joining, again)
                )
            return self._joining

    def _join(self, joining: Joining, again: bool) -> None:
        """The joining thread: join (see :meth:`_join_newest`); if the generation it tried took no join (it died),
        the next one to come. Its outcome in ``joining``."""
        left: tuple[JoinedReceiver, bool] | None = None
        try:
            try:
                left = self._join_newest(again)
            except (
                TransferTimeout
            ) as error:  # the generation tried took no join: it died; wait for the next one
                if joining.cause is None or not again:
                    raise
                self._membership.move_if(Membership.WAITING, frm={Membership.LOST})
                logger.info(
                    "weight receiver %d of %r: %s; waiting for the next sender",
                    self.id,
                    self._directory.name,
                    error,
                )
                left = self._join_newest(False)
        except BaseException as error:  # noqa: BLE001 - the pull (or the constructor) that waits raises it
            joining.error = error
            self._membership.move_if(Membership.ORPHANED, frm={Membership.LOST, Membership.WAITING})
        finally:
            joining.done.set()
        if left is None:
            return
        try:  # (once pulls go on from the new join: a farewell may take the timeout)
            left[0].leave(told=left[1])
        except Exception as error:  # noqa: BLE001 - its version stays readable; nobody waits for this
            logger.warning(
                "weight receiver %d of %r: closing the join it replaced failed: %s",
                self.id,
                self._directory.name,
                error,
            )

    def _join_newest(self, again: bool) -> tuple[JoinedReceiver, bool] | None:
        """Join the newest sender generation above the one joined (``again``: that one included), each step
        within ``timeout``; then serve from it (under the lock: never after ``close()``). Returns the receiver it
        replaced, for the caller to close, and whether its sender said it dropped that one (None: none left)."""
        directory, timeout = self._directory, self.timeout
        above = self.generation - 1 if again and self.generation != self._dead else self.generation
        generation = directory.current(above, timeout, self._closing)
        beat = directory.sender(generation).timeout  # (its record came first)
        if self._closing.is_set():  # (closed as the sender came: no join asked for)
            raise UsageError("this WeightReceiver was closed while it waited for its sender")
        k = directory.join(generation)
        try:
            group = store_group(
                directory.store,
                directory.pair(generation, k),
                1,
                2,
                timeout,
                f"receiver {k} of weight sender {directory.name!r}: its pair with the sender",
                bounded=True,
            )
        except TransferTimeout:
            self._dead = generation
            raise
        joined = JoinedReceiver(
            group, Edges(directory, generation, k, timeout), timeout=timeout, **self._options
        )
        with self._lock:
            if self.closed:  # (closed while it joined: let go of, never served)
                joined.close()
                raise UsageError("this WeightReceiver was closed while it joined its sender")
            self._membership.move(Membership.JOINED)
            old, self._current = self._current, joined
            self.generation, self.id = generation, k
            if old is not None and old.version > (
                self._previous.version if self._previous is not None else 0
            ):  # (closed too, below: a closed receiver's last version stays readable)
                self._previous = old
        told = self._heartbeat.dropped.is_set()  # (of the join followed so far: ``old``'s)
        self._heartbeat.follow(
            generation, k, beat
        )  # (a store call: not under the lock close() takes)
        logger.info(
            "weight receiver: joined sender %r (generation %d) as receiver %d",
            directory.name,
            generation,
            k,
        )
        return None if old is None else (old, told)  # (its last version stays readable)

    # -- what it is --------------------------------------------------------------------------------------
    @property
    def membership(self) -> Membership:
        """Where it stands with the senders of its name (:class:`Membership`)."""
        return self._membership.state

    @property
    def closed(self) -> bool:
        return self._membership.state is Membership.CLOSED

    schema = property(lambda self: self._joined.schema, doc="The weights' schema.")
    mode = property(
        lambda self: self._joined.mode, doc='The sender\'s mode: ``"sync"`` or ``"latest"``.'
    )
    transport = property(
        lambda self: self._joined.transport, doc="What carries the versions (see WeightReceiver)."
    )
    zero_copy = property(
        lambda self: self._joined.zero_copy, doc="Whether versions are read where they lie."
    )
    arriving = property(
        lambda self: self._joined.arriving, doc="Whether a version has begun to arrive."
    )
    buffer_count = property(
        lambda self: self._readable().buffer_count, doc="See WeightReceiver.buffer_count."
    )

    @property
    def _joined(self) -> WeightReceiver:
        """The receiver of the sender joined last (there is one once the constructor has returned)."""
        if self._current is None:
            raise AssertionError("an ElasticReceiver that never joined")  # a bug: __init__ raised
        return self._current

    def _readable(self) -> WeightReceiver:
        """The receiver whose version is published: the one holding the newer version of the current sender's
        and the last one's (a new sender's versions count only once they are newer)."""
        current, previous = self._joined, self._previous
        return previous if previous is not None and previous.version >= current.version else current

    @property
    def version(self) -> int:
        """The version published (0: none yet); it only increases, across senders of the name too."""
        return self._readable().version

    @property
    def td(self) -> TensorDict:
        """The latest complete version, from the first pull on (the last sender's until the new one's newer
        version lands)."""
        return self._readable().td

    def reading(self) -> contextlib.AbstractContextManager[TensorDict]:
        """Hold the latest version while reading it (see :meth:`WeightReceiver.reading`)."""
        return self._readable().reading()

    def load_into(self, module: torch.nn.Module, strict: bool = True) -> int:
        """Copy the latest version into ``module`` (see :meth:`WeightReceiver.load_into`)."""
        return self._readable().load_into(module, strict)

    # -- pulling -----------------------------------------------------------------------------------------
    @overload
    def pull(self, wait: Literal[True] = ..., timeout: float | None = ...) -> int: ...
    @overload
    def pull(self, wait: bool, timeout: float | None = ...) -> int | Transfer: ...
    def pull(self, wait: bool = True, timeout: float | None = None) -> int | Transfer:
        """:meth:`WeightReceiver.pull`, always of a version newer than the one held (a version lost to a failure
        before this receiver in a relay chain is logged, and the pull waits for the next). When the sender is gone
        (it closed, died, was fenced, or dropped this receiver), join the newest sender of the name (the same one
        again if it still serves, else the next to come within the receiver's ``timeout``) and pull from it; if
        none can be joined, raise why the last one is gone. The whole pull takes at most ``timeout``: a join
        still under way then goes on, and the next pull waits for it. ``wait=False`` returns the joined
        receiver's transfer, no rejoin."""
        if self.closed:
            raise UsageError("this WeightReceiver is closed")
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        if not wait:
            return self._joined.pull(False, timeout)
        deadline = time.monotonic() + timeout
        held = self.version
        while True:
            if self.closed:
                raise UsageError("this WeightReceiver was closed while it pulled")
            left = deadline - time.monotonic()
            joining = self._joining
            if joining is not None:
                self._await(joining, left, timeout)
                continue
            if left <= 0:
                raise WaitTimeout(
                    f"no version newer than {held} from sender {self._directory.name!r} within "
                    f"{timeout:g} s (it joined generation {self.generation} again meanwhile); the next "
                    "pull() goes on waiting"
                )
            if (
                self._heartbeat.said_dropped()
            ):  # (stopped too long, or a transfer to it failed): join again
                self._start_join(
                    PeerError(
                        f"weight sender {self._directory.name!r} dropped receiver {self.id} "
                        "(was its process stopped?)"
                    ),
                    again=True,
                )
                continue
            current = self._joined
            try:
                version = current.pull(True, left)
            except (
                RelayLost
            ) as error:  # (a hop before this one failed: the next version comes healed)
                logger.info("weight receiver %d of %r: %s", self.id, self._directory.name, error)
                continue
            except GONE as error:
                if self.closed:
                    raise
                logger.info(
                    "weight receiver %d of %r: its sender is gone (%s): joining %s",
                    self.id,
                    self._directory.name,
                    error,
                    "the next sender of the name" if isinstance(error, SenderClosed) else "again",
                )
                self._start_join(error, again=not isinstance(error, SenderClosed))
                continue
            if (
                version > held
            ):  # (a new sender's first version may be one this receiver had: pull on)
                return version

    def _await(self, joining: Joining, left: float, timeout: float) -> None:
        """Wait up to ``left`` s for the join under way; raise why the last sender is gone if it failed."""
        if not joining.done.wait(max(left, 0.0)):
            raise WaitTimeout(
                f"receiver of weight sender {self._directory.name!r}: no version within {timeout:g} s: "
                f"its sender is gone ({joining.cause}) and the join of the next is under way; the "
                "next pull() waits for it"
            )
        with self._lock:
            if self._joining is joining:
                self._joining = None
        if joining.error is not None:
            if isinstance(joining.error, UsageError) or joining.cause is None:
                raise joining.error
            raise joining.cause from joining.error

    # -- ending ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the sender (it stops serving this receiver at once); the last version stays readable. From
        another thread too: a pull waiting for a sender ends at once, and a join under way is let go of."""
        with self._lock:
            if self.closed:
                return
            self._membership.move(Membership.CLOSED)
            self._closing.set()
            rejoined, current, previous = self._rejoined, self._current, self._previous
        self._heartbeat.close(self.timeout)
        if current is not None:
            current.close()
        if previous is not None:
            previous.close()
        if rejoined is not None:
            # (a join under way sees the close after its step; one done may still close what it replaced)
            rejoined.join(JOIN_STEPS * self.timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
