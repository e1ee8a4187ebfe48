"""``isend``/``irecv``/``send``/``recv``: tensordict's p2p methods, cached and with a fast wire.

The signatures and the wire are those of ``TensorDictBase`` in tensordict
0.15.3 (a stock peer reads what these send and sends what these read), plus
``bucket_bytes``, which selects the fast wire on both ends.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

from tensordict import TensorDictBase

from . import _fast_wire, _stock_wire
from ._errors import ArgumentError, ArgumentTypeError
from ._handle import Transfer
from ._header import check_pieces
from ._link import Link, resolve
from ._plan import Plan, forget_plan, plan_for
from ._staging import lane_for
from ._transport import MAX_TAG
from ._walk import unwrap


def check_bucket_bytes(bucket_bytes: object) -> None:
    """``bucket_bytes`` is None or a positive int, else a ValueError saying so."""
    if bucket_bytes is not None and (
        not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0
    ):
        raise ArgumentError(
            f"`bucket_bytes` must be a positive int (the bytes per message, e.g. 1 << 20), "
            f"got {bucket_bytes!r}; pass None for the stock wire"
        )


def _check_options(init_tag: object, pseudo_rand: object, consolidated: object,
                   bucket_bytes: object) -> int:
    """Check the options of a call before anything else; return ``init_tag`` as an int."""
    check_bucket_bytes(bucket_bytes)
    if consolidated and bucket_bytes is None:
        return 0  # one message with tag 0: stock ignores init_tag and pseudo_rand here
    if isinstance(init_tag, bool):
        raise ArgumentTypeError("`init_tag` must be an int, got bool")
    try:
        init_tag = operator.index(init_tag)  # numpy integers too, as stock takes them
    except TypeError:
        raise ArgumentTypeError(f"`init_tag` must be an int, got {type(init_tag).__name__}") from None
    if init_tag < 0:
        fix = ("`pseudo_rand=True` seeds numpy with it, which takes non-negative seeds only" if pseudo_rand
               else "gloo takes tags 0..2**31 - 1")
        raise ArgumentError(f"`init_tag={init_tag}` is negative, but {fix}: pass init_tag >= 0")
    if bucket_bytes is not None:
        _fast_wire.check_init_tag(init_tag)
    return init_tag


def _check_tags(init_tag: int, leaves: int, pseudo_rand: bool) -> None:
    """The stock wire's tags ``init_tag .. init_tag + leaves - 1`` must all be valid tags
    (pseudo-random tags are below 10000)."""
    if not pseudo_rand and leaves and init_tag + leaves - 1 > MAX_TAG:
        raise ArgumentError(
            f"`init_tag={init_tag}` with {leaves} leaves needs tags up to {init_tag + leaves - 1}, past "
            f"the largest tag 2**31 - 1: pass init_tag <= {MAX_TAG - leaves + 1}"
        )


def _prepare(td: Any) -> tuple[TensorDictBase, Plan]:
    inner = unwrap(td)
    plan = plan_for(inner)
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
    return inner, plan


def _track(plan: Plan, transfer: Transfer) -> None:
    """Mark ``transfer`` as using the plan's staging until it finishes."""
    plan.in_flight = transfer

    def release(done: Transfer) -> None:
        if plan.in_flight is done:
            plan.in_flight = None  # no reference left from the plan cache to the tensordict

    transfer.add_done_callback(release)


def _last_tag(plan: Plan, init_tag: int, pseudo_rand: bool) -> int:
    n = len(plan.tensors)
    return plan.tags(init_tag, n, pseudo_rand)[-1] if n else init_tag - 1


def _start_send(td: Any, link: Link, init_tag: int, pseudo_rand: bool, consolidated: bool,
                bucket_bytes: int | None, stream: Any) -> tuple[Transfer, Plan]:
    if consolidated:
        td = unwrap(td)
        if not td.is_consolidated():
            td = td.consolidate(metadata=True)  # as stock does: a copy, every call
    inner, plan = _prepare(td)
    if consolidated:
        storage = plan.storage(inner)
        lane = lane_for(link, storage.device, stream, plan.pool)
        if bucket_bytes is None:
            protocol = _stock_wire.send_storage(lane, storage)
        else:
            check_pieces(storage.numel(), bucket_bytes, "consolidated storage")
            protocol = _fast_wire.send(lane, plan.chunk_header(inner).with_piece(bucket_bytes),
                                       plan.chunks(inner, bucket_bytes), init_tag)
    else:
        if bucket_bytes is None:
            _check_tags(init_tag, len(plan.tensors), pseudo_rand)
        else:
            check_pieces(plan.total, bucket_bytes)
        lane = lane_for(link, plan.device, stream, plan.pool)
        if bucket_bytes is None:
            protocol = _stock_wire.send_leaves(lane, plan, plan.tags(init_tag, len(plan.tensors), pseudo_rand))
        else:
            place = _fast_wire.staging_place(lane, plan)

            def pack() -> None:
                with lane.on_stream():
                    plan.pack(place)
                if lane.stream is not None and not lane.nccl:
                    lane.stream.synchronize()  # gloo sends the page-locked copy: it must have landed

            protocol = _fast_wire.send(lane, plan.bucket_header.with_piece(bucket_bytes),
                                       plan.pieces(bucket_bytes, place), init_tag, pack=pack)
    transfer = Transfer(protocol, lane.stream)
    if lane.stream is not None or (bucket_bytes is not None and not consolidated):
        _track(plan, transfer)  # it uses the plan's staging: the next transfer waits for it
    return transfer, plan


