"""A receiver that joins a named sender through a store: :class:`ElasticReceiver`, what
``WeightReceiver(store=store, name="policy")`` builds.

It finds the sender's newest generation in the store (:mod:`.directory`), takes a join number, forms the gloo
pair with the sender on a prefix of the store and runs a plain :class:`~cudarecv.WeightReceiver` over it. When
that sender goes (it closed, or died) and a new one takes the name (a trainer that restarted), the next
:meth:`~ElasticReceiver.pull` joins it and goes on; the last version stays readable meanwhile, and the versions
keep increasing (a new generation goes on from the last version pushed).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from tensordict import TensorDict

from ...core.checks import check_timeout
from ...core.errors import (
    ArgumentError,
    BrokenError,
    PeerError,
    RelayLost,
    SenderClosed,
    TransferTimeout,
    UsageError,
    WaitTimeout,
)
from ...core.groups import store_group
from ...core.log import logger
from ..receiver import WeightReceiver
from .directory import Directory
from .edges import Edges
from .heartbeat import Heartbeat

#: what a pull raises when its sender is gone, after which it looks for a new sender under the name
GONE = (SenderClosed, PeerError, TransferTimeout, BrokenError)


class ElasticReceiver(WeightReceiver):
    """A weight receiver that joins the sender named ``name`` in ``store`` (see the module docstring); the
    other keyword arguments are :class:`~cudarecv.WeightReceiver`'s.

    Example:
        >>> store = torch.distributed.TCPStore("trainer-host", 29600, is_master=False)
        >>> receiver = WeightReceiver(store=store, name="policy", expect=policy)
        >>> receiver.pull()              # the newest version (latest mode), or the next push (sync)
        >>> receiver.load_into(policy)
    """

    def __init__(self, src: Any = None, *, store: Any = None, name: Any = None, timeout: float = 60.0,
                 **options: Any) -> None:
        given = (["src"] if src is not None else []) + sorted(k for k in ("group", "group_src", "want") if k in options)
        if given:
            raise ArgumentError(f"a receiver with `store` takes no {', '.join(map(repr, given))}: it joins the "
                                "sender named `name` through the store (drop `store` and `name` to receive from a "
                                "rank of a group)")
        self._directory = Directory(store, name)
        self.timeout = check_timeout(timeout)
        self._options = options
        self._closed = False
        self._current: WeightReceiver | None = None
        self._previous: WeightReceiver | None = None  # the last sender's, readable until the current has a version
        #: the generation of the sender joined, and this receiver's number among its joins
        self.generation, self.id = 0, 0
        self._dead = 0  # a generation found dead (it took no join): never joined again
        self._heartbeat = Heartbeat(self._directory)  # (the sender drops one that stops beating)
        try:
            self._join(self.timeout)
        except BaseException:
            self._heartbeat.close(self.timeout)
            raise

    def _join(self, limit: float, again: bool = False) -> None:
        """Join the newest sender generation above the one joined, waiting up to ``limit`` s for it; ``again``:
        the one joined may still serve (this receiver was dropped, or its link failed), so join the newest
        generation there is, that one included."""
        generation = self._directory.current(self.generation - 1 if again else self.generation, limit)
        beat = float(self._directory.sender(generation).get("timeout", self.timeout))  # (its record came first)
        k = self._directory.join(generation)
        group = store_group(self._directory.store, self._directory.pair(generation, k), 1, 2, self.timeout,
                            f"receiver {k} of weight sender {self._directory.name!r}: its pair with the sender")
        joined = WeightReceiver(group=group, group_src=0, timeout=self.timeout, **self._options)
        joined._hop.connect = Edges(self._directory, generation, k, self.timeout)  # (a relay's neighbours)
        self._heartbeat.follow(generation, k, beat)
        old, self._current = self._current, joined
        if old is not None:
            old.close()  # (its last version stays readable)
            if old.version:
                self._previous = old
        self.generation, self.id = generation, k
        logger.info("weight receiver: joined sender %r (generation %d) as receiver %d", self._directory.name,
                    generation, k)

    # -- what it is --------------------------------------------------------------------------------------
    schema = property(lambda self: self._current.schema, doc="The weights' schema.")
    mode = property(lambda self: self._current.mode, doc="The sender's mode: ``\"sync\"`` or ``\"latest\"``.")
    transport = property(lambda self: self._current.transport, doc="What carries the versions (see WeightReceiver).")
    zero_copy = property(lambda self: self._current.zero_copy, doc="Whether versions are read where they lie.")
    arriving = property(lambda self: self._current.arriving, doc="Whether a version has begun to arrive.")
    buffer_count = property(lambda self: self._readable().buffer_count, doc="See WeightReceiver.buffer_count.")

    def _readable(self) -> WeightReceiver:
        current = self._current
        return self._previous if not current.version and self._previous is not None else current

    @property
    def version(self) -> int:
        """The version published (0: none yet); across senders of the name it only increases."""
        return self._readable().version

    @property
    def td(self) -> TensorDict:
        """The latest complete version, from the first pull on (the last sender's until the new one's lands)."""
        return self._readable().td

    def reading(self) -> contextlib.AbstractContextManager[TensorDict]:
        """Hold the latest version while reading it (see :meth:`WeightReceiver.reading`)."""
        return self._readable().reading()

    def load_into(self, module: Any, strict: bool = True) -> int:
        return self._readable().load_into(module, strict)

    # -- pulling -----------------------------------------------------------------------------------------
    def pull(self, wait: bool = True, timeout: float | None = None) -> Any:
        """:meth:`WeightReceiver.pull`, always of a version newer than the one held (a version lost to a failure
        before this receiver in a relay chain is logged, and the pull waits for the next). When the sender is gone
        (it closed, died, or dropped this receiver), join the newest sender of the name (the same one again
        if it still serves, else the next to come within ``timeout``) and pull from it; if none can be joined,
        raise why the last one is gone. ``wait=False`` returns the joined receiver's transfer, no rejoin."""
        if self._closed:
            raise UsageError("this WeightReceiver is closed")
        limit = self.timeout if timeout is None else check_timeout(timeout)
        if not wait:
            return self._current.pull(False, limit)
        deadline = time.monotonic() + limit
        held = self.version
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"no version newer than {held} from sender {self._directory.name!r} within "
                                  f"{limit:g} s (it joined generation {self.generation} again meanwhile); the next "
                                  "pull() goes on waiting")
            if self._heartbeat.said_dropped():  # (stopped too long, or a transfer to it failed): join again
                self._rejoin(PeerError(f"weight sender {self._directory.name!r} dropped receiver {self.id} (was its "
                                       "process stopped?)"), deadline)
                continue
            try:
                version = self._current.pull(True, left)
            except RelayLost as error:  # (a hop before this one failed: the next version comes healed)
                logger.info("weight receiver %d of %r: %s", self.id, self._directory.name, error)
                continue
            except GONE as error:
                if self._closed:
                    raise
                self._rejoin(error, deadline)
                continue
            if version > held:  # (a new sender's first version may be one this receiver had: pull on)
                return version

    def _rejoin(self, error: BaseException, deadline: float) -> None:
        """The sender joined is gone (``error``): join the same one again if it still serves (this receiver was
        dropped), else the next generation, within ``deadline``; raise ``error`` if neither can be joined."""
        again = not isinstance(error, SenderClosed) and self.generation != self._dead
        logger.info("weight receiver %d of %r: its sender is gone (%s): joining %s", self.id, self._directory.name,
                    error, "again" if again else "the next sender of the name")
        try:
            self._join(max(deadline - time.monotonic(), 0.0), again=again)
        except TransferTimeout:  # the same generation took no join: it died; wait for the next one
            self._dead = self.generation
            try:
                self._join(max(deadline - time.monotonic(), 0.0))
            except (SenderClosed, TransferTimeout) as nobody:
                raise error from nobody
        except SenderClosed as nobody:
            raise error from nobody

    # -- ending ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the sender (it stops serving this receiver at once); the last version stays readable."""
        if self._closed:
            return
        self._closed = True
        self._heartbeat.close(self.timeout)
        self._current.close()
        if self._previous is not None:
            self._previous.close()
