"""Moving messages between the wire and memory the wire cannot touch.

gloo reads and writes host memory only; NCCL device memory only. When a
tensordict lives elsewhere (CUDA storage on gloo, host storage on NCCL), each
message goes through a staging buffer on the wire's side, with the copy on
cudarecv's streams:

- *ring* staging (chunks, consolidated messages): two buffers of one message
  each; the copy of message i overlaps the transfer of message i+1;
- *full* staging (per-leaf messages, all posted at once; buckets): a buffer
  holding every message, allocated once per plan;
- on NCCL, *pageable* host memory also goes through one pinned buffer holding
  every message (the owner's, reused): a copy between device memory and
  pageable memory is synchronous, so in the call that posts it would wait for
  the wire, i.e. for the peer.

Staging buffers belong to their owner (a tensordict's plan, a weight sender or
receiver), whose transfers run one at a time, and carry a *fence*: the CUDA
event of the last stream copy that reads or writes them. Nothing posts into a
buffer, or copies into it, before its fence has fired, so a copy still queued
from the previous transfer can never see the next transfer's bytes.

Sub-protocols here are driven with ``yield from`` inside a transfer protocol
(:mod:`cudarecv.core.transfer`): what they yield are ``Work``-like objects the host waits on.
On NCCL the host never waits for the wire: ``Work.wait()`` orders the stream.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from ..core import streams as _cuda
from ..core.errors import ArgumentError, UsageError
from ..core.host_copy import copy_bytes
from ..core.link import Link
from ..core.protocol import Protocol, Work
from ..core.transport import post

#: ``landed(i)``: message i is in its destination (run on the stream that wrote it)
Landed = Callable[[int], None]


@dataclass
class Lane:
    """One transfer's link, stream (``None`` when neither end touches CUDA) and staging pool."""

    link: Link
    stream: torch.cuda.Stream | None = None
    pool: _cuda.StagingPool = field(default_factory=_cuda.StagingPool)
    #: whether this transfer's NCCL messages go as batches on the group's communicator (the stock wire's
    #: per-leaf messages, where :func:`~cudarecv.core.transport.nccl_batching` says) or as single ops on the
    #: pair's (everything else): both ends post alike (:mod:`cudarecv.core.transport`)
    batched: bool = False
    #: the link the messages go on: ``link`` itself (None), or a pair group of the two ends' own (see
    #: :func:`pair_link`); ``link`` keeps naming the peer by its rank in the group
    wire: Link | None = None
    #: a stream that each step of this lane comes after (a weight sender's copy stream, where its lanes have
    #: streams of their own), or None
    after: torch.cuda.Stream | None = None
    #: the stream of the copies between host memory and device buffers (host memory on NCCL): the link's own
    #: (a weight end's, :func:`~cudarecv.core.streams.link_copy_stream`), or None: the device's shared one
    #: (plain calls, one transfer at a time on the device's dedicated stream)
    copier: torch.cuda.Stream | None = None

    @property
    def nccl(self) -> bool:
        return self.link.backend == "nccl"

    @property
    def cuda(self) -> torch.cuda.Stream:
        """The transfer's CUDA stream, on the paths that have one (CUDA memory, or NCCL)."""
        assert self.stream is not None, "a CUDA path of a lane without a stream"
        return self.stream

    @property
    def device(self) -> torch.device:
        """The device whose memory the transfer touches (its stream's; the CPU without one)."""
        return self.stream.device if self.stream is not None else torch.device("cpu")

    def on_stream(self) -> AbstractContextManager[object]:
        if self.stream is None:
            return nullcontext()
        if self.after is not None and self.after is not self.stream:
            self.stream.wait_stream(
                self.after
            )  # (what the owner queued there: a version's copy-in)
        return torch.cuda.stream(self.stream)

    def post(
        self, sending: bool, tensors: Sequence[Tensor], tags: Sequence[int]
    ) -> list[dist.Work]:
        return post(self.wire or self.link, sending, tensors, tags, batch=self.batched)


