"""A sender rank of a sharded weight sync: :class:`ShardedSender` (``ShardedSender(td, dst=[...])``), for a ``td``
with DTensor leaves (an FSDP2 model's ``TensorDict.from_module``), or plain tensors sent as slices.

Every rank of the trainer's mesh builds one. At construction each exchanges layouts with every receiver
(:mod:`~cudarecv.weights.sharded.exchange`) and computes, for each, the pieces it sends: the overlap of its share
of each leaf (replicas split a replicated leaf between them) with the box the receiver wants. Receivers that
want the same pieces of this rank share one plain :class:`~cudarecv.WeightSender` of those pieces (views of the
local shards; its messages cut leaf by leaf, so that each lands where its leaf goes), with its transports, fan-out (a relay chain across hosts), modes, checks and timeouts; each push
pushes them all. Nothing is gathered: every byte leaves the rank that holds it for the ranks that want it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from ...core import streams
from ...core.checks import check_timeout
from ...core.errors import ArgumentError, PeerError, SchemaError, UsageError, WaitTimeout
from ...core.transfer import Transfer
from ...plan.boxes import Box
from ...plan.walk import unwrap, walk
from ...wire.staging import lane_for, release_pair
from ..options import Fanout, Mode, TransportPolicy, check_sender
from ..sender import WeightSender
from . import exchange
from .layout import held, in_order, on_wire_layout, piece_views, pieces, sender_layout

if TYPE_CHECKING:
    from torch import Tensor
    from typing_extensions import Self


class PieceSender(WeightSender):
    """A plain sender of one rank's pieces: a leafwise schema (see :mod:`cudarecv.weights.schema`), so that a
    receiver lands each message where the piece goes in its own layout."""

    _leafwise = True


class ShardedSender:
    """One rank of a sharded sender (see the module docstring), for a ``td`` with DTensor leaves, built with the
    same arguments on every rank of their mesh; or for plain tensors on one rank, sending each receiver only the
    slices it wants (a :class:`~cudarecv.ShardedReceiver` with ``want``). Its receivers are
    :class:`~cudarecv.ShardedReceiver` s. It pushes through one plain :class:`~cudarecv.WeightSender` per group
    of receivers that want the same pieces of this rank, and has their arguments (``dst`` or ``group_dst``, and
    the keyword arguments); its :attr:`layout` says what it holds.

    Example:
        >>> fully_shard(model, mesh=init_device_mesh("cpu", (2,)))   # trainer ranks 0 and 1
        >>> sender = cudarecv.ShardedSender(TensorDict.from_module(model), dst=[2, 3])
        >>> sender.push()   # each rank sends what it holds, to the receivers that want it
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
        self._closed, self._senders = False, []
        options = dict(
            bucket_bytes=bucket_bytes,
            timeout=timeout,
            verify=verify,
            stream=stream,
            mode=mode,
            buffers=buffers,
            fanout=fanout,
            transport=transport,
            delta=delta,
            wire_dtype=wire_dtype,
        )
        self._timeout = check_sender(
            timeout, bucket_bytes, transport, mode, buffers, fanout, delta, wire_dtype
        )
        peers, links, global_ranks = exchange.peer_links(dst, group_dst, group, "dst", "group_dst")
        keys, tensors = walk(unwrap(td))
        self._keys = [tuple(map(str, k)) for k in keys]
        self._layout = on_wire_layout(sender_layout(keys, tensors), wire_dtype)
        locals_ = [held(t, ".".join(k)) for k, t in zip(self._keys, tensors)]
        self._boxes = [box for _, box in locals_]
        device = streams.explicit(locals_[0][0].device)
        lanes = [
            lane_for(link, device, stream, streams.StagingPool(), peers_at_once=True)
            for link in links
        ]
        #: receiver (rank as given) -> the pieces this rank sends it: [(leaf index, Box)]
        self._moved: dict[int, list[tuple[int, Box]]] = {}
        try:
            wanted = exchange.offer(lanes, self._layout, self._timeout)
            for peer, want in zip(peers, wanted):
                problem = self._layout.difference(want)
                # the receiver checked it: a receiver that lies about it is refused here
                if problem:
                    raise SchemaError(
                        f"receiver rank {peer} answered a layout that does not match: {problem}"
                    )
                self._moved[peer] = pieces(self._layout, in_order(want, self._layout))
        # the exchange's ends let go of their pair groups (NCCL), as the receivers' do
        except BaseException:
            for lane in lanes:
                release_pair(lane.wire)
            raise
        # receivers that want the same pieces of this rank share one sender (a relay chain across hosts)
        groups: dict[tuple, list[int]] = {}
        for peer in peers:
            if self._moved[peer]:
                groups.setdefault(tuple(self._moved[peer]), []).append(peer)
        self._mode, self._versions = mode, 0
        self._turn_lock = threading.Lock()
        try:
            for moved, members in groups.items():
                views = piece_views(
                    self._layout.parts, list(moved), [t for t, _ in locals_], self._boxes
                )
                where = {"dst": members} if global_ranks else {"group": group, "group_dst": members}
                self._senders.append((list(moved), PieceSender(views, **where, **options)))
        except BaseException:
            self.close()
            raise
        finally:  # the layout exchange's ends let go of their pair groups (NCCL): each sender holds its own
            for lane in lanes:
                release_pair(lane.wire)

    # -- what it is --------------------------------------------------------------------------------------
    layout = property(
        lambda self: self._layout,
        doc="This rank's layout: each leaf's whole shape and the box it "
        "sends (a :class:`~cudarecv.weights.sharded.layout.Layout`).",
    )
    timeout = property(lambda self: self._timeout, doc="Seconds any wait may take.")
    mode = property(lambda self: self._mode, doc='``"sync"`` or ``"latest"``.')
    version = property(lambda self: self._versions, doc="The last version pushed (0: none yet).")

    @property
    def payload_bytes(self) -> dict[int, int]:
        """The bytes the last push's payloads took from this rank to each receiver it serves (its pieces: the
        versions', or patches with ``delta``; see :attr:`WeightSender.payload_bytes`)."""
        sent: dict[int, int] = {}
        for _, sender in self._senders:
            for rank, nbytes in sender.payload_bytes.items():
                sent[rank] = sent.get(rank, 0) + nbytes
        return sent

    @property
    def fanout(self) -> str:
        """``"relay"`` if a group of receivers of this rank's pieces is served by a chain, else ``"star"``."""
        return "relay" if any(s.fanout == "relay" for _, s in self._senders) else "star"

    @property
    def bucket_bytes(self) -> int:
        """Bytes per payload message of this rank's plain senders (0: it sends nothing)."""
        return max((s.bucket_bytes for _, s in self._senders), default=0)

    @property
    def plan(self) -> dict[int, list[tuple[str, Box]]]:
        """Receiver rank -> the pieces this rank sends it: (leaf name, :class:`~cudarecv.plan.boxes.Box` of the whole
        leaf); a receiver that gets nothing from this rank maps to ``[]``."""
        return {
            rank: [(self._layout.parts[i].name, box) for i, box in moved]
            for rank, moved in self._moved.items()
        }

    @property
    def transports(self) -> dict[int, str]:
        """Receiver rank -> what carries this rank's pieces to it (see :attr:`WeightSender.transports`)."""
        out: dict[int, str] = {}
        for _, sender in self._senders:
            out.update(sender.transports)
        return out

    @property
    def ranks(self) -> list[int]:
        """The receivers this rank still serves (those it sends pieces to)."""
        return sorted({r for _, s in self._senders for r in s.ranks})

    @property
    def dropped(self) -> dict[int, str]:
        """The receivers this rank no longer serves, and why."""
        out: dict[int, str] = {}
        for _, sender in self._senders:
            out.update(sender.dropped)
        return out

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
        """Send this rank's pieces of the current values of ``td`` to every receiver that wants some, as the next
        version (see :meth:`WeightSender.push`; ``values``: a tensordict like ``td``, DTensors placed alike)."""
        if self._closed:
            raise UsageError("this WeightSender is closed")
        timeout = self._timeout if timeout is None else check_timeout(timeout)
        if not self._turn_lock.acquire(timeout=timeout):
            raise WaitTimeout(
                f"another thread's push held this WeightSender for {timeout:g} s (pushes from several "
                "threads take turns)"
            )
        try:
            return self._push(wait, timeout, values)
        finally:
            self._turn_lock.release()

    def _push(self, wait: bool, timeout: float, values: Any) -> int | list[Transfer]:
        live = [(moved, s) for moved, s in self._senders if s.ranks]
        if self._senders and not live:
            raise PeerError(
                f"no receiver of this WeightSender is left ({self.dropped}): "
                "connect new receivers with a new WeightSender"
            )
        locals_ = self._values(values)
        self._versions += 1
        transfers: list[Transfer] = []
        failures: list[BaseException] = []
        for moved, sender in live:
            piece_values = (
                None
                if locals_ is None
                else piece_views(self._layout.parts, moved, locals_, self._boxes)
            )
            try:
                out = sender.push(wait=False, timeout=timeout, values=piece_values)
            except Exception as error:  # noqa: BLE001 - the other groups still get the version; raised below
                failures.append(error)
                continue
            if isinstance(out, list):
                transfers.extend(out)
        if not wait:
            if failures:
                raise failures[0]
            return transfers
        for transfer in transfers:
            try:
                transfer.wait()
            except Exception as error:  # noqa: BLE001 - every receiver's transfer is waited for first
                failures.append(error)
        if failures:
            raise failures[0]
        return self._versions

    def _values(self, values: Any) -> list[Tensor] | None:
        """The local tensors of ``values``, checked to be placed like ``td``'s."""
        if values is None:
            return None
        keys, tensors = walk(unwrap(values))
        if [tuple(map(str, k)) for k in keys] != self._keys:
            raise ArgumentError("`values` must have the keys of the sender's `td`")
        out = []
        for key, t, part, box in zip(self._keys, tensors, self._layout.parts, self._boxes):
            local, mine = held(t, ".".join(key))
            if tuple(t.shape) != part.shape or t.dtype != part.dtype or mine != box:
                raise ArgumentError(
                    f"`values`: leaf {part.name!r} is {t.dtype} {list(t.shape)} holding "
                    f"{mine.to_json()}, the sender's `td` {part.dtype} {list(part.shape)} holding "
                    f"{box.to_json()}: pass values placed like `td`"
                )
            out.append(local)
        return out

    # -- ending ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every plain sender of this rank's pieces (each tells its receivers). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for _, sender in self._senders:
            sender.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
