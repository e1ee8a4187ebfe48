"""Same-host channels: what an offer declined for now, segments that cannot be made and a refused CUDA IPC
export do to a link (it keeps what it shares, goes on the wire for what it cannot, offers again later), and
that a link's staging places stay bounded. Real ranks over gloo; faults injected in one process."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.plan.plan import plan_for
from cudarecv.samehost import cuda_ipc, recv_side, send_side
from cudarecv.samehost.channels import ChannelState, SendChannel
from cudarecv.samehost.shared_memory import MappingError
from rawwire import store, unique_key


def _group(rank, world, key):
    return dist.ProcessGroupGloo(dist.PrefixStore(key, store()), rank, world, timedelta(seconds=20))


def _td(n: int, fill: float) -> TensorDict:
    return TensorDict(x=torch.full((n,), fill), batch_size=[])


def _routes(rank, pg, sizes, base=1.0):
    """Send (rank 0) or receive (rank 1) one tensordict of each size in ``sizes``; the transports and exactness."""
    routes, exact = [], []
    for step, n in enumerate(sizes):
        td = _td(n, base + step if rank == 0 else 0.0)
        if rank == 0:
            [t] = cudarecv.isend(
                td, group=pg, group_dst=1, bucket_bytes=1 << 20, timeout=30, return_early=True
            )
        else:
            [t] = cudarecv.irecv(
                td, group=pg, group_src=0, bucket_bytes=1 << 20, timeout=30, return_premature=True
            )
        t.wait(30)
        routes.append(t.transport)
        exact.append(rank == 0 or bool((td["x"] == base + step).all()))
    return routes, all(exact)


def declined_reoffer(rank, world, group, key):
    """Small transfers share two segments; a larger one re-offers, which the receiver declines for now (it cannot
    open them: injected); the small ones go on through the segments, and a later large one is offered again."""
    pg = _group(rank, world, key)
    small, large = 1000, 100_000
    if rank == 1:
        real, refused = recv_side.map_offer, []

        def refuse_large(raw, most):
            mappings = real(raw, most)
            if mappings[0].capacity >= 4 * large and not refused:
                refused.append(True)
                raise MappingError(
                    "cannot open the peer's segment: Too many open files", lasting=False
                )
            return mappings

        recv_side.map_offer = refuse_large
    try:
        return _routes(
            rank, pg, [small, small, small, large, small, small, large, large, large, small]
        )
    finally:
        if rank == 1:
            recv_side.map_offer = real


def test_an_offer_declined_for_now_keeps_the_segments_shared(cluster):
    """(Before: the declined re-offer put the link on the wire for good, small transfers too.)"""
    (sent, _), (received, exact) = cluster().run(
        declined_reoffer, args=(unique_key("reoffer"),), timeout=180
    )
    assert exact and sent == received, (sent, received)
    assert sent[:3] == ["wire", "shared memory", "shared memory"], sent  # negotiated
    assert sent[3] == "wire", sent  # the re-offer, declined for now: its payload on the wire
    assert sent[4:6] == ["shared memory"] * 2, sent  # the small ones still through the segments
    assert "shared memory" in sent[6:9] and sent[9] == "shared memory", (
        sent
    )  # offered again, then taken


def segments_fail(rank, world, group, key, failures):
    """The sender's segments cannot be made ``failures`` times (memory: injected); its transfers go on the wire,
    said in the log, and later ones offer again."""
    pg = _group(rank, world, key)
    records = []
    if rank == 0:
        real, left = send_side.Segment, [failures]

        class NoMemory(real):
            def __init__(self, capacity):
                if left[0]:
                    left[0] -= 1
                    raise OSError(12, "Cannot allocate memory")
                super().__init__(capacity)

        send_side.Segment = NoMemory
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())
        logging.getLogger("cudarecv").addHandler(handler)
    try:
        routes, exact = _routes(rank, pg, [1000] * 8)
    finally:
        if rank == 0:
            send_side.Segment = real
            logging.getLogger("cudarecv").removeHandler(handler)
    return routes, exact, [r for r in records if "could not be made" in r]


def test_segments_that_cannot_be_made_leave_the_transfer_on_the_wire_and_are_tried_again(cluster):
    (sent, _, said), (received, exact, _) = cluster().run(
        segments_fail, args=(unique_key("nomem"), 2), timeout=180
    )
    assert exact and sent == received, (sent, received)
    assert len(said) == 2 and "Cannot allocate memory" in said[0], said
    assert sent[-1] == "shared memory", sent  # offered again once they could be made
    assert sent.count("wire") >= 3, (
        sent
    )  # the two failed offers' transfers and the one that offered


def staging_places(rank, world, group, key):
    """One tensordict sent between ever larger ones (each re-offers larger segments): its plan keeps one staging
    place per segment of the link, not one per pair of segments ever offered."""
    pg = _group(rank, world, key)
    small = _td(1000, 1.0 if rank == 0 else 0.0)
    for k in range(6):
        for td in (small, _td(2000 * (k + 1), 1.0 if rank == 0 else 0.0), small):
            if rank == 0:
                cudarecv.send(td, group=pg, group_dst=1, bucket_bytes=1 << 20, timeout=30)
            else:
                cudarecv.recv(td, group=pg, group_src=0, bucket_bytes=1 << 20, timeout=30)
    places = [p for p in plan_for(small)._adopted if p.startswith("shared:")]
    return sorted(places)


def test_a_links_staging_places_stay_bounded(cluster):
    """(Before: a place per segment object, ``shared:<id>``: two more per re-offer, and per transfer on the
    direct route into CUDA leaves.)"""
    sent, received = cluster().run(staging_places, args=(unique_key("places"),), timeout=180)
    assert sent == ["shared:host:0", "shared:host:1"] and received == sent, (sent, received)


def test_a_refused_cuda_ipc_export_is_probed_once_and_said(monkeypatch, caplog):
    """On a machine that refuses CUDA IPC (a sandbox), the first ask per device exports a one-byte segment,
    keeps the reason and logs it; memory there then goes on the wire instead of failing the transfer."""
    tries = []

    class Refused:
        def __init__(self, capacity, device):
            tries.append(device)
            raise RuntimeError("cudaErrorNotSupported: operation not supported")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_ipc, "DeviceSegment", Refused)
    monkeypatch.setitem(__import__("sys").modules, "cupy", type(__import__("sys"))("cupy"))
    cuda_ipc._exports.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="cudarecv"):
            first = cuda_ipc.available(torch.device("cuda", 0))
            again = cuda_ipc.available(torch.device("cuda", 0))
    finally:
        cuda_ipc._exports.cache_clear()
    assert first == again and "exporting a CUDA IPC handle on cuda:0 failed" in first, first
    assert "cudaErrorNotSupported" in first and len(tries) == 1, tries
    assert sum("CUDA IPC is off for cuda:0" in r.getMessage() for r in caplog.records) == 1


NEW, OFFERED, SHARED, WIRE = ChannelState
#: the legal moves that lead a new channel to each state
PATHS = {NEW: [], OFFERED: [OFFERED], SHARED: [OFFERED, SHARED], WIRE: [WIRE]}


@pytest.mark.parametrize(
    "state, seq, total, may",
    [
        (NEW, 3, 10, False),
        (NEW, 4, 10, True),
        (SHARED, 0, 99, True),
        (SHARED, 0, 100, False),
        (SHARED, 4, 100, True),
        (OFFERED, 9, 1, False),
        (WIRE, 9, 1, False),
    ],
)
def test_when_a_channel_offers_again(state, seq, total, may):
    """After a decline for now at transfer 0 (retry after 4): a new channel waits, a shared one re-offers sizes
    below the declined one at once and the declined size after the wait; offered and wire ones never."""
    ch = SendChannel("host", torch.device("cpu"))
    for to in PATHS[state]:
        ch.move(to)
    ch.retry.at = 4
    ch.retry.too_big = 100 if state is SHARED else None
    assert ch.may_offer(seq, total) is may