def lane_for(
    link: Link,
    device: torch.device,
    stream: torch.cuda.Stream | None,
    pool: _cuda.StagingPool,
    *,
    peers_at_once: bool = False,
    after: torch.cuda.Stream | None = None,
    cuda: torch.device | None = None,
) -> Lane:
    """The transfer's lane: a CUDA stream when the memory or the backend is on a GPU.

    ``stream``: the caller's, used as it is (a weight sender given one runs every receiver's transfer on
    it, one after another: a receiver that stalls stalls the others there), or None: cudarecv's own, the
    device's dedicated stream, or, with ``peers_at_once`` (an owner that talks to several peers at once:
    the weight ends), a stream of the link's own (:func:`~cudarecv.core.streams.link_stream`), so that a
    transfer with one peer never waits for another's. ``peers_at_once`` also moves the messages on a registered
    NCCL group onto a pair group of the two ends' own (:func:`pair_link`; :func:`release_pair`). ``after``: a
    stream each step of the lane comes after. ``cuda``: the device a lane of host memory stages through
    on NCCL (default: the ``stream`` given, else the calling thread's current device; a lane built on a
    background thread must pass its owner's, since a new thread's current device is 0).
    """
    if device.type != "cuda" and link.backend != "nccl":
        if stream is not None:
            raise ArgumentError(
                "`stream` was given, but neither the tensordict (on the CPU) nor the "
                f"{link.backend} backend uses CUDA: pass stream=None"
            )
        return Lane(link, None, pool)
    if not torch.cuda.is_available():
        raise UsageError(
            f"the {link.backend} backend with a tensordict on {device} needs CUDA, "
            "which this process cannot use"
        )
    host = device.type != "cuda"
    if host:  # host memory staged through a device's buffers
        if cuda is not None:
            device = _cuda.explicit(torch.device(cuda))
        elif stream is not None:
            device = torch.device(stream.device)
        else:
            device = torch.device("cuda", torch.cuda.current_device())
    wire = pair_link(link) if peers_at_once else link
    if stream is None and peers_at_once:
        lane_stream = _cuda.link_stream(device, wire.pg, wire.peer)
    else:
        lane_stream = _cuda.transfer_stream(device, stream)
    # what the caller queued on its stream (writes of the values, reads of the old ones) comes before the
    # transfer; the caller's stream is never blocked
    _cuda.follow_caller(lane_stream)
    # host memory on NCCL: its copies on a copy stream of the link's own, which waits for this link's stream
    # alone (on the device's one, a link's copies would queue behind every other link's backlog)
    copier = (
        _cuda.link_copy_stream(device, wire.pg, wire.peer)
        if peers_at_once and host and link.backend == "nccl"
        else None
    )
    return Lane(
        link, lane_stream, pool, wire=None if wire is link else wire, after=after, copier=copier
    )


@dataclass
class _Pair:
    """A pair group this process formed with one peer of a user's group, and how many weight ends use it."""

    link: Link
    users: int = 0


#: user group -> peer -> the pair group of this rank and that peer (see :func:`pair_link`)
_PAIRS: weakref.WeakKeyDictionary[object, dict[int, _Pair]] = weakref.WeakKeyDictionary()
_PAIRS_LOCK = threading.Lock()
PAIR_PREFIX = "cudarecv/pair"


def eagerly_initialised(pg: object) -> bool:
    """Whether ``pg`` was initialised eagerly (``init_process_group(device_id=...)``, which ``new_group``
    inherits): torch then runs its point-to-point ops on the group's one communicator."""
    return getattr(pg, "bound_device_id", None) is not None


def _registered_store(link: Link) -> dist.Store | None:
    """The store of ``link.pg`` if torch.distributed knows the group (None: a standalone group)."""
    from torch.distributed import distributed_c10d as c10d

    found = c10d._world.pg_map.get(link.pg)
    return None if found is None else found[1]