def _start_recv(td: Any, link: Link, init_tag: int, pseudo_rand: bool, consolidated: bool,
                bucket_bytes: int | None, stream: Any) -> tuple[Transfer, Plan]:
    inner, plan = _prepare(td)
    if consolidated:
        storage = plan.storage(inner)  # raises, naming the fix, if td is not consolidated
        lane = lane_for(link, storage.device, stream, plan.pool)
        if bucket_bytes is None:
            protocol = _stock_wire.recv_storage(lane, storage, td)
        else:
            protocol = _fast_wire.recv(lane, plan.chunk_header(inner), lambda piece: plan.chunks(inner, piece),
                                       init_tag, td)
    else:
        if bucket_bytes is None:
            _check_tags(init_tag, len(plan.tensors), pseudo_rand)
        lane = lane_for(link, plan.device, stream, plan.pool)
        if bucket_bytes is None:
            protocol = _stock_wire.recv_leaves(lane, plan, plan.tags(init_tag, len(plan.tensors), pseudo_rand), td)
        else:
            place = _fast_wire.staging_place(lane, plan)
            protocol = _fast_wire.recv(lane, plan.bucket_header, lambda piece: plan.pieces(piece, place),
                                       init_tag, td, landed=lambda piece, i: plan.unpack(piece, i, place))
    transfer = Transfer(protocol, lane.stream)
    if lane.stream is not None or (bucket_bytes is not None and not consolidated):
        _track(plan, transfer)  # it uses the plan's staging: the next transfer waits for it
    return transfer, plan


def isend(td: Any, dst: int | None = None, *, group: Any = None, group_dst: int | None = None,
          init_tag: int = 0, pseudo_rand: bool = False, return_early: bool = False,
          consolidated: bool = False, bucket_bytes: int | None = None, stream: Any = None) -> Any:
    """Send the leaves of ``td`` to ``dst``, a call's messages posted as one batch.

    Same arguments, wire and results as ``TensorDictBase.isend`` (tensordict
    0.15.3), plus ``bucket_bytes``: if given, ``td`` travels on the fast wire in
    messages of at most that many bytes, after a checked header; the receiver
    must pass ``bucket_bytes`` too (any value). ``stream``: the CUDA stream to
    run the transfer on (default: cudarecv's dedicated stream of the device);
    the caller's current stream is never blocked by the transfer.

    Returns:
        With ``return_early=True``, a one-element list of :class:`Transfer`.
        Otherwise the last tag used, or ``None`` when ``consolidated``.

    Example:
        >>> cudarecv.isend(td, dst=1, bucket_bytes=1 << 20)
    """
    init_tag = _check_options(init_tag, pseudo_rand, consolidated, bucket_bytes)
    link = resolve(dst, group_dst, group, "dst", "group_dst")
    transfer, plan = _start_send(td, link, init_tag, pseudo_rand, consolidated, bucket_bytes, stream)
    if return_early:
        return [transfer] if consolidated or bucket_bytes is not None or plan.tensors else []
    transfer.wait()
    return None if consolidated else _last_tag(plan, init_tag, pseudo_rand)


def irecv(td: Any, src: int | None = None, *, group: Any = None, group_src: int | None = None,
          return_premature: bool = False, init_tag: int = 0, pseudo_rand: bool = False,
          consolidated: bool = False, bucket_bytes: int | None = None, stream: Any = None) -> Any:
    """Receive into the leaves of ``td`` in place what :func:`isend` or stock tensordict sends.

    Same arguments, wire and results as ``TensorDictBase.irecv`` (tensordict
    0.15.3), plus ``bucket_bytes`` (see :func:`isend`). On the fast wire a
    sender whose tensordict does not match raises
    :class:`cudarecv.HeaderError` here, with ``td`` untouched. ``stream`` as in
    :func:`isend`. Without ``return_premature`` it returns once the caller's
    current stream is ordered after the receive (CPU memory: once the bytes are
    there).

    Returns:
        With ``return_premature=True``, a one-element list of :class:`Transfer`
        whose ``wait()`` returns ``td``. Otherwise ``None``.

    Example:
        >>> cudarecv.irecv(td, src=0, bucket_bytes=1 << 20)
    """
    init_tag = _check_options(init_tag, pseudo_rand, consolidated, bucket_bytes)
    link = resolve(src, group_src, group, "src", "group_src")
    transfer, plan = _start_recv(td, link, init_tag, pseudo_rand, consolidated, bucket_bytes, stream)
    if return_premature:  # stock returns one work per leaf: none for a tensordict without leaves
        return [transfer] if consolidated or bucket_bytes is not None or plan.tensors else []
    transfer.wait()
    return None


def send(td: Any, dst: int | None = None, *, group: Any = None, group_dst: int | None = None,
         init_tag: int = 0, pseudo_rand: bool = False, consolidated: bool = False,
         bucket_bytes: int | None = None, stream: Any = None) -> None:
    """Blocking :func:`isend`; same arguments and wire as ``TensorDictBase.send``."""
    isend(td, dst, group=group, group_dst=group_dst, init_tag=init_tag, pseudo_rand=pseudo_rand,
          consolidated=consolidated, bucket_bytes=bucket_bytes, stream=stream)


def recv(td: Any, src: int | None = None, *, group: Any = None, group_src: int | None = None,
         init_tag: int = 0, pseudo_rand: bool = False, consolidated: bool = False,
         bucket_bytes: int | None = None, stream: Any = None) -> int | None:
    """Blocking :func:`irecv`; returns the last tag (``None`` when ``consolidated``), as stock."""
    init_tag = _check_options(init_tag, pseudo_rand, consolidated, bucket_bytes)
    link = resolve(src, group_src, group, "src", "group_src")
    transfer, plan = _start_recv(td, link, init_tag, pseudo_rand, consolidated, bucket_bytes, stream)
    transfer.wait()
    return None if consolidated else _last_tag(plan, init_tag, pseudo_rand)
