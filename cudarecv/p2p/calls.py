"""``isend``/``irecv``/``send``/``recv``: tensordict's p2p methods, cached and with a fast wire.

The signatures and the wire are those of ``TensorDictBase`` in tensordict
0.15.3 (a stock peer reads what these send and sends what these read), plus
``bucket_bytes``, which selects the fast wire on both ends.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import Tensor

from ..core import stuck
from ..core.errors import ArgumentError
from ..core.host_copy import copy_bytes
from ..core.link import Link, resolve
from ..core.protocol import Protocol
from ..core.tags import MAX_TAG, header_tag, piece_tag
from ..core.transfer import Transfer
from ..core.turns import line
from ..plan.header import Header, check_pieces
from ..plan.plan import Plan, forget_plan, plan_for
from ..plan.walk import unwrap
from ..samehost.policy import Carried, TransportPolicy, allowed
from ..samehost.sides import receiving_side, sending_side, storage_table
from ..wire import fast as _fast_wire
from ..wire import stock as _stock_wire
from ..wire.staging import host_waits, lane_for
from .failures import explaining, waited_for
from .options import CallOptions, call_options


def _check_tags(init_tag: int, leaves: int, pseudo_rand: bool) -> None:
    """The stock wire's tags ``init_tag .. init_tag + leaves - 1`` must all be valid tags
    (pseudo-random tags are below 10000)."""
    if not pseudo_rand and leaves and init_tag + leaves - 1 > MAX_TAG:
        raise ArgumentError(
            f"`init_tag={init_tag}` with {leaves} leaves needs tags up to {init_tag + leaves - 1}, past "
            f"the largest tag 2**31 - 1: pass init_tag <= {MAX_TAG - leaves + 1}"
        )


def _wire_tags(plan: Plan, call: CallOptions) -> Sequence[int]:
    """The tags a call's messages take."""
    if call.fast_wire:
        return header_tag(call.init_tag), piece_tag(call.init_tag)
    if call.consolidated:
        return (0,)
    return plan.tags(call.init_tag, len(plan.tensors), call.pseudo_rand)


@contextlib.contextmanager
def _claimed(
    td: Any,
    link: Link,
    sending: bool,
    call: CallOptions,
    user: TensorDictBase | None = None,
) -> Iterator[tuple[TensorDictBase, Plan, Sequence[int]]]:
    """:func:`_prepare`, then the plan is this call's (its :attr:`~cudarecv.plan.plan.Plan.claim` held) until the
    body has started its transfer and :func:`_track` marked it: two threads that call with one tensordict at once
    take turns, the later one waiting for the earlier one's transfer (outside the lock, in :func:`_prepare`) as for
    any previous one. The body only starts a transfer (its first step posts; it waits for nothing)."""
    while True:
        inner, plan, tags = _prepare(td, link, sending, call, user)
        with plan.claim:
            if plan.in_flight is None:
                yield inner, plan, tags
                return
        # another thread started a transfer of this plan meanwhile: wait for it (in _prepare), then look again


def _prepare(
    td: Any,
    link: Link,
    sending: bool,
    call: CallOptions,
    user: TensorDictBase | None = None,
) -> tuple[TensorDictBase, Plan, Sequence[int]]:
    """The call's tensordict, plan and tags, once :mod:`.stuck` lets them on ``link``."""
    inner = unwrap(td)
    fast_wire = call.fast_wire
    plan = plan_for(inner, layout=fast_wire)  # the stock wire posts the leaves themselves
    if not fast_wire and plan.device.type == "cuda":
        plan = plan_for(inner)  # staged through host memory: the byte layout is used
    plan.check()
    previous = plan.in_flight
    if previous is not None:
        # the previous transfer of this tensordict still uses its staging buffers:
        # finish it first (its error, if any, is its owner's to see)
        with contextlib.suppress(Exception):
            previous.wait()
        if previous.failed:
            # receives it left posted may still land in its buffers: start afresh
            plan = forget_plan(inner)
            plan.check()
    tags = _wire_tags(plan, call)
    stuck.check(
        user if user is not None else inner, link, tags, sending
    )  # (after the previous one: it may fail)
    return inner, plan, tags