#: the store a pair group of ``link``'s two ends forms on: a registered group's (the strict NCCL stand-in
#: names its own); None for a standalone group, whose messages then go on the group itself
pair_store: Callable[[Link], dist.Store | None] = _registered_store


def pair_link(link: Link) -> Link:
    """The link a weight end's messages to ``link.peer`` go on: ``link`` itself, or, on an NCCL group that
    torch.distributed knows (any size, initialised lazily or eagerly), a link over a pair group of the two
    ends' own. Each call takes a reference: give it back with :func:`release_pair`.

    Why a group of the ends' own, even on a group of two: a receiver that fails on NCCL leaves posted ops
    that NCCL cannot cancel, which only aborting their communicator ends (:func:`cudarecv.weights.fanout.abort_group`),
    and ``ProcessGroupNCCL.abort()`` aborts every communicator of its group; on the user's group (the default
    group, whose collectives a trainer's FSDP/DDP use) that would end the user's training. On a pair group of
    cudarecv's own an abort ends that receiver's link alone. It costs no communicator more: lazily, torch makes
    one two-rank communicator per peer for point-to-point ops anyway (never made on the user's group now), and
    its collectives' communicator is another. Eagerly (``device_id=``), torch would run every point-to-point op
    on the group's one communicator, in posting order whatever the peer (``pointToPoint`` in
    ProcessGroupNCCL.cpp: "In eagerInit mode, reuse the parent comm"), so a relay would form a wait cycle and a
    stalled receiver stall every other; a pair group of its own has a stream of its own.

    The pair is a standalone ProcessGroupNCCL on the group's store, made lazily (its communicator at its first
    op), once per group and peer in this process while some weight end uses it (:func:`_formation` names it).
    Both ends must be cudarecv weight ends (a stock peer posts on the group's communicator). A standalone group
    (not registered: no store to form a pair on) is used as it is; initialised eagerly it cannot be (the cycle
    above): :class:`UsageError`.
    """
    if link.backend != "nccl":
        return link
    store = pair_store(link)
    if store is None:
        if eagerly_initialised(link.pg) and link.pg.size() >= 3:
            raise UsageError(
                "an eagerly initialised NCCL group that torch.distributed does not know: cudarecv cannot "
                "form a pair group on its store; pass a registered group (dist.new_group), or one made "
                "lazily (without device_id)"
            )
        return link
    with _PAIRS_LOCK:
        per_group = _PAIRS.get(link.pg)
        if per_group is None:
            per_group = _PAIRS[link.pg] = {}
        pair = per_group.get(link.peer)
        if pair is None:
            pg = make_pair(link, _formation(link, store), store)
            pair = per_group[link.peer] = _Pair(
                Link(pg, 1 if link.pg.rank() < link.peer else 0, False, "nccl")
            )
        pair.users += 1
        return pair.link


def _formation(link: Link, store: dist.Store) -> str:
    """The store prefix of a new pair group of this rank and ``link.peer``: ``cudarecv/pair/<low>-<high>/<n>``,
    the n-th pair group this end forms with that peer on the group.

    Both ends count their own formations on the group's store (``store.add`` on a key of their side: low or
    high), so each end's n-th formation meets the other's n-th: both ends form one when a weight end is made
    on each (a sender and its receiver, a relay's neighbours), and each formation is new on both after an
    abort evicted the pair (:func:`evict_pair`) or its last end let go of it (:func:`release_pair`). No end
    waits for the other here (the pair's own rendezvous is NCCL's, at its first op), nothing races (a count
    on the store is atomic), and the prefix is new for each formation, also across a process's restart (the
    count lives in the store), so a pair never reads the NCCL unique id of an earlier one. One end that keeps
    an old pair (a weight end still open on it) while the other forms a new one puts them out of step: close
    a dropped receiver before making a new one with the same sender rank."""
    me = link.pg.rank()
    low, high = sorted((me, link.peer))
    base = f"{PAIR_PREFIX}/{low}-{high}"
    n = store.add(f"{base}/formed-by-{'low' if me == low else 'high'}", 1)
    return f"{base}/{n}"


