"""The weight-sync handshake, both ends: the sender offers its schema (JSON, never pickle, after a preamble
with its length, the push message size, the mode and the session), and on gloo links the same-host offer of
its snapshots, to every receiver at once; each receiver checks it against ``expect``, allocates its storages,
maps the snapshots if it may and can, and answers (accepted with its host and route, refused with the reason,
or failed with why it could not start), so that a construction failing on either end fails the other's too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..core import streams
from ..core.errors import Error, ReceiverFailed, SchemaError, TransferTimeout
from ..core.link import Link
from ..core.protocol import ErrorHook, Protocol, Work
from ..core.tags import TAG_PREAMBLE, TAG_SCHEMA, TAG_STATUS
from ..core.transfer import Transfer
from ..core.transport import park
from ..plan.walk import unwrap, walk
from ..samehost import doorbell
from ..samehost.doorbell import Mailbox
from ..samehost.machine import host_id
from ..samehost.shared_memory import MappingError
from ..wire.control import read_bytes, wire_bytes
from ..wire.staging import Lane, lane_for, release_pair, send_from
from .link import naming, run, send_bytes
from .schema import Schema
from .transports.base import Transport
from .transports.registry import WIRE, accepting, most_offer_bytes
from .wire import (
    ACCEPTED,
    FAILED,
    PREAMBLE_SIZE,
    REFUSED,
    STATUS_SIZE,
    Answer,
    Offer,
    check_offer,
    preamble,
    read_preamble,
    read_status,
    status_message,
)


@dataclass(frozen=True)
class Answered:
    """What a receiver answered to a sender's handshake (it accepted)."""

    #: its machine (:func:`~cudarecv.samehost.machine.host_id`)
    host: str
    #: it mapped the shared segments offered
    shared: bool
    #: it reads the versions where they lie in them (zero-copy)
    alias: bool
    #: the doorbell page it offers (:mod:`cudarecv.samehost.doorbell`; empty: none)
    bell: str


def offer(
    lanes: list[Lane],
    raw: bytes,
    bucket_bytes: int,
    mode: str,
    session: int,
    shared: bytes,
    transport: Transport,
    timeout: float,
) -> list[Answered]:
    """The sender's end: offer the schema ``raw`` (and where ``transport`` offers on the link, its ``shared``
    segments) to every receiver at once, then read every answer (:class:`Answered`). Raises :class:`SchemaError`
    or :class:`ReceiverFailed` naming a receiver that refused or could not start."""

    def hello(lane: Lane) -> Protocol:
        extra = shared if transport.offered_on(lane.link.backend) else b""
        head = yield from send_from(
            lane,
            [wire_bytes(lane, preamble(len(raw), bucket_bytes, mode, session, len(extra)))],
            [TAG_PREAMBLE],
            defer=True,
        )
        yield from send_bytes(lane, raw, TAG_SCHEMA)
        if extra:
            yield from send_bytes(lane, extra, TAG_SCHEMA)
        if head:
            yield head

    def reply(lane: Lane) -> Generator[Sequence[Work], None, bytes]:
        return (
            yield from read_bytes(lane, STATUS_SIZE, TAG_STATUS, "handshake answer", SchemaError)
        )

    def control(protocol: Protocol, lane: Lane, silent: str, hint: str = "") -> Transfer:
        what = "weight-sync handshake"
        return Transfer(
            protocol,
            lane.stream,
            on_error=_hinted(naming(lane.link, what, timeout, silent), hint),
            timeout=timeout,
            link=lane.link,
            raise_first=False,
            what=f"{what} with rank {lane.link.peer}",
        )

    # a receiver that never takes the schema was most likely never built (or names another sender): say so
    offers = [
        (
            lane,
            control(
                hello(lane), lane, "took no schema", _build_hint(lane.link, "WeightReceiver", "src")
            ),
        )
        for lane in lanes
    ]
    answers = [(lane, control(reply(lane), lane, "sent no answer")) for lane in lanes]
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
        host, route, bell = (reason.split("\n") + ["", ""])[:3]
        shared_route = route in ("shared", "shared zero-copy")
        hosts.append(
            Answered(host, shared_route, route == "shared zero-copy", bell if shared_route else "")
        )
    return hosts