def _track(plan: Plan, transfer: Transfer) -> None:
    """Mark ``transfer`` as using the plan's staging until it finishes."""
    plan.in_flight = transfer

    def release(done: object) -> None:
        if plan.in_flight is done:
            plan.in_flight = None  # no reference left from the plan cache to the tensordict

    transfer.add_done_callback(release)


def _last_tag(plan: Plan, call: CallOptions) -> int:
    n = len(plan.tensors)
    return plan.tags(call.init_tag, n, call.pseudo_rand)[-1] if n else call.init_tag - 1


def _start_send(
    td: Any,
    link: Link,
    call: CallOptions,
) -> tuple[Transfer, Plan]:
    user = unwrap(td)  # what a failure is recorded against (a consolidated copy is new every call)
    if call.consolidated and not user.is_consolidated():
        td = user.consolidate(metadata=True)  # as stock does: a copy, every call
    with _claimed(td, link, True, call, user) as (
        inner,
        plan,
        tags,
    ):
        return _begin_send(user, inner, plan, tags, link, call)


def _begin_send(
    user: TensorDictBase,
    inner: TensorDictBase,
    plan: Plan,
    tags: Sequence[int],
    link: Link,
    call: CallOptions,
) -> tuple[Transfer, Plan]:
    """Start the send (its plan claimed: :func:`_claimed`)."""
    route = Carried()
    if call.consolidated:
        storage = plan.storage(inner)
        lane = lane_for(link, storage.device, call.stream, plan.pool)
        side = (
            None
            if call.bucket_bytes is None
            else sending_side(link, call.transport, storage.device)
        )
        if call.bucket_bytes is None:
            protocol = _stock_wire.send_storage(lane, storage)
        else:
            check_pieces(storage.numel(), call.bucket_bytes, "consolidated storage")
            header = plan.chunk_header(inner).for_transfer(call.bucket_bytes, call.init_tag)
            chunks = plan.chunks(inner, call.bucket_bytes)

            def fill(data: Tensor, key: str, i: int, offset: int, length: int) -> None:
                copy_bytes(data[offset : offset + length], chunks[i])

            def wire(head: Header, offer: bytes | None) -> Protocol:
                return _fast_wire.send(lane, head, chunks, call.init_tag, offer=offer)

            protocol = (
                wire(header, None)
                if side is None
                else side.send(
                    lane,
                    header,
                    call.init_tag,
                    fill,
                    wire,
                    allowed(call.transport),
                    route,
                    storage=storage,
                    chunks=chunks,
                )
            )
    else:
        if call.bucket_bytes is None:
            _check_tags(call.init_tag, len(plan.tensors), call.pseudo_rand)
        else:
            check_pieces(plan.total, call.bucket_bytes)
        lane = lane_for(link, plan.device, call.stream, plan.pool)
        side = (
            None if call.bucket_bytes is None else sending_side(link, call.transport, plan.device)
        )
        if call.bucket_bytes is None:
            protocol = _stock_wire.send_leaves(
                lane, plan, plan.tags(call.init_tag, len(plan.tensors), call.pseudo_rand)
            )
        else:
            place = _fast_wire.staging_place(lane, plan)
            bucket_bytes = call.bucket_bytes

            def pack() -> None:
                with lane.on_stream():
                    plan.pack(bucket_bytes, place)
                if lane.stream is not None and not lane.nccl:
                    lane.stream.synchronize()  # gloo sends the page-locked copy: it must have landed

            def fill(data: Tensor, key: str, i: int, offset: int, length: int) -> None:
                place = f"shared:{key}"  # (a place per segment of the link: the plan keeps one staging each)
                plan.adopt(place, data)
                plan.pack_piece(bucket_bytes, i, place)

            def wire(head: Header, offer: bytes | None) -> Protocol:
                return _fast_wire.send(
                    lane,
                    head,
                    plan.pieces(bucket_bytes, place),
                    call.init_tag,
                    pack=pack,
                    offer=offer,
                )

            header = plan.bucket_header.for_transfer(bucket_bytes, call.init_tag)
            table = plan.address_bytes if plan.device.type == "cpu" else None
            protocol = (
                wire(header, None)
                if side is None
                else side.send(
                    lane,
                    header,
                    call.init_tag,
                    fill,
                    wire,
                    allowed(call.transport),
                    route,
                    table=table,
                )
            )
            if lane.nccl and plan.device.type != "cuda":
                protocol = host_waits(lane, protocol)  # the leaves were read once send() returns
    what, cause = waited_for(True, plan, call)
    on_error = explaining(user, link, call.timeout, what, cause, tags, True)
    # a fast-wire send on the wire posts its header and (from host memory) its whole payload in its first step:
    # under its link and tag's lock, two threads' sends on one init_tag never interleave their messages (a send
    # through a same-host side runs on the link's thread, in call order)
    alone = (
        line(link, ("send", header_tag(call.init_tag))).lock
        if call.bucket_bytes is not None and side is None
        else None
    )
    with alone if alone is not None else contextlib.nullcontext():
        transfer = Transfer(
            protocol,
            lane.stream,
            on_error=on_error,
            timeout=call.timeout,
            link=link,
            what=f"{what} to rank {link.peer} ({cause})",
            route=route,
            driver=None if side is None else side.driver.submit,
        )
    if side is not None:
        transfer.add_done_callback(functools.partial(side.ended, route))
        transfer.settle_in_background()  # on the link's thread, in call order
    if lane.stream is not None or (call.bucket_bytes is not None and not call.consolidated):
        _track(plan, transfer)  # it uses the plan's staging: the next transfer waits for it
    return transfer, plan