def _nccl_pair(link: Link, prefix: str, store: dist.Store) -> dist.ProcessGroup:
    """A standalone two-rank ProcessGroupNCCL of this rank and ``link.peer`` on ``store``, under ``prefix``."""
    me, peer = link.pg.rank(), link.peer
    options = dist.ProcessGroupNCCL.Options()
    timeout = link.group_timeout()
    if timeout is not None:
        options._timeout = timedelta(seconds=timeout)
    pair_store = dist.PrefixStore(prefix, store)
    return cast(
        dist.ProcessGroup,
        dist.ProcessGroupNCCL(pair_store, 0 if me < peer else 1, 2, options),
    )


#: how :func:`pair_link` makes a pair group, given its prefix and store (the strict NCCL stand-in makes its own)
make_pair: Callable[[Link, str, dist.Store], dist.ProcessGroup] = _nccl_pair


def _find(wire: Link) -> tuple[dict[int, _Pair], int, _Pair] | None:
    """Under ``_PAIRS_LOCK``: where the pair group of ``wire`` is kept, if it is."""
    for per_group in list(_PAIRS.values()):
        for peer, pair in per_group.items():
            if pair.link is wire:
                return per_group, peer, pair
    return None


def release_pair(wire: Link | None) -> None:
    """A weight end let go of the pair link ``wire`` (``Lane.wire``; None: it had none): the last end's release
    shuts the pair group down (``shutdown()``: its communicators destroyed; a standalone group has no
    ``destroy_process_group``). An evicted (aborted) pair is gone already."""
    if wire is None:
        return
    with _PAIRS_LOCK:
        found = _find(wire)
        if found is None:
            return
        per_group, peer, pair = found
        pair.users -= 1
        if pair.users > 0:
            return
        del per_group[peer]
    _shut(wire.pg)


def evict_pair(wire: Link) -> bool:
    """The pair group of ``wire`` was aborted: no end may use it again (a new weight end with that peer forms a
    new one). Whether it was kept."""
    with _PAIRS_LOCK:
        found = _find(wire)
        if found is None:
            return False
        del found[0][found[1]]
        return True


def is_pair(wire: Link | None) -> bool:
    """Whether ``wire`` is a pair group of cudarecv's own, in use (:func:`pair_link`)."""
    if wire is None:
        return False
    with _PAIRS_LOCK:
        return _find(wire) is not None


def pairs_held() -> int:
    """How many pair groups this process keeps (tests: none once every weight end closed)."""
    with _PAIRS_LOCK:
        return sum(len(per_group) for per_group in _PAIRS.values())


#: how long the last end's release waits for a pair group's ``shutdown()`` before it aborts the group instead
SHUTDOWN_WAIT = 5.0


def _shut(pg: object) -> None:
    """Shut a pair group down that nobody uses any more. ``ProcessGroupNCCL.shutdown()`` waits for what is still
    posted on it (torch 2.6+): a pull that timed out may have left a header receive posted that nothing will ever
    match. So it runs on a thread of its own, waited for :data:`SHUTDOWN_WAIT` s, after which the group is aborted
    (local, it waits for nothing; the posted ops end with it) and the thread waited for as long again."""
    from ..core.log import logger

    shutdown, abort = getattr(pg, "shutdown", None), getattr(pg, "abort", None)
    if shutdown is None:
        return

    def run() -> None:
        try:
            shutdown()
        except Exception as error:  # noqa: BLE001 - said; the group goes with its last reference
            logger.warning("cudarecv: a pair group could not be shut down (%s)", error)

    thread = threading.Thread(target=run, name="cudarecv-pair-shutdown", daemon=True)
    thread.start()
    thread.join(SHUTDOWN_WAIT)
    if not thread.is_alive():
        return
    logger.warning(
        "cudarecv: a pair group's shutdown() waited %.0f s for ops still posted on it: aborted instead",
        SHUTDOWN_WAIT,
    )
    try:
        if abort is not None:
            abort()
    except Exception as error:  # noqa: BLE001 - said; the group goes with its last reference
        logger.warning("cudarecv: a pair group could not be aborted (%s)", error)
    thread.join(SHUTDOWN_WAIT)


