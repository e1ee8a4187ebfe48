"""A named sender that receivers join through a store: :class:`ElasticSender`
(``ElasticSender(td, store, "policy")``).

No process group is shared by all: the sender announces itself in the store (:mod:`.directory`); an admission
thread takes each join request in turn and hands it to a thread of its own, which forms the gloo pair of the
sender and that receiver on a prefix of the store, runs the weight-sync handshake over it (the same-host offer
included) and adds the receiver to those served (a push under way goes on with those it began with). A receiver that joined is served by the
next push (sync mode) or gets the newest version on its first pull (latest mode). One that closes says BYE; one
that dies or stops is dropped within ``timeout`` and logged, never raised by a push; its pair, driver and
listener are let go of once their threads ended. ``close()`` stops the admission thread, every join under way,
and then the session as a plain sender's.

The store is shared and may fail: a push never raises for it (each failure is logged, once per run of them, and
the versions are numbered in this process meanwhile), and a record there that cudarecv did not write is logged
and skipped (the admission thread never ends on one). One generation per name serves at a time: each push takes
its version's number from the store's counter, then reads ``current``; a sender whose name a newer generation took
is fenced (it closes, and its push raises :class:`~cudarecv.SenderFenced`), so the versions a receiver gets only
increase, whichever sender it moves to.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from ...core.errors import ArgumentError, PeerError, SenderFenced, StoreError, StoreRecordError
from ...core.groups import store_group
from ...core.link import resolve
from ...core.log import logger
from ...core.shutdown import start_thread
from ...core.streams import StagingPool
from ...core.transport import release
from ...wire.staging import lane_for
from ..enrol import enrol, serve
from ..fanout import dropping
from ..options import Fanout, Mode, TransportPolicy, check_sender
from ..sender import SessionSender
from ..session import CLOSED_BY_RECEIVER
from .directory import Directory, JoinRecord, closing_token
from .heartbeat import Silence

if TYPE_CHECKING:
    from torch.distributed import Store

    from ...core.transfer import Transfer

#: latest mode's snapshot buffers when ``buffers`` is not given (receivers come and go: no count to size by)
LATEST_BUFFERS = 4


class ElasticSender(SessionSender):
    """A weight sender that receivers (:class:`~cudarecv.ElasticReceiver`) join and leave at any time through
    ``store``, by ``name``: no process group shared by all (see the module docstring, and docs/weight-sync.md).

    Args:
        td: the weights, as :class:`~cudarecv.WeightSender`'s.
        store: a ``torch.distributed`` store every receiver reaches (a ``TCPStore`` the trainer hosts).
        name: the sender's name in the store; one sender (its newest generation) serves under a name.

    Keyword Args:
        bucket_bytes, timeout, verify, stream, mode, buffers, fanout, transport, delta, wire_dtype: as
            :class:`~cudarecv.WeightSender`'s; ``buffers`` (latest mode) defaults to 4, receivers coming and going.

    Example:
        >>> store = torch.distributed.TCPStore("trainer-host", 29600, is_master=True, wait_for_workers=False)
        >>> sender = cudarecv.ElasticSender(TensorDict.from_module(policy), store, "policy", mode="latest")
        >>> sender.push()            # whoever has joined gets it; nobody joined is no error
        >>> sender.receivers         # [{"id": 1, "host": ..., "pid": ..., "transport": "wire", "state": "served"}]
    """

    def __init__(
        self,
        td: Any,
        store: Store,
        name: str,
        *,
        bucket_bytes: int | None = None,
        timeout: float = 60.0,
        verify: bool = False,
        stream: Any = None,
        mode: Mode = "sync",
        buffers: int | None = None,
        fanout: Fanout = "auto",
        transport: TransportPolicy = "auto",
        delta: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        timeout = check_sender(
            timeout, bucket_bytes, transport, mode, buffers, fanout, delta, wire_dtype
        )
        self._directory = Directory(store, name, timeout)
        super().__init__(
            td,
            [],
            bucket_bytes=bucket_bytes,
            timeout=timeout,
            verify=verify,
            stream=stream,
            mode=mode,
            buffers=buffers or LATEST_BUFFERS,
            fanout=fanout,
            transport=transport,
            elastic=True,
            delta=delta,
            wire_dtype=wire_dtype,
        )
        try:
            self._generation, self._s.version = self._directory.announce(mode, timeout)
        except BaseException:
            self._pool.clear()
            raise
        self._silence = Silence(self._directory, self._generation, timeout)
        self._told: set[int] = set()  # ids of the receivers told (in the store) they were dropped
        self._joins: list[threading.Thread] = []
        self._gone: list[dict] = []  # the receivers no longer served: id, host, pid, why
        self._stopped: set[int] = set()  # ids of those whose driver was told to stop
        self._stopping = threading.Event()
        self._token = (
            closing_token()
        )  # (its closing record: only this process can end its admissions)
        self._waiting = 1  # the number of the join the admission thread waits for
        self._store_failing = False  # a push's store call failed: said once, until one works again
        self._fence: str | None = None  # why it was fenced, if it was (every later push raises it)
        self._admission = start_thread(
            self._admit_all,
            f"cudarecv-admit-{name}",
            # torch's stubs lack Store.clone (torch has it)
            (self._directory.store.clone(),),  # type: ignore[attr-defined]
        )
        logger.info(
            "weight sender %r: generation %d, version %d, receivers join through the store",
            name,
            self._generation,
            self._s.version,
        )

    # -- who is served -----------------------------------------------------------------------------------
    generation = property(
        lambda self: self._generation,
        doc="This sender's generation under its name (a trainer that restarts is the next).",
    )

    @property
    def receivers(self) -> list[dict]:
        """Every receiver that joined: ``id`` (its number among the joins), ``host``, ``pid``, ``transport``
        (``"shared memory"``, ``"cuda ipc"``, ``"wire"``, or ``"relay"``: in the last push's relay chain) and
        ``state`` (``"served"``, or why it is not: it closed, or the failure that dropped it)."""
        with self._s.cond:
            present = [
                {
                    "id": m.rank,
                    "host": m.host,
                    "pid": m.pid,
                    "transport": "relay" if m.rank in self._s.chain else m.transport.name,
                    "state": "served" if m.served else (m.why or CLOSED_BY_RECEIVER),
                }
                for m in self._s.members
            ]
            return sorted(self._gone + present, key=lambda r: r["id"])

    @property
    def dropped(self) -> dict[int, str]:
        """The receivers no longer served (by id), and why."""
        return {r["id"]: r["state"] for r in self.receivers if r["state"] != "served"}

    # -- joining -----------------------------------------------------------------------------------------
    def _admit_all(self, store: Any) -> None:
        """The admission thread: each join request, in turn, to a thread of its own, until the sender closes. A
        record that is no join request (garbage in the store) is logged and skipped, and so is a number marked
        skipped (its receiver died before it wrote its request)."""
        name, k = self._directory.name, 0
        while True:
            self._waiting = k + 1  # (before the check: a close that comes now wakes this very wait)
            if self._stopping.is_set():
                return
            try:
                record = self._directory.next_join(store, self._generation, k + 1)
            except StoreRecordError as error:
                k += 1
                logger.warning("weight sender %r: join %d skipped: %s", name, k, error)
                continue
            except Exception as error:  # noqa: BLE001 - the store is gone: nobody can join any more
                if not self._stopping.is_set():
                    logger.error(
                        "weight sender %r: its store failed, no receiver can join from now on: %s",
                        name,
                        error,
                    )
                return
            if record is None:
                continue
            k += 1
            if record.kind == "closing" and record.token == self._token:
                return
            if record.kind == "closing":
                logger.warning(
                    "weight sender %r: join %d skipped: a closing record that is not this sender's",
                    name,
                    k,
                )
            elif record.kind == "join":
                self._joins = [t for t in self._joins if t.is_alive()]
                self._joins.append(
                    start_thread(
                        self._admit, f"cudarecv-join-{name}-{k}", (store.clone(), k, record)
                    )
                )

    def _admit(self, store: Any, k: int, record: JoinRecord) -> None:
        """Join ``k``: its pair, its handshake, then served from the next push on. A failure is logged."""
        who = f"receiver {k} (host {record.host}, pid {record.pid})"
        timeout = self._s.timeout
        group = None
        try:
            group = store_group(
                store,
                self._directory.pair(self._generation, k),
                0,
                2,
                timeout,
                f"weight sender {self._directory.name!r}: the pair with {who}",
                bounded=True,
            )
            lane = lane_for(
                resolve(None, 1, group, "dst", "group_dst"),
                self._device,
                self._stream,
                StagingPool(),
                peers_at_once=True,  # (a stream of its own per receiver: one stalled never stalls another)
            )
            members = enrol(
                self._s, self._pool, [lane], self._raw, self._session_id, [k], [record.pid]
            )
            if self._stopping.is_set():  # (never served: its driver goes, its pair with it)
                members[0].driver.stop(timeout)
                raise ArgumentError("the sender closed while it joined")
            # served from the next push on (sync: a push under way took its receivers before; latest: it asks)
            serve(self._s, self._pool, members)
        except Exception as error:  # noqa: BLE001 - a receiver that could not join is its own to report
            if not self._stopping.is_set():
                logger.warning(
                    "weight sender %r: %s could not join: %s", self._directory.name, who, error
                )
            # its side of the handshake may have ended (its answer came too late here): it would wait for
            # versions this sender never sends it; the pair goes (its link fails there) and, told it is dropped
            # (should the pair outlive this), it joins again at its next beat
            if group is not None:
                release(group)
            try:
                self._silence.said(k, store)
            except Exception as told:  # noqa: BLE001 - the store is gone: nobody joins any more
                logger.warning(
                    "weight sender %r: could not tell %s it was dropped: %s",
                    self._directory.name,
                    who,
                    told,
                )
            return
        logger.info(
            "weight sender %r: %s joined (%s)",
            self._directory.name,
            who,
            members[0].transport.name,
        )

    def _prune(self) -> None:
        """At a push: drop the receivers whose heartbeat stood still for ``timeout`` (:mod:`.heartbeat`); let go
        of those no longer served whose threads have ended (their pair, its gloo threads and sockets with it);
        what they were stays in :attr:`receivers`."""
        with self._s.cond:
            served = {m.rank: m for m in self._s.members if m.served}
        try:
            silent = self._silence.silent(list(served))
        except Exception as error:  # noqa: BLE001 - the store failed: no beat read this time
            logger.warning(
                "weight sender %r: could not read the receivers' heartbeats: %s",
                self._directory.name,
                error,
            )
            silent = []
        for ident in silent:
            stopped = PeerError(
                f"{served[ident].who} sent no heartbeat for {self._s.timeout:g} s (was its process "
                "stopped?)"
            )
            with self._s.cond:
                if served[ident].served:
                    dropping(
                        self._s,
                        self._pool,
                        served[ident],
                        self._s.version,
                        self._s.timeout,
                        told=False,
                    )(stopped, 0)
                    self._s.cond.notify_all()
        with (
            self._s.cond
        ):  # (every one dropped is told, through the store: one that goes on joins again)
            dropped = [m.rank for m in self._s.members if m.ended and m.rank not in self._told]
        for ident in dropped:
            try:
                self._silence.said(ident)
            except Exception as error:  # noqa: BLE001 - the store failed: the next push tells it
                logger.warning(
                    "weight sender %r: could not tell receiver %d it was dropped: %s",
                    self._directory.name,
                    ident,
                    error,
                )
                break
            self._told.add(ident)
        with self._s.cond:
            for member in self._s.members:
                if not member.served and member.rank not in self._stopped:
                    self._stopped.add(member.rank)
                    member.driver.stop(
                        0.0
                    )  # it ends once what it runs now ends (bounded: a bounded pair)
            done = [
                m
                for m in self._s.members
                if not m.served
                and not m.driver.thread.is_alive()
                and (m.listener is None or not m.listener.is_alive())
            ]
            self._s.members = [m for m in self._s.members if m not in done]
            self._gone += [
                {
                    "id": m.rank,
                    "host": m.host,
                    "pid": m.pid,
                    "transport": m.transport.name,
                    "state": m.why or CLOSED_BY_RECEIVER,
                }
                for m in done
            ]
            self._stopped -= {m.rank for m in done}
            self._told -= {m.rank for m in done}
        for member in done:
            release(
                member.lane.link.pg
            )  # (the failed transfers' works on its pair, parked, hold the pair)
            member.let_go()

    # -- pushing -----------------------------------------------------------------------------------------
    @overload
    def push(
        self, wait: Literal[True] = ..., timeout: float | None = ..., values: Any = ...
    ) -> int: ...
    @overload
    def push(
        self, wait: bool, timeout: float | None = ..., values: Any = ...
    ) -> int | list[Transfer]: ...
    def push(
        self, wait: bool = True, timeout: float | None = None, values: Any = None
    ) -> int | list[Transfer]:
        """:meth:`WeightSender.push`; :class:`SenderFenced` if a newer sender took the name (this one closed)."""
        if self._fence is not None:
            raise SenderFenced(self._fence)
        return super().push(wait, timeout, values)

    def _push(self, wait: bool, timeout: float, values: Any) -> int | list[Transfer]:
        self._prune()
        self._number()
        return super()._push(wait, timeout, values)

    def _number(self) -> None:
        """Before a push sends anything: take its version's number from the store (versions strictly increase
        under the name, whichever generation pushes them), then make sure this generation still holds the name
        (else it is fenced: :meth:`_fenced`). A store that fails is logged, and the push numbered here."""
        name = self._directory.name
        try:
            number = (
                self._directory.next_version()
            )  # (first: a generation named after this read numbers above it)
            newest = self._directory.newest()
            newer = newest if newest is not None and newest > self._generation else None
            if newer is not None:  # (one that wrote its record; `current` alone may be garbage)
                self._directory.sender(newer)
        except StoreError as error:
            if not self._store_failing:
                logger.warning(
                    "weight sender %r: the store failed (%s); the push goes on, numbered by this "
                    "process, and receivers cannot join until the store answers again",
                    name,
                    error,
                )
            self._store_failing = True
            return
        if self._store_failing:
            logger.warning("weight sender %r: the store answers again", name)
        self._store_failing = False
        if newer is not None:
            self._fenced(newer)
        with self._s.cond:
            self._s.version = max(
                self._s.version, number - 1
            )  # (the push's copy takes the next: `number`)

    def _fenced(self, newer: int) -> None:
        """A newer generation took the name: close (the receivers move to it), then raise :class:`SenderFenced`."""
        text = (
            f"weight sender {self._directory.name!r} (generation {self._generation}, version {self._s.version}) "
            f"was fenced: generation {newer} took the name in the store, so this sender closed and its receivers "
            "move to the newer one; run one trainer per name (or give each its own `name`)"
        )
        logger.error("%s", text)
        self._fence = text
        self.close()
        raise SenderFenced(text)

    # -- ending ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop taking joins (those under way end within ``timeout``), then close as a plain sender does."""
        if self._s.closed:
            return
        self._stopping.set()
        deadline = time.monotonic() + self._s.timeout
        try:
            self._directory.close(self._generation, self._waiting, self._token)
        except Exception as error:  # noqa: BLE001 - the store is gone: the admission thread ends on its own
            logger.info(
                "weight sender %r closes without its store: %s", self._directory.name, error
            )
        self._admission.join(max(deadline - time.monotonic(), 0.0))
        for thread in self._joins:
            thread.join(max(deadline - time.monotonic(), 0.0))
        self._joins = []
        self._pool.close_fds()
        super().close()