def _start_recv(
    td: Any,
    link: Link,
    call: CallOptions,
) -> tuple[Transfer, Plan]:
    with _claimed(td, link, False, call) as (
        inner,
        plan,
        tags,
    ):
        return _begin_recv(td, inner, plan, tags, link, call)


def _begin_recv(
    td: Any,
    inner: TensorDictBase,
    plan: Plan,
    tags: Sequence[int],
    link: Link,
    call: CallOptions,
) -> tuple[Transfer, Plan]:
    """Start the receive (its plan claimed: :func:`_claimed`); a fast-wire one in its turn on its link and tags."""
    route = Carried()
    side = None if call.bucket_bytes is None else receiving_side(link)
    allow = side is not None and allowed(call.transport)
    if call.consolidated:
        storage = plan.storage(inner)  # raises, naming the fix, if td is not consolidated
        lane = lane_for(link, storage.device, call.stream, plan.pool)
        if call.bucket_bytes is None:
            protocol = _stock_wire.recv_storage(lane, storage, td)
        else:

            def copy(
                data: Tensor, key: str, i: int, offset: int, length: int, bucket_bytes: int
            ) -> None:
                with lane.on_stream():
                    copy_bytes(storage[offset : offset + length], data[offset : offset + length])

            table = (
                storage_table(storage) if storage.device.type == "cpu" else None
            )  # (direct route)
            protocol = _fast_wire.recv(
                lane,
                plan.chunk_header(inner),
                lambda bucket_bytes: plan.chunks(inner, bucket_bytes),
                call.init_tag,
                td,
                copy_shared=copy,
                table=table,
                side=side,
                allow=allow,
                route=route,
            )
    else:
        if call.bucket_bytes is None:
            _check_tags(call.init_tag, len(plan.tensors), call.pseudo_rand)
        lane = lane_for(link, plan.device, call.stream, plan.pool)
        if call.bucket_bytes is None:
            protocol = _stock_wire.recv_leaves(
                lane, plan, plan.tags(call.init_tag, len(plan.tensors), call.pseudo_rand), td
            )
        else:
            place = _fast_wire.staging_place(lane, plan)

            def copy(
                data: Tensor, key: str, i: int, offset: int, length: int, bucket_bytes: int
            ) -> None:
                place = f"shared:{key}"  # (a place per segment of the link: the plan keeps one staging each)
                plan.adopt(place, data)
                with lane.on_stream():
                    plan.unpack(bucket_bytes, i, place)

            protocol = _fast_wire.recv(
                lane,
                plan.bucket_header,
                lambda bucket_bytes: plan.pieces(bucket_bytes, place),
                call.init_tag,
                td,
                landed=lambda bucket_bytes, i: plan.unpack(bucket_bytes, i, place),
                copy_shared=copy,
                table=plan.address_table if plan.device.type == "cpu" else None,
                side=side,
                allow=allow,
                route=route,
            )
            if lane.nccl and plan.device.type != "cuda":
                protocol = host_waits(
                    lane, protocol
                )  # the leaves hold the bytes once recv() returns
    what, cause = waited_for(False, plan, call)
    on_error = explaining(inner, link, call.timeout, what, cause, tags, False, route)
    # a fast-wire receive takes its turn among the link's receives on its tags (core.turns); a stock one posts
    # every message at once, and gloo matches them in posting order
    queue = (
        line(link, ("recv", header_tag(call.init_tag))) if call.bucket_bytes is not None else None
    )
    with queue.lock if queue is not None else contextlib.nullcontext():
        if queue is not None:
            protocol = _in_turn(
                protocol, queue.earlier(), route, lambda: stuck.check(inner, link, tags, False)
            )
        # driven by the side's thread: the sender may wait for its DONE, it must not wait for our wait()
        driven = side if side is not None and side.driven else None
        if driven is not None:
            protocol = driven.queued(protocol, route)  # in call order, on the link's thread
        transfer = Transfer(
            protocol,
            lane.stream,
            on_error=on_error,
            timeout=call.timeout,
            link=link,
            what=f"{what} from rank {link.peer} ({cause})",
            route=route,
            driver=driven.submit if driven is not None else None,
        )
        if queue is not None:
            queue.join(transfer)
        if driven is not None:
            transfer.add_done_callback(functools.partial(driven.ended, route))
            transfer.settle_in_background()  # (handed to the link's thread before the next receive joins)
    if lane.stream is not None or (call.bucket_bytes is not None and not call.consolidated):
        _track(plan, transfer)  # it uses the plan's staging: the next transfer waits for it
    return transfer, plan