def _byte(t: Tensor) -> Tensor:
    return t.reshape(-1).view(torch.uint8)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _base(t: Tensor) -> Tensor:
    return t._base if t._base is not None else t


def host_waits(lane: Lane, protocol: Protocol) -> Protocol:
    """``protocol``, then the host waits for the lane's stream, so the transfer ends only once the stream's
    copies out of or into host memory have run (host leaves staged through device buffers on NCCL: pinned
    memory's copies are asynchronous, and the caller may write or read the leaves once the call returns)."""
    result = yield from protocol
    yield [_cuda.EventWork(_cuda.record(lane.cuda))]
    return result


def wire_can_touch(lane: Lane, tensors: Sequence[Tensor]) -> bool:
    """Whether the wire reads and writes ``tensors`` in place (host memory on gloo, device memory on NCCL)."""
    return not tensors or (tensors[0].device.type == "cuda") == lane.nccl


def _host_ready(lane: Lane, buffer: Tensor) -> None:
    """Block until no queued stream copy still reads or writes host ``buffer``."""
    event = lane.pool.fence(buffer)
    if event is not None:
        event.synchronize()


def recv_into(
    lane: Lane,
    dests: Sequence[Tensor],
    tags: Sequence[int],
    staging: Sequence[Tensor] | None = None,
    landed: Landed | None = None,
) -> Protocol:
    """Receive message i into ``dests[i]`` (contiguous); ``landed(i)`` once it is there.

    ``landed`` runs on the stream that wrote ``dests[i]`` (the transfer stream, or
    the copy stream of a ring into host memory). ``staging`` (full staging, one
    buffer per message on the wire's side, views of one buffer) is used when
    the wire cannot write ``dests``; without it a ring of two buffers.
    """
    n = len(dests)
    if wire_can_touch(lane, dests):
        copies_from_host = lane.stream is not None and not lane.nccl and landed is not None and n
        if copies_from_host:
            _host_ready(lane, _base(dests[0]))  # landed() copies out of these host buffers
        with lane.on_stream():
            works = lane.post(False, dests, tags)
            if lane.nccl:
                for work in works:
                    work.wait()  # orders the transfer stream; the host goes on
                if landed is not None:
                    for i in range(n):
                        landed(i)
                return
        if landed is None:
            yield works  # one step for the whole batch
        else:
            for i, work in enumerate(works):
                yield [work]
                with lane.on_stream():
                    landed(i)
        if copies_from_host:
            lane.pool.set_fence(_base(dests[0]), _cuda.record(lane.cuda))
        return
    if staging is not None:
        yield from _recv_full(lane, dests, tags, staging, landed)
    elif lane.nccl:
        yield from _recv_ring_nccl(lane, dests, tags, landed)
    else:
        yield from _recv_ring_gloo(lane, dests, tags, landed)


def _recv_full(
    lane: Lane,
    dests: Sequence[Tensor],
    tags: Sequence[int],
    staging: Sequence[Tensor],
    landed: Landed | None,
) -> Protocol:
    """gloo into CUDA memory, every message at once through ``staging`` (pinned)."""
    base = _base(staging[0])
    _host_ready(lane, base)
    yield lane.post(False, staging, tags)
    with lane.on_stream():
        torch._foreach_copy_(
            [_byte(d) for d in dests], [_byte(s) for s in staging], non_blocking=True
        )
        if landed is not None:
            for i in range(len(dests)):
                landed(i)
        lane.pool.set_fence(base, _cuda.record(lane.cuda))


