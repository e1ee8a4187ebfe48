"""The trainer's end of a weight sync: :class:`SessionSender`, what every sender of one session is, and
:class:`WeightSender`, a sender to ranks of a process group (its siblings: ``ElasticSender`` in
:mod:`~cudarecv.weights.membership.elastic_sender`, receivers joining through a store; ``ShardedSender`` in
:mod:`~cudarecv.weights.sharded.sharded_sender`, one rank of a sharded sender, built of plain ones).

A trainer holds a :class:`WeightSender` and pushes its policy's weights every step; each actor holds a
:class:`~cudarecv.WeightReceiver`. The structure travels once, at construction (:mod:`~cudarecv.weights.handshake`);
every version is then one transfer of a storage, in ``bucket_bytes`` chunks, into memory the receiver
allocated at the handshake, after a small header (version, byte count, fingerprint, optional BLAKE3 digest).
The sender's parts, each picked once at the handshake:

- the snapshots a version is copied into (:mod:`~cudarecv.weights.snapshots`): shared segments that receivers
  on this machine map (shared memory, CUDA IPC), or the sender's own;
- the mode (:mod:`~cudarecv.weights.pushes`): ``sync`` (every receiver gets every version; a blocking push
  returns once each has it) or ``latest`` (a push publishes the newest version and returns at once; each
  receiver's pull gets the newest complete one, a slow receiver delays nobody);
- the fan-out (:mod:`~cudarecv.weights.fanout`): ``star`` (the sender sends to every receiver, K times the
  bytes on its link) or ``relay`` (sync mode: the payload to the first receiver only, each forwarding chunks
  to the next as they land, so every link carries the model about once; ``auto`` picks it when a receiver is
  on another host: 3.5x faster than star at 4 receivers on 1 Gbit links, ``bench/bench_hosts.py``);
- the receivers' words (:mod:`~cudarecv.weights.serving`): asks, acknowledgements, BYE.

A receiver that fails (dies, or takes longer than ``timeout``) is named in the error and dropped; every other
receiver carries on, and ``sender.ranks`` shows who is left. ``close()`` on either side tells the other (on gloo).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from ..core import streams
from ..core.checks import check_timeout
from ..core.errors import ArgumentError, PeerError, SchemaError, UsageError, WaitTimeout
from ..core.link import Link, resolve
from ..core.tags import SESSIONS
from ..core.transfer import Transfer
from ..plan.plan import Plan, plan_for
from ..plan.walk import unwrap, walk
from ..samehost.machine import host_id
from ..samehost.policy import allowed
from ..wire.staging import lane_for, release_pair
from .enrol import enrol, serve
from .fanout import join_aborts
from .link import check_peers
from .options import Fanout, Mode, TransportPolicy, check_options, check_sender
from .pushes import LatestPushes, SyncPushes
from .schema import MAX_SCHEMA_BYTES, Schema
from .serving import last_word
from .session import CLOSED_BY_RECEIVER, OWED, Session
from .sharded.layout import is_sharded
from .snapshots import SnapshotPool
from .transports.base import Need
from .transports.registry import choose
from .transports.wire import rules
from .wire import CLOSED, SessionTags

if TYPE_CHECKING:
    from tensordict import TensorDictBase
    from typing_extensions import Self

#: relay fan-out's chunk when ``bucket_bytes`` is None: small enough that filling the chain costs
#: little (each hop adds one chunk's time), large enough that per-message costs stay negligible
RELAY_CHUNK = 1 << 20


class SessionSender:
    """What every sender of one weight-sync session is, whoever its receivers are: the weights (``td``), their plan
    and schema, the session's settings, the snapshots a version is copied into, and pushing and closing.

    Its subclasses say where the receivers come from, and call this ``__init__`` once they know the links they
    have so far (``[]``: receivers join later): :class:`WeightSender` (ranks of a process group), and
    :class:`~cudarecv.ElasticSender` (receivers that join through a store). Each checks its options first, with
    :func:`~cudarecv.weights.options.check_sender`, before it resolves any link.
    """

    _leafwise = (
        False  # messages cut from each leaf's bytes (a sharded sender's pieces: see weights.schema)
    )

    def __init__(
        self,
        td: Any,
        links: list[Link],
        *,
        bucket_bytes: int | None,
        timeout: float,
        verify: bool,
        stream: Any,
        mode: Mode,
        buffers: int,
        fanout: Fanout,
        transport: TransportPolicy,
        elastic: bool = False,
        delta: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self._begin(
            td,
            links,
            bucket_bytes,
            timeout,
            verify,
            stream,
            mode,
            buffers,
            fanout,
            transport,
            elastic,
            delta,
            wire_dtype,
        )

    def _begin(
        self,
        td: Any,
        links: list[Link],
        bucket_bytes: int | None,
        timeout: float,
        verify: bool,
        stream: Any,
        mode: Mode,
        buffers: int,
        fanout: Fanout,
        transport: TransportPolicy,
        elastic: bool = False,
        delta: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        """What a sender is before any receiver: the weights' plan and schema, the session, the snapshots."""
        self._td: TensorDictBase | None = unwrap(td)  # (None once closed: let go of)
        plan = plan_for(self._td)
        plan.check(
            strided=True
        )  # (each push copies the leaves into a snapshot: views of a shard may be strided)
        if not plan.tensors:
            raise ArgumentError("`td` has no tensors: weight sync needs at least one leaf to send")
        schema = Schema.of(plan.paths, plan.tensors, self._leafwise, wire_dtype)
        self._dtypes = [
            t.dtype for t in plan.tensors
        ]  # (the leaves' own: pushes check against them)
        self._raw = schema.to_json()
        if len(self._raw) > MAX_SCHEMA_BYTES:
            raise ArgumentError(
                f"the schema of `td` takes {len(self._raw)} bytes of JSON, more than "
                f"{MAX_SCHEMA_BYTES}: send fewer, larger leaves"
            )
        # a relay moves chunks; "auto" may choose it after the handshake, so it chunks too when it may
        relaying = fanout == "relay" or (fanout == "auto" and mode == "sync")
        bucket_bytes = bucket_bytes or max(
            min(schema.total, RELAY_CHUNK) if relaying else schema.total, 1
        )
        schema.check_pieces(bucket_bytes)
        self._device = plan.device
        # its copy-ins run on the caller's stream, or on a stream of this sender's own (not the device's shared
        # one, whose other work, a call's transfer with another peer, the lanes would then wait for too)
        self._stream = None  # (no lane)
        if plan.device.type == "cuda":
            self._stream = (
                streams.own_stream(plan.device)
                if stream is None
                else streams.transfer_stream(plan.device, stream)
            )
        # where the snapshots lie, offered to every receiver: segments receivers here read, or the sender's own
        carrier = choose(
            Need(
                plan.device,
                tuple(link.backend for link in links),
                elastic,
                fanout,
                allowed(transport),
            )
        )
        self._session_id = int.from_bytes(os.urandom(4), "little") % SESSIONS
        self._s = Session(
            schema,
            bucket_bytes,
            SessionTags.of(self._session_id),
            timeout,
            bool(verify),
            mode,
            fanout,
            carrier,
            elastic=elastic,
            delta=delta,
        )
        count = carrier.sync_snapshots if mode == "sync" else buffers
        self._pool = SnapshotPool(self._s, self._device, count)
        self._pushing = False  # a thread's push is under way: another's waits for its turn
        self._checked: Plan | None = (
            None  # the plan last found to match the schema (kept while it is reused)
        )
        self._pushes = (SyncPushes if mode == "sync" else LatestPushes)(self._s, self._pool)

    #: check keyword arguments of a sender (or receiver) ahead, without building one (see :func:`check_options`)
    check_options = staticmethod(check_options)

    # -- what it is --------------------------------------------------------------------------------------
    schema = property(
        lambda self: self._s.schema, doc="The weights' schema (keys, dtypes, shapes, offsets)."
    )
    timeout = property(lambda self: self._s.timeout, doc="Seconds any wait may take.")
    mode = property(lambda self: self._s.mode, doc='``"sync"`` or ``"latest"``.')
    fanout = property(
        lambda self: self._s.fanout, doc='``"star"`` or ``"relay"``: the fan-out chosen.'
    )
    version = property(lambda self: self._s.version, doc="The last version pushed (0: none yet).")
    bucket_bytes = property(
        lambda self: self._s.bucket_bytes,
        doc="Bytes per payload message (the last message of a push may be shorter).",
    )

    @property
    def transports(self) -> dict[int, str]:
        """What carries the pushes to each receiver still served: ``"shared memory"`` (a receiver on this
        machine mapping the sender's host snapshots), ``"cuda ipc"`` (its GPU snapshots) or ``"wire"``."""
        return {m.rank: m.transport.name for m in self._s.members if m.served}

    @property
    def payload_bytes(self) -> dict[int, int]:
        """The bytes the last push's payload took from the sender to each receiver still served: the version's,
        a patch's (delta), or 0 (a receiver reading the snapshot where it lies, or one after the head of a relay
        chain, which gets it from the hop before)."""
        return {m.rank: m.payload for m in self._s.members if m.served}

    @property
    def reached(self) -> list[int] | None:
        """The receivers (ranks; an :class:`~cudarecv.ElasticSender`'s: receiver ids) that got the last blocking
        sync push whole and checked; None before the first. A receiver that failed, or lost the version to a hop
        before it in a relay chain, is not among them (an elastic sender raises for neither)."""
        with self._s.cond:
            return None if self._s.reached is None else list(self._s.reached)

    @property
    def ranks(self) -> list[int]:
        """The ranks (in the group) of the receivers still served."""
        return self._s.ranks()

    @property
    def dropped(self) -> dict[int, str]:
        """The receivers no longer served, and why (a failure named, or ``"closed by its receiver"``)."""
        return {m.rank: m.why or CLOSED_BY_RECEIVER for m in self._s.members if not m.served}

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
        """Send the current values of ``td`` to every receiver still served, as the next version.

        ``sync`` mode: returns the new version number once every receiver has it, or with ``wait=False`` one
        :class:`~cudarecv.Transfer` per receiver (their ``wait()`` returns ``None``). To a receiver reading this
        host's shared memory such a transfer is lazy: nothing of the sender runs for it until its end is needed,
        by the next push, its ``wait()`` or ``done()``, a done-callback or ``then()``, or its deadline; so
        ``torch.futures.wait_all`` and ``collect_all``, which wait in torch's C++ code, see it end only at one of
        those (wait for each with ``wait()`` instead). ``latest`` mode: copies
        the weights into a free snapshot buffer and returns the version at once; receivers get it when they
        next pull. ``timeout``: seconds each receiver may take (default: the sender's). ``values``: send these
        instead of ``td``'s (``td``'s keys, shapes, dtypes and device; ``td`` is left as it is). Pushes from
        several threads take turns, each waiting up to ``timeout`` for another's (``WaitTimeout``).

        Raises:
            TransferTimeout or PeerError naming the receiver whose link failed: it is dropped (the others
                got the version, and get the next ones); PeerError if no receiver is left. On NCCL, which cannot
                cancel what was posted to it, the failed receiver's process group is also aborted (else torch's
                watchdog would take this process down), and every receiver on that group is dropped with it:
                give each receiver a group of its own (docs/weight-sync.md, "NCCL failure semantics").
            ChecksumError (PushHeaderError without ``verify``) naming a receiver that rejected the version (relay,
                shared memory: those tell the sender; on the wire's star fan-out its pull raises), or RelayLost
                one that lost it to a failed hop before it in a relay chain: either stays served.
        """
        if self._s.closed:
            raise UsageError("this WeightSender is closed")
        timeout = self._s.timeout if timeout is None else check_timeout(timeout)
        with self._turn(timeout):
            return self._push(wait, timeout, values)

    @contextlib.contextmanager
    def _turn(self, timeout: float) -> Iterator[None]:
        """Pushes from several threads take turns, in the order they get it: wait up to ``timeout`` s for another
        thread's push to end; ``close()`` ends the wait at once."""
        cond = self._s.cond
        with cond:
            if not cond.wait_for(lambda: self._s.closed or not self._pushing, timeout=timeout):
                raise WaitTimeout(
                    f"another thread's push held this WeightSender for {timeout:g} s (pushes from "
                    "several threads take turns)"
                )
            if self._s.closed:
                raise UsageError(
                    "this WeightSender was closed while a push waited for another thread's push"
                )
            self._pushing = True
        try:
            yield
        finally:
            with cond:
                self._pushing = False
                cond.notify_all()

    def _push(self, wait: bool, timeout: float, values: Any) -> int | list[Transfer]:
        """:meth:`push`, in this thread's turn."""
        self._pushes.before_push()  # sync: the storage is reused, the previous push must be out
        live = [m for m in self._s.members if m.served]
        if not live and not self._s.elastic:
            self._pushes.untold(live)
            raise PeerError(
                f"no receiver of this WeightSender is left ({self.dropped}): "
                "connect new receivers with a new WeightSender"
            )
        # the copy-in runs on this sender's stream; each receiver's lane follows it (Lane.after)
        return self._pushes.push(self._plan(values), live, timeout, wait, self._stream)

    def _plan(self, values: Any) -> Plan:
        """The plan of what this push sends, checked against the handshake's schema."""
        schema = self._s.schema
        td = self._td if values is None else unwrap(values)
        if td is None:
            raise UsageError("this WeightSender is closed")
        plan = plan_for(td)
        if (
            plan is self._checked
        ):  # the same leaves as last push's (a plan is rebuilt when one changes)
            return plan
        if [tuple(map(str, p)) for p in plan.paths] != [leaf.key for leaf in schema.leaves] or any(
            tuple(t.shape) != leaf.shape or t.dtype != dtype
            for t, leaf, dtype in zip(plan.tensors, schema.leaves, self._dtypes)
        ):
            if values is not None:
                raise ArgumentError(
                    "`values` must have the keys, shapes and dtypes of the sender's `td` "
                    f"({len(schema.leaves)} leaves, {schema.total} bytes)"
                )
            raise SchemaError(
                "the tensordict changed structure since the handshake: build a new WeightSender"
            )
        if values is not None and plan.device != self._device:
            raise ArgumentError(
                f"`values` are on {plan.device}, the sender's `td` on {self._device}: "
                f"pass them on {self._device}"
            )
        self._checked = plan
        return plan

    # -- ending ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish what is in flight, tell every receiver, and stop (within ``timeout``). Idempotent.

        A receiver's pending or next ``pull()`` then raises :class:`SenderClosed` at once (on gloo links);
        its last version stays readable.
        """
        if self._s.closed:
            return
        self._pushes.finish_in_flight()
        with self._s.cond:
            self._s.closed = True
            self._s.cond.notify_all()  # a push waiting for a free snapshot (another thread's) ends now
        members = self._s.members
        for member in members:
            if member.listener is not None and member.standing in OWED:
                member.driver.submit(
                    functools.partial(last_word, self._s, self._pool, member, CLOSED)
                )
        deadline = time.monotonic() + self._s.timeout

        def left() -> float:
            return max(deadline - time.monotonic(), 0.0)

        for (
            member
        ) in members:  # a failed receiver's thread may wait on its link for good: not joined
            member.driver.stop(0.0 if member.failed else left())
        for (
            member
        ) in members:  # each listener ends with its receiver's BYE (a failed one may never)
            if member.listener is not None and not member.failed:
                member.listener.join(left())
        # let go of the weights, the snapshots and the process group (a group kept alive past
        # destroy_process_group() by objects in reference cycles is destroyed at interpreter exit,
        # where gloo aborts the process)
        join_aborts(self._s, left())  # (the abort threads its drops started: fanout.abort_group)
        self._td = None
        self._pool.clear()
        for member in members:
            with contextlib.suppress(
                UsageError
            ):  # (its pair group: the last end on it shuts it down)
                release_pair(member.lane.wire)
            member.let_go()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WeightSender(SessionSender):
    """Push the values of ``td`` to one or more :class:`~cudarecv.WeightReceiver` ranks of a process group, every
    step.

    Args:
        td: the weights (a tensordict or tensorclass; ``TensorDict.from_module(model)``
            shares the model's parameters, so each push sends their current values). Plain tensors: DTensor
            leaves (an FSDP2 model's) take a :class:`~cudarecv.ShardedSender` on every rank of their mesh.
        dst: a global rank or a list of them. Exclusive with ``group_dst``.

    Keyword Args:
        group: the process group (a standalone one with ``group_dst``).
        group_dst: a rank or ranks in ``group``.
        bucket_bytes: bytes per payload message (default: 1 MiB in ``sync`` mode unless ``fanout="star"``, the
            relay's chunk and faster than one message over loopback too; else the whole storage at once).
        timeout: seconds any wait may take (handshake, each receiver's transfer).
        verify: send a BLAKE3 digest with every push; receivers reject a corrupted payload.
        stream: the CUDA stream for GPU weights (default: cudarecv's dedicated stream).
        mode: ``"sync"`` (every receiver gets every version; a blocking push waits for them) or ``"latest"``
            (push never waits; each pull gets the newest version).
        buffers: ``latest`` mode: snapshot buffers kept (default: receivers + 2, so that a push never waits;
            fewer bound memory, and a push then may wait for a transfer in flight, never for a receiver
            between pulls).
        fanout: ``"star"``, ``"relay"`` (``sync`` mode: through a chain of the receivers in the order given,
            each forwarding the chunks it receives) or ``"auto"`` (relay when a receiver is on another host).
        transport: ``"auto"`` (receivers on this machine map the sender's snapshots: shared memory for host
            weights, CUDA IPC for GPU weights; a push then sends them only its header) or ``"wire"``.
        delta: each push on the wire sends a receiver only the words that changed since the version it holds
            (:mod:`~cudarecv.weights.delta`: a patch, chosen per 1 MiB block by size, applied in the receiver's
            spare buffer and checked with ``verify``), or the version whole where that is smaller or the receiver
            holds none (new, or after a failure). Sync mode; a relay chain forwards the patch as it is when every
            receiver of it holds its base; receivers on this machine read the snapshot where it lies and take no
            patch. The sender keeps two more copies of the weights (the last version, and the buffer a patch is
            written in); each receiver one more, at its first patch.
        wire_dtype: a floating-point dtype (e.g. ``torch.bfloat16`` from an fp32 trainer) its floating-point
            leaves travel and land in: each push casts them into the snapshot on the weights' device (a delta is
            computed in it, where small updates leave most words unchanged); integer and other leaves go as they
            are. The receivers' ``expect`` (and ``schema``) hold them in that dtype; one that expects another
            is refused at the handshake, naming the key.

    Construction performs the handshake with every receiver and raises if one rejects the schema
    (:class:`SchemaError`, naming it and the first differing key) or could not start (:class:`ReceiverFailed`).

    The other senders: :class:`~cudarecv.ElasticSender` (receivers join and leave at any time through a store, by
    name) and :class:`~cudarecv.ShardedSender` (DTensor leaves, or each receiver sent only the slices it wants).

    Example:
        >>> sender = WeightSender(TensorDict.from_module(policy), dst=[1, 2], bucket_bytes=1 << 20)
        >>> version = sender.push()      # blocks until every receiver has the bytes
        >>> async_sender = WeightSender(TensorDict.from_module(policy), dst=[1, 2], mode="latest")
        >>> version = async_sender.push()  # returns at once; actors pull the newest when ready
    """

    def __init__(
        self,
        td: Any,
        dst: int | list[int] | None = None,
        *,
        group: Any = None,
        group_dst: int | list[int] | None = None,
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
        dsts, group_dsts = check_peers(dst, "dst"), check_peers(group_dst, "group_dst")
        if (dsts is None) == (group_dsts is None):
            raise ArgumentError(
                "pass exactly one of `dst` and `group_dst` (a rank or a list of ranks); for receivers "
                "that join through a store, build a cudarecv.ElasticSender(td, store, name)"
            )
        if _has_dtensors(td):
            raise ArgumentError(
                "`td` holds DTensor leaves (an FSDP2 model's): build a cudarecv.ShardedSender, with "
                "the same arguments, on every rank of their mesh"
            )
        if dsts is not None:
            links = [resolve(d, None, group, "dst", "group_dst") for d in dsts]
        else:
            assert group_dsts is not None  # (exactly one of the two: checked above)
            links = [resolve(None, d, group, "dst", "group_dst") for d in group_dsts]
        if mode == "latest" and not all(rules(link).latest for link in links):
            raise UsageError(
                "mode='latest' needs a gloo link (NCCL runs a pair's sends and receives in order on "
                "one stream, so a receiver's ask could not pass a posted receive): use a gloo group "
                "for weight sync (GPU weights are staged through page-locked memory)"
            )
        super().__init__(
            td,
            links,
            bucket_bytes=bucket_bytes,
            timeout=timeout,
            verify=verify,
            stream=stream,
            mode=mode,
            buffers=buffers or len(links) + 2,
            fanout=fanout,
            transport=transport,
            delta=delta,
            wire_dtype=wire_dtype,
        )
        # a stream per receiver (unless the caller gave one), each step after this sender's copies of a version
        lanes = [
            lane_for(
                link,
                self._device,
                stream,
                streams.StagingPool(),
                peers_at_once=True,
                after=self._stream,
            )
            for link in links
        ]
        try:
            members = enrol(self._s, self._pool, lanes, self._raw, self._session_id)
        # a receiver refused, or a handshake failed: each end lets go of its pair
        except BaseException:
            for lane in lanes:
                release_pair(lane.wire)
            raise
        if self._s.fanout == "auto":
            self._s.fanout = (
                "relay" if mode == "sync" and any(m.host != host_id() for m in members) else "star"
            )
        serve(self._s, self._pool, members)


def _has_dtensors(td: Any) -> bool:
    """Whether ``td`` holds a DTensor leaf."""
    try:
        return is_sharded(walk(unwrap(td))[1])
    except Exception:  # noqa: BLE001 - a bad `td` is the constructor's to report
        return False