def _in_turn(
    protocol: Protocol, earlier: list[Transfer], route: Carried, recheck: Callable[[], None]
) -> Protocol:
    """``protocol`` once the ``earlier`` receives on its link and tags have ended (:mod:`cudarecv.core.turns`),
    posting nothing before; ``recheck()`` then raises if one of them left its tags refused (it timed out: a late
    message of it could be taken by this receive)."""
    waits = [t.turn() for t in earlier if not t.settled]
    if waits:
        route.waiting, route.behind = True, "tags"
        yield waits
        route.waiting, route.behind = False, "thread"
        recheck()
    return (yield from protocol)


def isend(
    td: Any,
    dst: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    group_dst: int | None = None,
    init_tag: int = 0,
    pseudo_rand: bool = False,
    return_early: bool = False,
    consolidated: bool = False,
    bucket_bytes: int | None = None,
    stream: torch.cuda.Stream | None = None,
    timeout: float | None = None,
    transport: TransportPolicy = "auto",
) -> Any:
    """Send the leaves of ``td`` to ``dst``, a call's messages posted as one batch.

    Same arguments, wire and results as ``TensorDictBase.isend`` (tensordict
    0.15.3), plus ``bucket_bytes``: if given, ``td`` travels on the fast wire in
    messages of at most that many bytes, after a checked header; the receiver
    must pass ``bucket_bytes`` too (any value). ``stream``: the CUDA stream to
    run the transfer on (default: cudarecv's dedicated stream of the device);
    the caller's current stream is never blocked by the transfer. ``timeout``:
    seconds the transfer may take (default: the process group's timeout); past
    it :class:`cudarecv.TransferTimeout` names the peer, what was waited for and
    the likely cause, and ``td`` is refused on this link from then on (gloo
    cannot take back what was posted). With ``timeout`` the transfer is driven
    on a thread of its own, and no gloo wait is ever given a timeout (one that
    runs out closes every link of the group). ``transport`` (fast wire only):
    ``"auto"`` sends the payload through shared memory when the receiver is a
    cudarecv process on this machine (negotiated once per link; see the README),
    ``"wire"`` always on the process group's wire; ``Transfer.transport`` says
    which ran. ``CUDARECV_TRANSPORT=wire`` in the environment forces the wire.

    Returns:
        With ``return_early=True``, a one-element list of :class:`Transfer`.
        Otherwise the last tag used, or ``None`` when ``consolidated``.

    Example:
        >>> cudarecv.isend(td, dst=1, bucket_bytes=1 << 20)
    """
    call = call_options(
        init_tag, pseudo_rand, consolidated, bucket_bytes, stream, timeout, transport
    )
    link = resolve(dst, group_dst, group, "dst", "group_dst")
    transfer, plan = _start_send(td, link, call)
    if return_early:
        return [transfer] if call.consolidated or call.fast_wire or plan.tensors else []
    transfer.wait()
    return None if call.consolidated else _last_tag(plan, call)