def _recv_ring_gloo(
    lane: Lane, dests: Sequence[Tensor], tags: Sequence[int], landed: Landed | None
) -> Protocol:
    """gloo into CUDA memory: recv into two pinned buffers, H2D copies overlapping the next recv."""
    n = len(dests)
    ring = lane.pool.buffers("pinned", max(_nbytes(d) for d in dests), count=n)

    def start(i: int) -> dist.Work:
        _host_ready(lane, ring[i % 2])
        return lane.post(False, [ring[i % 2][: _nbytes(dests[i])]], [tags[i]])[0]

    works = {i: start(i) for i in range(min(2, n))}
    for i in range(n):
        yield [works.pop(i)]
        with lane.on_stream():
            _byte(dests[i]).copy_(ring[i % 2][: _nbytes(dests[i])], non_blocking=True)
            if landed:
                landed(i)
            copied = _cuda.record(lane.cuda)
            lane.pool.set_fence(ring[i % 2], copied)
        if i + 2 < n:
            yield [_cuda.EventWork(copied)]  # the pinned buffer is free again
            works[i + 2] = start(i + 2)


def _device_ring(lane: Lane, nbytes: int, count: int) -> tuple[list[Tensor], torch.cuda.Stream]:
    """NCCL's ring of device buffers (allocated on the transfer stream, so the caching allocator orders their
    reuse after it) and the lane's copy stream (the link's own, else the device's), ordered after the transfer
    stream (a buffer's memory may be a block freed there a moment ago)."""
    with lane.on_stream():
        ring = lane.pool.buffers(lane.cuda.device, nbytes, count=count)
    copier = lane.copier if lane.copier is not None else _cuda.copy_stream(lane.cuda.device)
    copier.wait_stream(lane.cuda)
    return ring, copier


def _recv_ring_nccl(
    lane: Lane, dests: Sequence[Tensor], tags: Sequence[int], landed: Landed | None
) -> Protocol:
    """NCCL into host memory: recv into two device buffers, D2H copies on a second stream.

    Every receive is posted in the first step, which never blocks: into pinned ``dests`` the copies are
    asynchronous; into pageable ones they go through pinned staging (:func:`_recv_pageable`)."""
    if not all(d.is_pinned() for d in dests):
        yield from _recv_pageable(lane, dests, tags, landed)
        return
    ring, copier = _device_ring(lane, max(_nbytes(d) for d in dests), len(dests))
    for i, dest in enumerate(dests):
        buf = _receive_into_ring(lane, ring, copier, i, _nbytes(dest), tags[i])
        with torch.cuda.stream(copier):
            _byte(dest).copy_(buf, non_blocking=True)
            if landed:
                landed(i)
            lane.pool.set_fence(ring[i % 2], _cuda.record(copier))
    for buffer in ring:
        fence = lane.pool.fence(buffer)
        if fence is not None:
            lane.cuda.wait_event(fence)
    yield [_cuda.EventWork(_cuda.record(lane.cuda))]  # host memory: the host waits for the bytes


def _receive_into_ring(
    lane: Lane, ring: Sequence[Tensor], copier: torch.cuda.Stream, i: int, nbytes: int, tag: int
) -> Tensor:
    """Post message ``i``'s receive into its device ring buffer (once the previous copy out of that buffer is
    done) and order ``copier`` after it: the buffer's first ``nbytes``, for the caller's copy on ``copier``."""
    buf = ring[i % 2][:nbytes]
    freed = lane.pool.fence(ring[i % 2])
    if freed is not None:
        lane.cuda.wait_event(freed)  # the previous copy out of this buffer is done
    with lane.on_stream():
        for work in lane.post(False, [buf], [tag]):
            work.wait()
        arrived = _cuda.record(lane.cuda)
    copier.wait_event(arrived)
    return buf


def _offsets(tensors: Sequence[Tensor]) -> list[int]:
    """Where each message starts in a staging buffer that holds them all back to back (and, last, the total)."""
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + _nbytes(t))
    return offsets