def _build_hint(link: Link, other_end: str, argument: str) -> str:
    """What the peer must do for this end's handshake to happen: build ``other_end`` naming this process
    in ``argument`` (``"src"``: a receiver of this sender, ``"dst"``: a sender to this receiver), within the
    timeout. A registered group names ranks globally (``src=``/``dst=``), a standalone one by its own ranks
    (``group_src=``/``group_dst=``)."""
    me = link.pg.rank()
    if link.registered:
        name, rank = argument, dist.get_global_rank(link.pg, me)
    else:
        name, rank = f"group_{argument}", me
    named = f"`{name}={rank}`" if argument == "src" else f"`{name}` including {rank}"
    where = "" if link.registered else " on this group"
    return (
        f"it must build a `{other_end}` with {named} (this rank){where} within that time (did it build "
        f"none, name another rank, or start later than this timeout allows?)"
    )


def _hinted(hook: ErrorHook, hint: str) -> ErrorHook:
    """Error hook ``hook`` whose timeouts end with ``hint`` (what the silent peer must do), when there is one."""
    if not hint:
        return hook

    def hinted(error: BaseException, elapsed: float) -> BaseException:
        named = hook(error, elapsed)
        return TransferTimeout(f"{named}: {hint}") if isinstance(named, TransferTimeout) else named

    return hinted


def expected(expect: Any) -> tuple[list[tuple], list[Tensor]]:
    if isinstance(expect, torch.nn.Module):
        named = list(expect.named_parameters()) + list(expect.named_buffers())
        return [tuple(n.split(".")) for n, _ in named], [t for _, t in named]
    paths, tensors = walk(unwrap(expect))
    return [tuple(map(str, p)) for p in paths], tensors


def _answer_lane(link: Link) -> Lane | None:
    """A lane to answer the handshake on when the receiver's own could not be built."""
    if link.backend != "nccl":
        return Lane(link)
    if not torch.cuda.is_available():
        return None  # NCCL without CUDA cannot carry an answer: the sender's timeout tells it
    return lane_for(  # (on the link the receiver's own lane would have used: a weight end's)
        link,
        torch.device("cuda", torch.cuda.current_device()),
        None,
        streams.StagingPool(),
        peers_at_once=True,
    )


def refuse(link: Link, timeout: float, failure: BaseException) -> None:
    """Answer the sender's handshake with the reason this receiver could not start."""
    lane = _answer_lane(link)
    if lane is not None:
        try:
            with contextlib.suppress(
                Error
            ):  # the reason is this side's error, which the caller raises
                answer(lane, timeout, None, lambda schema, bucket_bytes: [], failure=failure)
        finally:
            release_pair(
                lane.wire
            )  # (as the sender lets go of its end: the pair's formations stay in step)