def irecv(
    td: Any,
    src: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    group_src: int | None = None,
    return_premature: bool = False,
    init_tag: int = 0,
    pseudo_rand: bool = False,
    consolidated: bool = False,
    bucket_bytes: int | None = None,
    stream: torch.cuda.Stream | None = None,
    timeout: float | None = None,
    transport: TransportPolicy = "auto",
) -> Any:
    """Receive into the leaves of ``td`` in place what :func:`isend` or stock tensordict sends.

    Same arguments, wire and results as ``TensorDictBase.irecv`` (tensordict
    0.15.3), plus ``bucket_bytes`` (see :func:`isend`). On the fast wire a
    sender whose tensordict does not match raises
    :class:`cudarecv.HeaderError` here, with ``td`` untouched. ``stream`` and
    ``timeout`` and ``transport`` as in :func:`isend`. Without ``return_premature`` it returns once the caller's
    current stream is ordered after the receive (CPU memory: once the bytes are
    there).

    Returns:
        With ``return_premature=True``, a one-element list of :class:`Transfer`
        whose ``wait()`` returns ``td``. Otherwise ``None``.

    Example:
        >>> cudarecv.irecv(td, src=0, bucket_bytes=1 << 20)
    """
    call = call_options(
        init_tag, pseudo_rand, consolidated, bucket_bytes, stream, timeout, transport
    )
    link = resolve(src, group_src, group, "src", "group_src")
    transfer, plan = _start_recv(td, link, call)
    if return_premature:  # stock returns one work per leaf: none for a tensordict without leaves
        return [transfer] if call.consolidated or call.fast_wire or plan.tensors else []
    transfer.wait()
    return None


def send(
    td: Any,
    dst: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    group_dst: int | None = None,
    init_tag: int = 0,
    pseudo_rand: bool = False,
    consolidated: bool = False,
    bucket_bytes: int | None = None,
    stream: torch.cuda.Stream | None = None,
    timeout: float | None = None,
    transport: TransportPolicy = "auto",
) -> None:
    """Blocking :func:`isend`; same arguments and wire as ``TensorDictBase.send``."""
    isend(
        td,
        dst,
        group=group,
        group_dst=group_dst,
        init_tag=init_tag,
        pseudo_rand=pseudo_rand,
        consolidated=consolidated,
        bucket_bytes=bucket_bytes,
        stream=stream,
        timeout=timeout,
        transport=transport,
    )


def recv(
    td: Any,
    src: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    group_src: int | None = None,
    init_tag: int = 0,
    pseudo_rand: bool = False,
    consolidated: bool = False,
    bucket_bytes: int | None = None,
    stream: torch.cuda.Stream | None = None,
    timeout: float | None = None,
    transport: TransportPolicy = "auto",
) -> int | None:
    """Blocking :func:`irecv`; returns the last tag (``None`` when ``consolidated``), as stock."""
    call = call_options(
        init_tag, pseudo_rand, consolidated, bucket_bytes, stream, timeout, transport
    )
    link = resolve(src, group_src, group, "src", "group_src")
    transfer, plan = _start_recv(td, link, call)
    transfer.wait()
    return None if call.consolidated else _last_tag(plan, call)