def _recv_pageable(
    lane: Lane, dests: Sequence[Tensor], tags: Sequence[int], landed: Landed | None
) -> Protocol:
    """NCCL into pageable host memory, through one pinned buffer holding every message (the plan's, reused).

    A device-to-host copy into pageable memory returns only once it has run, so it waits for the stream's
    earlier work: the NCCL receive, i.e. for the peer's send. Done in the first step it blocked the caller's
    ``irecv`` until the peer sent, and two ranks that each ``irecv`` then ``isend`` never reached their sends.
    Here the first step posts every receive into the two device buffers and queues each one's copy into its
    place in the pinned buffer (asynchronous); later steps wait for each copy's event (the transfer's
    deadline bounds them) and copy the message on the host into ``dests[i]``; ``landed(i)`` then runs on the
    transfer stream."""
    offsets = _offsets(dests)
    ring, copier = _device_ring(lane, max(_nbytes(d) for d in dests), len(dests))
    pinned = lane.pool.buffers("pinned", offsets[-1], count=1)[0]
    earlier = lane.pool.fence(pinned)
    if earlier is not None:
        copier.wait_event(
            earlier
        )  # a stream copy still queued on it (a failed transfer's) goes first
    copied: list[torch.cuda.Event] = []
    for i, dest in enumerate(dests):
        buf = _receive_into_ring(lane, ring, copier, i, _nbytes(dest), tags[i])
        with torch.cuda.stream(copier):
            pinned[offsets[i] : offsets[i + 1]].copy_(buf, non_blocking=True)
            copied.append(_cuda.record(copier))
        lane.pool.set_fence(ring[i % 2], copied[i])
    lane.pool.set_fence(pinned, copied[-1])
    for i, dest in enumerate(dests):
        yield [_cuda.EventWork(copied[i])]  # message i is in the pinned buffer
        copy_bytes(_byte(dest), pinned[offsets[i] : offsets[i + 1]])
        if landed:
            with lane.on_stream():
                landed(i)


def drain(lane: Lane, sizes: Sequence[int], tag: int) -> Protocol:
    """Receive and drop messages of ``sizes`` bytes on ``tag`` (keeps a link in step after a rejected header); one
    scratch message, nothing per piece."""
    scratch = torch.empty(
        max(sizes, default=0), dtype=torch.uint8, device=lane.cuda.device if lane.nccl else "cpu"
    )
    for size in sizes:
        yield from recv_into(lane, [scratch[:size]], [tag])


def send_from(
    lane: Lane,
    srcs: Sequence[Tensor],
    tags: Sequence[int],
    staging: Sequence[Tensor] | None = None,
    defer: bool = False,
) -> Generator[Sequence[Work], None, list[dist.Work] | None]:
    """Send ``srcs[i]`` as message i.

    With ``defer``, works posted straight from the wire's memory are returned
    instead of waited for, so the caller can post more messages first.
    """
    n = len(srcs)
    if wire_can_touch(lane, srcs):
        with lane.on_stream():
            works = lane.post(True, srcs, tags)
            if lane.nccl:
                for work in works:
                    work.wait()
                return None
        if defer:
            return works
        yield works
        return None
    if lane.nccl:
        yield from _send_ring_nccl(lane, srcs, tags)
        return None
    # gloo from CUDA memory: D2H into pinned staging (full, or a ring of two), then send
    if staging is not None:
        with lane.on_stream():
            torch._foreach_copy_(
                [_byte(s) for s in staging], [_byte(t) for t in srcs], non_blocking=True
            )
            copied = _cuda.record(lane.cuda)
        yield [_cuda.EventWork(copied)]
        yield lane.post(True, staging, tags)
        return None
    ring = lane.pool.buffers("pinned", max(_nbytes(t) for t in srcs), count=n)
    sent: list[dist.Work | None] = [None, None]
    for i in range(n):
        earlier = sent[i % 2]
        if earlier is not None:
            yield [earlier]
        buf = ring[i % 2][: _nbytes(srcs[i])]
        with lane.on_stream():
            buf.copy_(_byte(srcs[i]), non_blocking=True)
            copied = _cuda.record(lane.cuda)
        yield [_cuda.EventWork(copied)]
        sent[i % 2] = lane.post(True, [buf], [tags[i]])[0]
    yield [w for w in sent if w is not None]
    return None