def answer(
    lane: Lane,
    timeout: float,
    expect: Any,
    allocate: Any,
    failure: BaseException | None = None,
    allow: bool = False,
    device: torch.device | None = None,
    zero_copy: bool = False,
) -> tuple[Schema, int, Offer, list[Any], Transport, list, Mailbox | None]:
    """Read the sender's offer, check it and allocate; answer the sender either way.

    With ``failure`` (this receiver could not start), answer with it and raise it. With ``allow``
    the shared segments the sender offers (same host) are mapped if this process can, by the transport whose
    offer it is; the answer says whether they were, and (``zero_copy``, a transport that can) that versions are
    read where they lie. Returns the schema, the message size, the preamble, the slots, the transport taken (the
    wire if none), what it mapped, and the doorbell it offers the sender (a transport that sends headers alone,
    where one can ring here: :mod:`cudarecv.samehost.doorbell`).
    """
    what = "weight-sync handshake"
    started = time.monotonic()

    def left() -> float:
        return max(timeout - (time.monotonic() - started), 1e-3)

    def answer(status: Answer, text: str = "") -> None:
        run(
            send_bytes(lane, status_message(status, text), TAG_STATUS),
            lane,
            left(),
            what,
            "took no answer",
        )

    # a sender that never offers was most likely never built (or sends to other ranks): the timeout says so
    hook = _hinted(
        naming(lane.link, what, timeout, "sent nothing"),
        _build_hint(lane.link, "WeightSender", "dst"),
    )
    offer = read_preamble(
        Transfer(
            read_bytes(lane, PREAMBLE_SIZE, TAG_PREAMBLE, "handshake preamble", SchemaError),
            lane.stream,
            on_error=hook,
            timeout=timeout,
            link=lane.link,
            what=f"{what} with rank {lane.link.peer}",
        ).wait()
    )
    length, bucket_bytes = offer.length, offer.bucket_bytes
    try:
        check_offer(length, bucket_bytes)
    except SchemaError as error:  # the schema itself cannot be received: refuse at once
        answer(REFUSED if failure is None else FAILED, str(error if failure is None else failure))
        raise
    raw = run(
        read_bytes(lane, length, TAG_SCHEMA, "weight schema", SchemaError), lane, left(), what
    )
    shared = b""
    if 0 < offer.shared <= most_offer_bytes():
        shared = run(
            read_bytes(lane, offer.shared, TAG_SCHEMA, "same-host offer", SchemaError),
            lane,
            left(),
            what,
        )
    elif offer.shared:
        answer(
            REFUSED if failure is None else FAILED,
            f"a same-host offer of {offer.shared} bytes is out of range",
        )
        raise SchemaError(
            f"the handshake announces a same-host offer of {offer.shared} bytes: out of range"
        )
    if failure is not None:
        answer(FAILED, f"{type(failure).__name__}: {failure}")
        raise ReceiverFailed(str(failure))
    try:
        schema = Schema.from_json(raw)
        schema.check_pieces(bucket_bytes)
        difference = None if expect is None else schema.first_difference(*expected(expect))
        if difference:
            raise SchemaError(f"the sender's weights do not match `expect`: {difference}")
    except Exception as error:  # noqa: BLE001 - every reason to refuse goes back to the sender
        problem = (
            str(error) if isinstance(error, SchemaError) else f"{type(error).__name__}: {error}"
        )
        answer(REFUSED, problem)
        raise SchemaError(problem) from error
    try:  # allocate before answering, so that the sender learns if it fails
        slots = allocate(schema, bucket_bytes)
    except Exception as error:  # noqa: BLE001 - the sender learns every reason
        problem = f"the receiver cannot allocate 2 x {schema.total} bytes: {type(error).__name__}: {error}"
        answer(FAILED, problem)
        raise ReceiverFailed(problem) from error
    mappings: list[Any] = []
    route = "wire"
    transport: Transport = WIRE  # (until an offer is taken)
    taking = accepting(shared) if shared and allow else None
    if taking is not None:
        try:
            mappings = taking.map(shared, schema.total, device)
            route = "shared zero-copy" if zero_copy and taking.zero_copy else "shared"
            transport = taking
            if any(m.capacity != schema.total for m in mappings):
                mappings, route, transport = (
                    [],
                    "wire: the offered segments do not hold the weights' bytes",
                    WIRE,
                )
        except Exception as error:  # noqa: BLE001 - whatever stops the mapping (a CUDA error too): the wire
            route = (
                f"wire: {error}"
                if isinstance(error, MappingError)
                else f"wire: {type(error).__name__}: {error}"
            )
    mailbox = None
    # (not on NCCL: a pull there reads its header in turn on the link, never from a page)
    if transport.header_only and lane.link.backend != "nccl" and doorbell.available() is None:
        try:
            mailbox = doorbell.Mailbox()
        except OSError:  # (descriptors, memory: the headers come on the link)
            mailbox = None
    try:
        answer(ACCEPTED, f"{host_id()}\n{route}" + (f"\n{mailbox.offer()}" if mailbox else ""))
    except BaseException:
        if mailbox is not None:
            mailbox.close()
        raise
    return schema, bucket_bytes, offer, slots, transport, mappings, mailbox
