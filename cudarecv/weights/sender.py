"""The trainer's end of a weight sync: :class:`WeightSender`.

A trainer holds a :class:`WeightSender` and pushes its policy's weights every
step; each actor holds a :class:`~cudarecv.WeightReceiver`. The structure travels
once, at construction (a JSON schema, never pickle, after a preamble with its
length, the push message size and the mode); every version is then one transfer
of a storage (in ``bucket_bytes`` chunks) into memory the receiver allocated at
the handshake, after a small header (version, byte count, fingerprint, optional
BLAKE3 digest).

Two modes:

- ``sync`` (the default): ``push()`` sends the version to every receiver and
  (with ``wait=True``) returns once each has it; every receiver gets every
  version, in lockstep with the trainer.
- ``latest``: ``push()`` copies the weights into a free snapshot buffer and
  returns at once. Each receiver's ``pull()`` asks for a version newer than the
  one it holds and gets the newest complete one, skipping those it missed; a
  slow or stopped receiver delays nobody. The sender keeps a fixed number of
  snapshot buffers (``buffers``, default: receivers + 2, enough that a push
  never waits).

Two fan-outs (``sync`` mode), chosen by ``fanout``:

- ``star``: the sender sends every push to each receiver itself, all at once:
  K receivers cost K times the bytes on the trainer's link.
- ``relay``: the sender sends each push's payload to the first receiver only,
  and every receiver forwards each chunk to the next while it receives the
  following one (:mod:`cudarecv.weights.relay`), so every host's link carries the model about
  once and the push time stays about flat in K. A blocking ``push()`` returns
  once every receiver of the chain has published the version, or raises
  :class:`ChecksumError` naming one that rejected it (it stays served).
- ``auto`` (the default): ``relay`` in ``sync`` mode when a receiver is on
  another host (a different machine or network namespace, learnt in the
  handshake), else ``star``. Measured (``bench/bench_hosts.py``, 64 MiB, 1 Gbit
  links): relay is 3.5x faster than star at 4 receivers on other hosts and as
  fast at 1; on one machine, where every transfer shares the same CPUs and
  memory, star is about 1.3x faster at 3 receivers.

Same host (``transport="auto"``, the default): the snapshot buffers are shared
segments (:mod:`cudarecv.samehost.shared_memory`, :mod:`cudarecv.samehost.cuda_ipc`) offered in the handshake; a
receiver on this machine that maps them gets each push as its header alone and
copies the version out itself (star fan-out; a relay chain uses the wire), or with
``zero_copy=True`` publishes it where it lies: such a receiver holds a snapshot until
it says ``FREED``, a push takes a snapshot no receiver holds (sync mode keeps three),
and the snapshots a receiver that left may still read are never written again.

A receiver that fails (dies, or takes longer than ``timeout``) is named in the
error and dropped; every other receiver carries on, and ``sender.ranks`` shows
who is left (in a relay chain, the receivers after a dead one lose that push
too: they are dropped, and the error names the dead rank). ``close()`` on
either side tells the other (on gloo links).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import time
from typing import Any, Callable, Iterator

import torch

from ..core import streams
from ..core.checks import check_timeout
from ..core.driver import Driver
from ..core.errors import (
    ArgumentError,
    ChecksumError,
    Error,
    MismatchError,
    OutOfStepError,
    PeerError,
    PushHeaderError,
    ReceiverFailed,
    SchemaError,
    TransferTimeout,
    UsageError,
    WaitTimeout,
)
from ..core.host_copy import copy_bytes
from ..core.link import resolve
from ..core.log import logger
from ..core.tags import SESSIONS, TAG_PREAMBLE, TAG_SCHEMA, TAG_STATUS
from ..core.transfer import CUDA_IPC, SHARED_MEMORY, WIRE, Transfer, at_exit, run_standing
from ..core.transport import park
from ..plan.header import check_pieces, cut
from ..plan.plan import plan_for
from ..plan.walk import unwrap
from ..samehost import cuda_ipc
from ..samehost.machine import host_id
from ..samehost.policy import allowed
from ..samehost.shared_memory import Segment, available, offer
from ..wire.control import read_bytes, wire_bytes
from ..wire.staging import Lane, lane_for, send_from
from .link import check_peers, link_error, naming, run, send_bytes
from .options import check_mode, check_options
from .wire import (
    ACCEPTED,
    ASK,
    ASK_SIZE,
    BYE,
    CLOSED,
    FREED,
    GOT,
    LANDED,
    LOST,
    MAX_SCHEMA_BYTES,
    REFUSED,
    REJECTED,
    RELEASED,
    STATUS_SIZE,
    Ask,
    PushHeader,
    Schema,
    SessionTags,
    checksum,
    preamble,
    read_ask,
    read_status,
    trailer_message,
)

#: relay fan-out's chunk when ``bucket_bytes`` is None: small enough that filling the chain costs
#: little (each hop adds one chunk's time), large enough that per-message costs stay negligible
RELAY_CHUNK = 1 << 20
#: sync mode's snapshots in host shared memory: the version zero-copy receivers publish, the one a reader
#: may still hold, and the next one
SYNC_SHARED = 3


class _Snapshot:
    """One sender-side storage of the weights, with the version it holds and its readers; in a
    shared segment (index ``segment`` of the handshake's offer) when receivers may map it."""

    def __init__(self, schema: Schema, piece: int, device: torch.device, shared: tuple[int, Segment] | None = None) -> None:
        self.segment, self._shared = (shared[0], shared[1]) if shared is not None else (None, None)
        if shared is not None:
            self.storage = shared[1].data
        else:
            self.storage = torch.zeros(schema.total, dtype=torch.uint8, device=device)
        self.views = schema.views(self.storage)
        self.chunks = cut(self.storage, piece)
        self.header: PushHeader | None = None
        self.readers = 0  # replies in flight that send from it
        self.writing = False
        self.holders = 0  # zero-copy receivers that may read it where it lies (sent to them, not yet FREED)
        self.retired = False  # a zero-copy receiver that held it is gone: it may read it still, never write it again


class _Receiver:
    """The sender's view of one receiver: its lane, its driver, and why it is gone (if it is)."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.rank = lane.link.peer
        self.driver = Driver(f"cudarecv-push-{self.rank}")
        self.gone: str | None = None  # why it is no longer served
        self.leaving = False  # it said BYE: nothing new is sent to it
        self.asked: int | None = None  # latest mode: it wants a version newer than this
        self.replying = False
        self.said_last = False  # CLOSED or RELEASED sent (once)
        self.named = False  # its failure reached the caller, in a push's error
        self.listener: threading.Thread | None = None
        self.got: Ask | None = None  # relay, shared memory: the receiver's last word on a version (GOT)
        self.shared = False  # it maps the sender's shared segments (same host): pushes send only headers
        self.alias = False  # zero-copy: it publishes the versions where they lie in the segments
        self.holding: dict[int, _Snapshot] = {}  # zero-copy: the snapshot of each version it may still read

    @property
    def served(self) -> bool:
        return self.gone is None and not self.leaving

    @property
    def failed(self) -> bool:
        """Dropped for a failure (not told the sender's last word): its threads may wait on its link for good."""
        return self.gone is not None and not self.said_last


def _out_of_step(text: str) -> OutOfStepError:
    return OutOfStepError(f"{text} (the link is out of step)")


class WeightSender:
    """Push the values of ``td`` to one or more :class:`WeightReceiver` ranks, every step.

    Args:
        td: the weights (a tensordict or tensorclass; ``TensorDict.from_module(model)``
            shares the model's parameters, so each push sends their current values).
        dst: a global rank or a list of them. Exclusive with ``group_dst``.

    Keyword Args:
        group: the process group (a standalone one with ``group_dst``).
        group_dst: a rank or ranks in ``group``.
        bucket_bytes: bytes per payload message (default: 1 MiB in ``sync`` mode unless
            ``fanout="star"``, the relay's chunk and faster than one message over loopback
            too; else the whole storage at once). :attr:`bucket_bytes` is the one used.
        timeout: seconds any wait may take (handshake, each receiver's transfer).
        verify: send a BLAKE3 digest with every push; receivers reject a corrupted payload.
        stream: the CUDA stream for GPU weights (default: cudarecv's dedicated stream).
        mode: ``"sync"`` (every receiver gets every version; a blocking push waits for
            them) or ``"latest"`` (push never waits; each pull gets the newest version).
        buffers: ``latest`` mode: snapshot buffers kept (default: receivers + 2, so that
            a push never waits; fewer bound memory, and a push then may wait for a
            transfer in flight, never for a receiver between pulls).
        fanout: ``"star"`` (the sender sends to every receiver), ``"relay"`` (``sync``
            mode: through a chain of the receivers in the order given, each forwarding
            the chunks it receives; ``bucket_bytes`` is the chunk, default 1 MiB), or
            ``"auto"`` (relay when a receiver is on another host; see the module docs).
            :attr:`fanout` is the one chosen.
        transport: ``"auto"`` (receivers on this machine map the sender's snapshots: shared memory for host
            weights, CUDA IPC for GPU weights; a push then sends them only its header) or ``"wire"``;
            :attr:`transports` says which each receiver got. ``CUDARECV_TRANSPORT=wire`` forces the wire.

    Construction performs the handshake with every receiver and raises if one
    rejects the schema (:class:`SchemaError`, naming it and the first differing
    key) or could not start (:class:`ReceiverFailed`, with its reason).

    Example:
        >>> sender = WeightSender(TensorDict.from_module(policy), dst=[1, 2], bucket_bytes=1 << 20)
        >>> version = sender.push()      # blocks until every receiver has the bytes
        >>> async_sender = WeightSender(TensorDict.from_module(policy), dst=[1, 2], mode="latest")
        >>> version = async_sender.push()  # returns at once; actors pull the newest when ready
    """

    def __init__(self, td: Any, dst: Any = None, *, group: Any = None, group_dst: Any = None,
                 bucket_bytes: int | None = None, timeout: float = 60.0, verify: bool = False,
                 stream: Any = None, mode: str = "sync", buffers: int | None = None, fanout: str = "auto",
                 transport: str = "auto") -> None:
        self.timeout = check_options(timeout=timeout, transport=transport, bucket_bytes=bucket_bytes)["timeout"]
        check_mode(mode, buffers, fanout)
        dsts, group_dsts = check_peers(dst, "dst"), check_peers(group_dst, "group_dst")
        if (dsts is None) == (group_dsts is None):
            raise ArgumentError("pass exactly one of `dst` and `group_dst` (a rank or a list of ranks)")
        links = [resolve(d, None, group, "dst", "group_dst") for d in dsts] if dsts is not None else [
            resolve(None, d, group, "dst", "group_dst") for d in group_dsts]
        if mode == "latest" and any(link.backend == "nccl" for link in links):
            raise UsageError("mode='latest' needs a gloo link (NCCL runs a pair's sends and receives in order on "
                             "one stream, so a receiver's ask could not pass a posted receive): use a gloo group "
                             "for weight sync (GPU weights are staged through page-locked memory)")
        self.mode, self.fanout = mode, fanout
        self._td = unwrap(td)
        plan = plan_for(self._td)
        plan.check()
        if not plan.tensors:
            raise ArgumentError("`td` has no tensors: weight sync needs at least one leaf to send")
        self.schema = Schema.of(plan.paths, plan.tensors)
        raw = self.schema.to_json()
        if len(raw) > MAX_SCHEMA_BYTES:
            raise ArgumentError(f"the schema of `td` takes {len(raw)} bytes of JSON, more than {MAX_SCHEMA_BYTES}: "
                                "send fewer, larger leaves")
        # a relay moves chunks; "auto" may choose it after the handshake, so it chunks too when it may
        chunk = RELAY_CHUNK if fanout == "relay" or (fanout == "auto" and mode == "sync") else math.inf
        self._piece = bucket_bytes or max(min(self.schema.total, chunk), 1)
        check_pieces(self.schema.total, self._piece, "weights")
        self._device = plan.device
        # same host: the snapshots are shared segments that receivers on this machine map read-only
        sharing = allowed(transport) and fanout != "relay" and (
            cuda_ipc.available(plan.device) is None if plan.device.type == "cuda"
            else available() is None and any(link.backend == "gloo" for link in links))
        self._shared_kind = (CUDA_IPC if plan.device.type == "cuda" else SHARED_MEMORY) if sharing else WIRE
        # sync: one snapshot, rewritten by every push; three in host memory, which a zero-copy receiver
        # publishes where they lie (each push then takes one that no such receiver holds: their pages are
        # touched only once used)
        count = (SYNC_SHARED if self._shared_kind == SHARED_MEMORY else 1) if mode == "sync" else (
            buffers or len(links) + 2)
        if self._shared_kind == CUDA_IPC:
            segments = [cuda_ipc.DeviceSegment(self.schema.total, plan.device) for _ in range(count)]
            shared_offer = cuda_ipc.offer(segments)
        else:
            segments = [Segment(self.schema.total) for _ in range(count)] if sharing else []
            shared_offer = offer(segments) if sharing else b""
        self._snapshots = [_Snapshot(self.schema, self._piece, self._device, (i, segment) if sharing else None)
                           for i, segment in enumerate(segments or [None] * count)]
        self._latest: _Snapshot | None = None
        self._verify = bool(verify)
        lanes = [lane_for(link, self._device, stream, streams.StagingPool()) for link in links]
        self._cond = threading.Condition()
        self._in_flight: list[tuple[_Receiver, Transfer]] = []
        self._torn = False  # sync: a dropped receiver's send may still read the storage: use a new one
        self._closed = False
        self._pushing = False  # a thread's push is under way: another's waits for its turn
        self.version = 0
        self._session = int.from_bytes(os.urandom(4), "little") % SESSIONS
        self._tags = SessionTags.of(self._session)
        try:
            answers = self._handshake(lanes, raw, shared_offer)
        finally:  # every receiver that could map them has (or none will): nothing names them now
            for segment in segments:
                segment.close_fd()
        if fanout == "auto":
            self.fanout = "relay" if mode == "sync" and any(h != host_id() for h, *_ in answers) else "star"
        self._receivers = [_Receiver(lane) for lane in lanes]
        for receiver, (_, shared, alias) in zip(self._receivers, answers):
            receiver.shared = shared and self.fanout == "star"
            receiver.alias = receiver.shared and alias and self._shared_kind == SHARED_MEMORY
        if mode == "sync" and any(r.shared for r in self._receivers) and self._shared_kind == SHARED_MEMORY:
            # the first push would pay for allocating its snapshot's pages (about 0.7 s per GB): here, once; and
            # for the second snapshot, which zero-copy pushes take turns with
            for segment in segments[:2 if any(r.alias for r in self._receivers) else 1]:
                segment.populate()
        for receiver in self._receivers:
            if receiver.lane.link.backend != "nccl":  # the receiver's asks and BYE (see cudarecv.weights.wire)
                receiver.listener = threading.Thread(target=self._listen, args=(receiver,), daemon=True,
                                                     name=f"cudarecv-listen-{receiver.rank}")
                receiver.listener.start()
        at_exit(self._join_listeners)  # the exit hook has ended their waits: they leave gloo before shutdown

    #: check keyword arguments of a sender (or receiver) ahead, without building one (see :func:`check_options`)
    check_options = staticmethod(check_options)

    def _snapshot(self) -> _Snapshot:
        """A storage of the sender's own (a replacement: receivers get what it holds on the wire)."""
        return _Snapshot(self.schema, self._piece, self._device)

    @property
    def transports(self) -> dict[int, str]:
        """What carries the pushes to each receiver still served: ``"shared memory"`` (a receiver on this
        machine mapping the sender's host snapshots), ``"cuda ipc"`` (the sender's GPU snapshots, opened
        once by a receiver on this node) or ``"wire"``."""
        return {r.rank: self._shared_kind if r.shared else WIRE for r in self._receivers if r.served}

    @property
    def bucket_bytes(self) -> int:
        """Bytes per payload message (the last message of a push may be shorter)."""
        return self._piece

    @property
    def ranks(self) -> list[int]:
        """The ranks (in the group) of the receivers still served."""
        return [r.rank for r in self._receivers if r.served]

    @property
    def dropped(self) -> dict[int, str]:
        """The receivers no longer served, and why (a failure named, or ``"closed by its receiver"``)."""
        return {r.rank: r.gone if r.gone is not None else "closed by its receiver"
                for r in self._receivers if not r.served}

    # -- handshake ----------------------------------------------------------------------
    def _handshake(self, lanes: list[Lane], raw: bytes, shared: bytes) -> list[tuple[str, bool, bool]]:
        """Offer the schema (and on gloo links the shared segments) to every receiver at once, then read
        every answer; return each receiver's host, whether it mapped the segments and whether it reads
        the versions where they lie (zero-copy)."""
        def hello(lane: Lane) -> Any:
            extra = shared if lane.link.backend == "gloo" or self._shared_kind == CUDA_IPC else b""
            head = yield from send_from(lane, [wire_bytes(lane, preamble(len(raw), self._piece, self.mode,
                                                                       self._session, len(extra)))],
                                        [TAG_PREAMBLE], defer=True)
            yield from send_bytes(lane, raw, TAG_SCHEMA)
            if extra:
                yield from send_bytes(lane, extra, TAG_SCHEMA)
            if head:
                yield head

        def answer(lane: Lane) -> Any:
            return (yield from read_bytes(lane, STATUS_SIZE, TAG_STATUS, "handshake answer", SchemaError))

        what = "weight-sync handshake"
        offers = [(lane, self._control(hello(lane), lane, what, "took no schema")) for lane in lanes]
        answers = [(lane, self._control(answer(lane), lane, what, "sent no answer")) for lane in lanes]
        try:
            for _, transfer in offers + answers:
                transfer.wait()  # raises, naming the rank, if the link failed
        except BaseException:
            park([transfer for _, transfer in offers + answers])  # what is still in flight runs out
            raise
        hosts = []
        for lane, transfer in answers:
            status, reason = read_status(transfer.wait())
            if status == REFUSED:
                raise SchemaError(f"receiver rank {lane.link.peer} rejected the weights: {reason}")
            if status != ACCEPTED:
                raise ReceiverFailed(f"receiver rank {lane.link.peer} could not start: {reason}")
            host, _, route = reason.partition("\n")
            hosts.append((host, route in ("shared", "shared zero-copy"), route == "shared zero-copy"))
        return hosts

    def _control(self, protocol: Any, lane: Lane, what: str, silent: str) -> Transfer:
        return Transfer(protocol, lane.stream, on_error=naming(lane.link, what, self.timeout, silent),
                        timeout=self.timeout, link=lane.link, raise_first=False,
                        what=f"{what} with rank {lane.link.peer}")

    # -- pushing ------------------------------------------------------------------------
    def push(self, wait: bool = True, timeout: float | None = None, values: Any = None) -> int | list[Transfer]:
        """Send the current values of ``td`` to every receiver still served, as the next version.

        ``sync`` mode: returns the new version number once every receiver has it, or
        with ``wait=False`` one :class:`~cudarecv.Transfer` per receiver (their
        ``wait()`` returns ``None``). ``latest`` mode: copies the weights into a free
        snapshot buffer and returns the version at once (``wait`` changes nothing);
        receivers get it when they next pull.
        ``timeout``: seconds each receiver may take (default: the sender's ``timeout``).
        ``values``: send these instead of ``td``'s (a tensordict with ``td``'s keys, shapes,
        dtypes and device; ``td`` is left as it is).

        Pushes from several threads take turns (versions in the order they got it, each whole):
        a push first waits up to ``timeout`` for another thread's push to end (``WaitTimeout``).

        Raises:
            TransferTimeout or PeerError naming the receiver whose link failed: it is
                dropped (the others got the version, and get the next ones);
                PeerError if no receiver is left.
            ChecksumError (PushHeaderError without ``verify``) naming a receiver that rejected
                the version (relay, shared memory: those tell the sender; a receiver on the wire's
                star fan-out does not, its pull raises): it keeps its last version and stays served.
        """
        if self._closed:
            raise UsageError("this WeightSender is closed")
        limit = self.timeout if timeout is None else check_timeout(timeout)
        with self._turn(limit):
            return self._push(wait, limit, values)

    @contextlib.contextmanager
    def _turn(self, limit: float) -> Iterator[None]:
        """Pushes from several threads take turns, in the order they get it: wait up to ``limit`` s for another
        thread's push to end (its own timeout bounds it); ``close()`` ends the wait at once."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or not self._pushing, timeout=limit):
                raise WaitTimeout(f"another thread's push held this WeightSender for {limit:g} s (pushes from "
                                  "several threads take turns)")
            if self._closed:
                raise UsageError("this WeightSender was closed while a push waited for another thread's push")
            self._pushing = True
        try:
            yield
        finally:
            with self._cond:
                self._pushing = False
                self._cond.notify_all()

    def _push(self, wait: bool, limit: float, values: Any) -> int | list[Transfer]:
        """:meth:`push`, in this thread's turn."""
        self._finish_in_flight()  # sync: the storage is reused, the previous push must be out
        live = [r for r in self._receivers if r.served]
        if not live:
            self._untold(live)
            raise PeerError(f"no receiver of this WeightSender is left ({self.dropped}): "
                            "connect new receivers with a new WeightSender")
        plan = plan_for(self._td if values is None else unwrap(values))
        if [tuple(map(str, p)) for p in plan.paths] != [l.key for l in self.schema.leaves] or any(
            tuple(t.shape) != l.shape or t.dtype != l.dtype for t, l in zip(plan.tensors, self.schema.leaves)
        ):
            if values is not None:
                raise ArgumentError("`values` must have the keys, shapes and dtypes of the sender's `td` "
                                    f"({len(self.schema.leaves)} leaves, {self.schema.total} bytes)")
            raise SchemaError("the tensordict changed structure since the handshake: build a new WeightSender")
        if values is not None and plan.device != self._device:
            raise ArgumentError(f"`values` are on {plan.device}, the sender's `td` on {self._device}: "
                                f"pass them on {self._device}")
        if self.mode == "latest":
            version = self._snapshot_latest(plan, live, limit)
            untold = self._untold(live)
            if untold:
                raise PeerError(f"version {version} is published to ranks {self.ranks}; "
                                + "; ".join(f"rank {r.rank}: {r.gone}" for r in untold))
            return version
        if self._torn:  # the old storages stay with the parked sends of the dropped receiver
            self._snapshots = [self._snapshot()]
            self._torn = False
        target = self._sync_target(limit)
        self._copy(plan, target, live[0].lane.stream)
        pushes = []
        with self._cond:  # (a receiver's BYE, and its RELEASED queued after what is in flight, wait for this)
            live = [r for r in live if r.served]  # one that said BYE meanwhile may be released already: skip it
            for i, receiver in enumerate(live):  # each posted on its own: one failing never keeps the others from theirs
                if self.fanout == "relay":
                    protocol = self._send_relayed(live, i, target, limit)
                else:
                    protocol = self._send(receiver, target, limit)
                transfer = Transfer(protocol, receiver.lane.stream, timeout=limit,
                                    driver=receiver.driver.submit, link=receiver.lane.link,
                                    on_error=self._drop(receiver, self.version, limit), raise_first=False,
                                    what=f"push of version {self.version} to rank {receiver.rank}")
                pushes.append((receiver, transfer))
            for receiver in self._untold(live):  # dropped since the last push (between pushes): named here
                error = PeerError(f"push of version {self.version}: {receiver.gone}")
                pushes.append((receiver, Transfer(_failing(error), raise_first=False,
                                                  what=f"push of version {self.version} to rank {receiver.rank}")))
        if not wait:  # each is driven on its receiver's thread from the start: none waits for another
            self._in_flight = pushes
            return [transfer for _, transfer in pushes]
        self._finish(pushes, self.version)
        return self.version

    def _untold(self, live: list[_Receiver]) -> list[_Receiver]:
        """The receivers not in ``live`` dropped for a failure that no push's error has named yet (a
        receiver that died between pushes, found by its listener): named from now on."""
        with self._cond:
            untold = [r for r in self._receivers if r not in live and r.failed and not r.named]
            for receiver in untold:
                receiver.named = True
        return untold

    def _sync_target(self, limit: float) -> _Snapshot:
        """Sync mode: the snapshot the next version goes in, the first that no zero-copy receiver holds
        (waiting up to ``limit`` s for one to let go of one)."""
        with self._cond:
            self._replenish()
            if not self._wait(lambda: self._unheld() is not None, limit):
                raise WaitTimeout(f"zero-copy receivers held every shared snapshot for {limit:g} s "
                                  f"((rank, version): {self._held()}; a reading() kept across pushes?)")
            return self._unheld()

    def _wait(self, ready: Callable[[], bool], limit: float) -> bool:
        """Under the lock: wait up to ``limit`` s for ``ready()`` (a free snapshot); raises
        :class:`UsageError` if the sender is closed meanwhile (by another thread)."""
        ready = self._cond.wait_for(lambda: self._closed or ready(), timeout=limit)
        if self._closed:
            raise UsageError("this WeightSender was closed while a push waited for a free snapshot")
        return ready

    def _held(self) -> list[tuple[int, int]]:
        """Under the lock: (rank, version) of every snapshot a zero-copy receiver holds."""
        return sorted({(r.rank, v) for r in self._receivers for v in r.holding})

    def _busy(self) -> str:
        """Under the lock: why no snapshot buffer is free (latest mode)."""
        sent = sum(s.readers > 0 for s in self._snapshots)
        held = self._held()
        return (f"{sent} being sent, 1 the latest version" + (
            f", held by zero-copy receivers ((rank, version): {held}; a reading() kept across pushes?)"
            if held else "") + "; pass a larger `buffers`")

    def _unheld(self) -> _Snapshot | None:
        return next((s for s in self._snapshots if s.holders == 0 and not s.retired), None)

    def _replenish(self) -> None:
        """Under the lock: keep two snapshots that can be written once zero-copy receivers that left hold
        others forever (new ones are the sender's own, sent on the wire)."""
        while any(s.retired for s in self._snapshots) and sum(not s.retired for s in self._snapshots) < 2:
            self._snapshots.append(self._snapshot())

    def _retire(self, receiver: _Receiver) -> None:
        """``receiver`` is gone: the snapshots it may still read where they lie are never written again."""
        with self._cond:
            for snapshot in receiver.holding.values():
                snapshot.retired = True
            receiver.holding.clear()
            self._cond.notify_all()

    def _let_go(self, receiver: _Receiver, version: int) -> bool:
        """Under the lock: ``receiver`` no longer reads the snapshot of ``version``; False if it held none."""
        snapshot = receiver.holding.pop(version, None)
        if snapshot is None:
            return False
        snapshot.holders -= 1
        self._cond.notify_all()
        return True

    def _copy(self, plan: Any, target: _Snapshot, stream: Any) -> None:
        """Copy the weights into ``target`` as the next version (on ``stream`` for GPU weights)."""
        if stream is not None:
            streams.follow_caller(stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), torch.no_grad():
            host = isinstance(target._shared, Segment)
            if host:  # a receiver dropped while it copies sees that its version was overwritten
                target._shared.begin_write(self.version + 1)
            if host and plan.device.type == "cpu":  # (one thread: the receivers' copies share the cores)
                for view, leaf in zip(target.views, plan.detached):
                    copy_bytes(view, leaf)
            else:
                torch._foreach_copy_(target.views, plan.detached, non_blocking=True)  # never an autograd node
            digest = checksum(target.storage) if self._verify else bytes(16)
            if host:
                target._shared.end_write(self.version + 1)
            elif target._shared is not None:
                target._shared.written.record(stream)  # receivers' copies wait for it (CUDA IPC)
        if stream is not None:  # the caller's next writes (an optimizer step) wait for the copy
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        self.version += 1
        target.header = PushHeader(self.version, self.schema.total, self._piece, self.schema.fingerprint,
                                   digest, self._verify)

    def _snapshot_latest(self, plan: Any, live: list[_Receiver], limit: float) -> int:
        with self._cond:
            if not self._wait(lambda: self._free_snapshot() is not None, limit):
                raise WaitTimeout(f"no snapshot buffer of {len(self._snapshots)} was free for {limit:g} s: "
                                  f"{self._busy()}")
            target = self._free_snapshot()
            target.writing = True
        try:
            self._copy(plan, target, live[0].lane.stream)
        finally:
            with self._cond:
                target.writing = False
        with self._cond:
            self._latest = target
            for receiver in live:
                self._serve(receiver)
        return self.version

    def _free_snapshot(self) -> _Snapshot | None:
        """Under the lock: a snapshot buffer that is neither the latest nor being sent, written or held."""
        self._replenish()
        return next((s for s in self._snapshots if s is not self._latest and s.readers == 0 and not s.writing
                     and s.holders == 0 and not s.retired), None)

    def _serve(self, receiver: _Receiver) -> None:
        """Latest mode, under the lock: start a reply if ``receiver`` asked and a newer version exists."""
        latest = self._latest
        if (receiver.served and not receiver.replying and receiver.asked is not None and latest is not None
                and latest.header.version > receiver.asked and not self._closed):
            receiver.replying = True
            receiver.driver.submit(lambda: self._reply(receiver))

    def _reply(self, receiver: _Receiver) -> None:
        """Latest mode, on the receiver's driver: send it the newest snapshot."""
        with self._cond:
            snapshot = self._latest
            snapshot.readers += 1
            receiver.asked = None
        version = snapshot.header.version
        transfer = Transfer(self._send(receiver, snapshot, self.timeout), receiver.lane.stream, timeout=self.timeout,
                            link=receiver.lane.link, on_error=self._drop(receiver, version, self.timeout, told=False),
                            raise_first=False, what=f"version {version} to rank {receiver.rank}")
        with contextlib.suppress(Exception):  # a failure drops the receiver (its hook)
            transfer.wait()
        with self._cond:
            snapshot.readers -= 1
            if transfer.failed and not (self._through_segment(receiver, snapshot) and self._shared_kind == SHARED_MEMORY):
                # its parked send may still read the buffer: never write it again
                self._snapshots[self._snapshots.index(snapshot)] = fresh = self._snapshot()
                if self._latest is snapshot:
                    fresh.storage.copy_(snapshot.storage)
                    fresh.header = snapshot.header
                    self._latest = fresh
            receiver.replying = False
            self._serve(receiver)  # it may have asked again meanwhile
            self._cond.notify_all()

    @staticmethod
    def _through_segment(receiver: _Receiver, snapshot: _Snapshot) -> bool:
        return receiver.shared and snapshot.segment is not None

    def _send(self, receiver: _Receiver, snapshot: _Snapshot, limit: float) -> Any:
        lane = receiver.lane
        if self._through_segment(receiver, snapshot):  # the header only; the receiver copies the version out
            header = dataclasses.replace(snapshot.header, shared=True, segment=snapshot.segment)
            if receiver.alias:  # (or publishes it where it lies: held until it says FREED)
                with self._cond:
                    snapshot.holders += 1
                    receiver.holding[header.version] = snapshot
            yield from send_from(lane, [wire_bytes(lane, header.pack())], [self._tags.header])
            yield from self._confirmed(receiver, header.version, limit)
            return
        head = yield from send_from(lane, [wire_bytes(lane, snapshot.header.pack())], [self._tags.header], defer=True)
        yield from send_from(lane, snapshot.chunks, [self._tags.payload] * len(snapshot.chunks))
        if head:
            yield head

    def _send_relayed(self, chain: list[_Receiver], i: int, snapshot: _Snapshot, limit: float) -> Any:
        """Relay fan-out, to ``chain[i]``: its header (naming its hops); the payload and the
        trailer to the head of the chain only; then the receiver's word that it has the version."""
        receiver, lane = chain[i], chain[i].lane
        header = dataclasses.replace(snapshot.header, relayed=True,
                                     up=lane.link.pg.rank() if i == 0 else chain[i - 1].rank,
                                     down=chain[i + 1].rank if i + 1 < len(chain) else -1)
        head = yield from send_from(lane, [wire_bytes(lane, header.pack())], [self._tags.header], defer=True)
        if i == 0:
            yield from send_from(lane, snapshot.chunks, [self._tags.payload] * len(snapshot.chunks))
            yield from send_bytes(lane, trailer_message(header.version), self._tags.trailer)
        if head:
            yield head
        yield from self._confirmed(receiver, header.version, limit)

    def _confirmed(self, receiver: _Receiver, version: int, limit: float) -> Any:
        """Wait for the receiver's word on ``version`` (relay, shared memory): raises if it did not publish it."""
        if receiver.lane.nccl:  # no listener on NCCL: the word comes here, in order on the pair's stream
            ask = read_ask((yield from read_bytes(receiver.lane, ASK_SIZE, self._tags.ask, "acknowledgement",
                                                  _out_of_step)))
            if ask.kind != GOT:
                raise _out_of_step("the receiver sent no acknowledgement")
            receiver.got = ask
        yield [_Got(self, receiver, version, time.monotonic() + limit + 1.0)]

    def _drop(self, receiver: _Receiver, version: int, timeout: float,
              told: bool = True) -> Callable[[BaseException, float], BaseException]:
        """The error hook of a transfer of ``version`` to ``receiver``: name it, and drop it (``told``: the
        error reaches the caller, a push's future; else the next push names it)."""
        def dropped(error: BaseException, elapsed: float) -> BaseException:
            if isinstance(error, MismatchError):  # it rejected the version (its word, see _Got): still served
                return error
            seconds = timeout if isinstance(error, TimeoutError) else elapsed
            if isinstance(error, Error) and not isinstance(error, TimeoutError):
                failure = error  # it names the rank already (a dead one, or one upstream in a relay chain)
            else:
                failure = link_error(receiver.lane.link, f"push of version {version}", error, seconds,
                                     f"did not take version {version}")
            text = str(failure)
            if "is dropped from this sender" not in text:
                text += f"; rank {receiver.rank} is dropped from this sender"
            receiver.gone, receiver.named = text, receiver.named or told
            logger.warning("weight sender: %s", text)
            self._retire(receiver)
            if not receiver.shared or self._shared_kind == CUDA_IPC:
                # its send (or, CUDA IPC, its copy) may still read the storage, long after this; a receiver of
                # host segments checks their stamps instead (a copy overtaken by a write is never published)
                self._torn = True
            return type(failure)(text)

        return dropped

    def _finish(self, pushes: list[tuple[_Receiver, Transfer]], version: int) -> None:
        """Wait for every receiver's transfer (each bounded by its own timeout, all running at
        once); then raise the first failure, naming its receiver and who got the version."""
        errors = []
        for _, transfer in pushes:
            try:
                transfer.wait()
            except Exception as error:  # noqa: BLE001 - re-raised below, with the ranks reached
                errors.append(error)
        if errors:
            reached = [r.rank for r, t in pushes if not t.failed]
            raise type(errors[0])(f"{errors[0]} (version {version} reached ranks {reached})") from errors[0]

    def _finish_in_flight(self) -> None:
        """The push in flight must be out before the storage is reused; its failures were
        reported on its futures (and their receivers dropped)."""
        pending, self._in_flight = self._in_flight, []
        for _, transfer in pending:
            with contextlib.suppress(Exception):
                transfer.wait()

    # -- the receivers' messages and the last words -------------------------------------
    def _listen(self, receiver: _Receiver) -> None:
        """The receiver's asks (latest mode) and its BYE, for as long as it is connected."""
        lane = receiver.lane
        while True:
            try:
                ask = read_ask(run_standing(
                    read_bytes(lane, ASK_SIZE, self._tags.ask, "receiver message", _out_of_step), lane.link, lane.stream,
                    on_error=naming(lane.link, "weight sync", math.inf, "sent nothing")))
                kind, version = ask.kind, ask.version
                if (kind == ASK and self.mode != "latest") or (kind == GOT and self.fanout != "relay"
                                                                and not receiver.shared) or (
                        kind == FREED and not receiver.alias):
                    raise OutOfStepError(f"the receiver sent a message this {self.mode} {self.fanout} sender "
                                         "never asks for: out of step")
                if kind == FREED:
                    with self._cond:
                        if not self._let_go(receiver, version):
                            raise OutOfStepError(f"the receiver let go of version {version}, which it does not "
                                                 "hold: out of step")
                    continue
            except Exception as error:  # noqa: BLE001 - a dead or lying receiver is dropped
                with self._cond:
                    if receiver.gone is None and not receiver.said_last:
                        receiver.gone = f"{error}; rank {receiver.rank} is dropped from this sender"
                        logger.warning("weight sender: %s", receiver.gone)
                    self._retire(receiver)
                    self._cond.notify_all()
                return
            if kind == BYE:
                with self._cond:  # (atomic with a push posting to the receivers still served)
                    receiver.leaving = True
                    self._cond.notify_all()
                    receiver.driver.submit(lambda: self._last_word(receiver, RELEASED))  # after what is in flight
                return
            if kind == GOT:
                with self._cond:
                    receiver.got = ask
                    if ask.status != LANDED:  # a zero-copy receiver did not publish it: it holds nothing of it
                        self._let_go(receiver, version)
                    self._cond.notify_all()
                continue
            with self._cond:
                receiver.asked = version
                self._serve(receiver)

    def _last_word(self, receiver: _Receiver, kind: int) -> None:
        """Send ``receiver`` the sender's last header (CLOSED or RELEASED), once."""
        with self._cond:
            if receiver.said_last or receiver.gone is not None:
                return
            receiver.said_last = True
        header = PushHeader(self.version, self.schema.total, self._piece, self.schema.fingerprint, kind=kind)
        with contextlib.suppress(Exception):  # a receiver gone meanwhile: nothing left to tell
            run(send_bytes(receiver.lane, header.pack(), self._tags.header), receiver.lane, self.timeout, "weight-sync close",
                "took no close message")
        if kind == RELEASED:
            with self._cond:
                if receiver.gone is None:
                    logger.info("weight sender: rank %d closed its receiver: no longer served", receiver.rank)
                receiver.gone = receiver.gone or "closed by its receiver"
                self._retire(receiver)  # its published version stays readable: where it lies, never written again
                self._cond.notify_all()

    def close(self) -> None:
        """Finish what is in flight, tell every receiver, and stop (within ``timeout``). Idempotent.

        A receiver's pending or next ``pull()`` then raises :class:`SenderClosed` at once
        (on gloo links); its last version stays readable.
        """
        if self._closed:
            return
        self._finish_in_flight()
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # a push waiting for a free snapshot (another thread's) ends now
        for receiver in self._receivers:
            if receiver.listener is not None and receiver.gone is None:
                receiver.driver.submit(lambda r=receiver: self._last_word(r, CLOSED))
        deadline = time.monotonic() + self.timeout

        def left() -> float:
            return max(deadline - time.monotonic(), 0.0)

        for receiver in self._receivers:  # a failed receiver's thread may wait on its link for good: not joined
            receiver.driver.stop(0.0 if receiver.failed else left())
        for receiver in self._receivers:  # each listener ends with its receiver's BYE (a failed one may never)
            if receiver.listener is not None and not receiver.failed:
                receiver.listener.join(left())
        # let go of the weights, the snapshots and the process group (a group kept alive past
        # destroy_process_group() by objects in reference cycles is destroyed at interpreter exit,
        # where gloo aborts the process)
        self._td, self._snapshots, self._latest = None, [], None
        for receiver in self._receivers:
            receiver.lane = None

    def _join_listeners(self, timeout: float) -> None:
        """Wait up to ``timeout`` s in all for the listener threads to end (at exit)."""
        deadline = time.monotonic() + timeout
        for receiver in self._receivers:
            if receiver.listener is not None and receiver.listener is not threading.current_thread():
                receiver.listener.join(max(deadline - time.monotonic(), 0.0))

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _failing(error: BaseException) -> Any:
    """A protocol that fails at once with ``error``."""
    yield from ()
    raise error


class _Got:
    """Relay fan-out: a work that completes when ``receiver`` has said what became of ``version``
    (or left, or is gone); ``wait`` raises if it did not publish it, naming the rank that failed."""

    def __init__(self, sender: WeightSender, receiver: _Receiver, version: int, deadline: float) -> None:
        self.sender, self.receiver, self.version, self.deadline = sender, receiver, version, deadline

    def _said(self) -> bool:
        r = self.receiver
        return r.gone is not None or r.leaving or (r.got is not None and r.got.version >= self.version)

    def is_completed(self) -> bool:
        with self.sender._cond:
            return self._said()

    def wait(self, timeout: Any = None) -> bool:
        r = self.receiver
        with self.sender._cond:
            if not self.sender._cond.wait_for(self._said, timeout=max(self.deadline - time.monotonic(), 0.0)):
                raise TransferTimeout(f"rank {r.rank} did not confirm version {self.version}")
            gone, got, leaving = r.gone, r.got, r.leaving
        if got is not None and got.version >= self.version:
            if got.version == self.version and got.status == LOST:
                raise PeerError(f"push of version {self.version}: rank {r.rank} did not get it: rank {got.rank} "
                                "before it in the relay chain failed during the push")
            if got.version == self.version and got.status == REJECTED:  # it stays served: its link is in step
                if self.sender._verify:
                    raise ChecksumError(f"push of version {self.version}: rank {r.rank} rejected it: the BLAKE3 "
                                        "digest of what it received, or its header, did not match what was sent "
                                        "(corrupted on the way); it keeps its last version and stays served")
                raise PushHeaderError(f"push of version {self.version}: rank {r.rank} rejected its header; it keeps "
                                      "its last version and stays served")
            return True
        if gone is not None and not leaving:
            raise PeerError(gone)
        return True