def _send_ring_nccl(lane: Lane, srcs: Sequence[Tensor], tags: Sequence[int]) -> Protocol:
    """NCCL from host memory: H2D copies into two device buffers on a second stream, then send.

    Every send is posted in the first step, which never blocks: out of pinned ``srcs`` the copies are
    asynchronous; out of pageable ones they go through pinned staging (:func:`_send_pageable`). Ends when
    the host memory has been read (the caller may then change it)."""
    if not all(t.is_pinned() for t in srcs):
        yield from _send_pageable(lane, srcs, tags)
        return
    ring, copier = _device_ring(lane, max(_nbytes(t) for t in srcs), len(srcs))
    copied = None
    for i, src in enumerate(srcs):
        buf = ring[i % 2][: _nbytes(src)]
        sent = lane.pool.fence(ring[i % 2])
        if sent is not None:
            copier.wait_event(sent)  # the previous send out of this buffer is done
        with torch.cuda.stream(copier):
            buf.copy_(_byte(src), non_blocking=True)
            copied = _cuda.record(copier)
        lane.cuda.wait_event(copied)
        with lane.on_stream():
            for work in lane.post(True, [buf], [tags[i]]):
                work.wait()
            lane.pool.set_fence(ring[i % 2], _cuda.record(lane.cuda))
    if copied is not None:
        yield [_cuda.EventWork(copied)]


def _send_pageable(lane: Lane, srcs: Sequence[Tensor], tags: Sequence[int]) -> Protocol:
    """NCCL from pageable host memory, through one pinned buffer holding every message (the plan's, reused).

    A host-to-device copy out of pageable memory may wait for the stream's earlier work (CUDA stages it
    through memory of its own), e.g. a receive on the transfer stream or the send two messages back, which
    wait for the peer: done in the first step it could block the caller's ``isend`` until the peer received.
    Here the host copies each message into its place in the pinned buffer and the copy stream takes it on
    from there (asynchronous), so the first step posts every send without waiting for the peer; the
    transfer ends once the last copy out of the pinned buffer has run (the buffer is free again)."""
    offsets = _offsets(srcs)
    ring, copier = _device_ring(lane, max(_nbytes(t) for t in srcs), len(srcs))
    pinned = lane.pool.buffers("pinned", offsets[-1], count=1)[0]
    fence = lane.pool.fence(pinned)
    # free unless a copy out of it is still queued (a failed transfer's; the previous transfer of this owner
    # waited for its own): the host must not wait for that here, so this transfer stages through its own
    pooled = fence is None or fence.query()
    if not pooled:
        pinned = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=True)
    copied = None
    for i, src in enumerate(srcs):
        buf = ring[i % 2][: _nbytes(src)]
        staged = pinned[offsets[i] : offsets[i + 1]]
        copy_bytes(staged, _byte(src))
        sent = lane.pool.fence(ring[i % 2])
        if sent is not None:
            copier.wait_event(sent)  # the previous send out of this buffer is done
        with torch.cuda.stream(copier):
            buf.copy_(staged, non_blocking=True)
            copied = _cuda.record(copier)
        lane.cuda.wait_event(copied)
        with lane.on_stream():
            for work in lane.post(True, [buf], [tags[i]]):
                work.wait()
            lane.pool.set_fence(ring[i % 2], _cuda.record(lane.cuda))
    if copied is not None:
        if pooled:
            lane.pool.set_fence(pinned, copied)
        yield [_cuda.EventWork(copied)]
