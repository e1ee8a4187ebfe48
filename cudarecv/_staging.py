"""Moving messages between the wire and memory the wire cannot touch.

gloo reads and writes host memory only; NCCL device memory only. When a
tensordict lives elsewhere (CUDA storage on gloo, host storage on NCCL), each
message goes through a staging buffer on the wire's side, with the copy on
cudarecv's streams:

- *ring* staging (chunks, buckets): two buffers of one message each, from the
  reused :data:`~cudarecv._cuda.POOL`; the copy of message i overlaps the
  transfer of message i+1;
- *full* staging (per-leaf messages, all posted at once): the caller's buffer
  holding every message (allocated once per plan).

Sub-protocols here are driven with ``yield from`` inside a transfer protocol
(:mod:`._handle`): what they yield are ``Work``-like objects the host waits on.
On NCCL the host never waits: ``Work.wait()`` orders the stream instead.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from . import _cuda
from ._link import Link
from ._transport import post


@dataclass
class Lane:
    """One transfer's link and stream (``None`` when neither end touches CUDA)."""

    link: Link
    stream: Any = None

    @property
    def nccl(self) -> bool:
        return self.link.backend == "nccl"

    def on_stream(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def finish(self) -> Any:
        """The event the caller's stream waits on (recorded now on the transfer stream)."""
        return _cuda.record(self.stream) if self.stream is not None else None


def recv_into(lane: Lane, dests: Sequence[Tensor], tags: Sequence[int],
              staging: Sequence[Tensor] | None = None,
              landed: Callable[[int], None] | None = None) -> Any:
    """Receive message i into ``dests[i]`` (contiguous); ``landed(i)`` once it is there.

    ``staging`` (full staging, one buffer per message on the wire's side) is
    used when the wire cannot write ``dests``; without it a ring of two buffers.
    """
    n = len(dests)
    if _wire_can_touch(lane, dests):
        with lane.on_stream():
            works = post(lane.link, False, dests, tags)
            if lane.nccl:
                for work in works:
                    work.wait()  # orders the transfer stream; the host goes on
                for i in range(n if landed else 0):
                    landed(i)
                return
        if landed is None:
            yield works
            return
        for i, work in enumerate(works):
            yield [work]
            with lane.on_stream():
                landed(i)
        return
    if staging is not None:
        yield from _recv_full(lane, dests, tags, staging, landed)
    elif lane.nccl:
        yield from _recv_ring_nccl(lane, dests, tags, landed)
    else:
        yield from _recv_ring_gloo(lane, dests, tags, landed)


def _byte(t: Tensor) -> Tensor:
    return t.reshape(-1).view(torch.uint8)


def _recv_full(lane: Lane, dests, tags, staging, landed) -> Any:
    """gloo into CUDA memory, every message at once through ``staging`` (pinned)."""
    works = post(lane.link, False, staging, tags)
    yield works
    with lane.on_stream():
        torch._foreach_copy_([_byte(d) for d in dests], [_byte(s) for s in staging], non_blocking=True)
        for i in range(len(dests) if landed else 0):
            landed(i)


def _recv_ring_gloo(lane: Lane, dests, tags, landed) -> Any:
    """gloo into CUDA memory: recv into two pinned buffers, H2D copies overlapping the next recv."""
    n = len(dests)
    size = max(d.numel() * d.element_size() for d in dests)
    ring = _cuda.POOL.buffers("pinned", size, count=n)

    def start(i: int) -> Any:
        return post(lane.link, False, [ring[i % 2][: _nbytes(dests[i])]], [tags[i]])[0]

    works = {i: start(i) for i in range(min(2, n))}
    for i in range(n):
        yield [works.pop(i)]
        with lane.on_stream():
            _byte(dests[i]).copy_(ring[i % 2][: _nbytes(dests[i])], non_blocking=True)
            if landed:
                landed(i)
            copied = _cuda.record(lane.stream)
        if i + 2 < n:
            yield [_cuda.EventWork(copied)]  # the pinned buffer is free again
            works[i + 2] = start(i + 2)


def _recv_ring_nccl(lane: Lane, dests, tags, landed) -> Any:
    """NCCL into host memory: recv into two device buffers, D2H copies on a second stream."""
    n = len(dests)
    device = lane.stream.device
    size = max(_nbytes(d) for d in dests)
    ring = _cuda.POOL.buffers(device, size, count=n)
    copier = _cuda.copy_stream(device)
    freed: list[Any] = [None, None]
    for i in range(n):
        buf = ring[i % 2][: _nbytes(dests[i])]
        if freed[i % 2] is not None:
            lane.stream.wait_event(freed[i % 2])
        with lane.on_stream():
            for work in post(lane.link, False, [buf], [tags[i]]):
                work.wait()
            arrived = _cuda.record(lane.stream)
        copier.wait_event(arrived)
        with torch.cuda.stream(copier):
            _byte(dests[i]).copy_(buf, non_blocking=True)
            if landed:
                landed(i)
            freed[i % 2] = _cuda.record(copier)
    for event in freed:
        if event is not None:
            lane.stream.wait_event(event)
    yield [_cuda.EventWork(_cuda.record(lane.stream))]  # host memory: the host waits for the bytes


def send_from(lane: Lane, srcs: Sequence[Tensor], tags: Sequence[int],
              staging: Sequence[Tensor] | None = None,
              fill: Callable[[int], None] | None = None, defer: bool = False) -> Any:
    """Send ``srcs[i]`` as message i; ``fill(i)`` (if given) writes it just before it goes.

    ``fill`` runs on the transfer stream; on gloo, the host waits for it before
    the bytes go (a device-to-host copy must have landed). With ``defer``, works
    posted straight from the wire's memory are returned instead of waited for,
    so the caller can post more messages first.
    """
    n = len(srcs)
    if _wire_can_touch(lane, srcs):
        if lane.nccl:
            with lane.on_stream():
                for i in range(n if fill else 0):
                    fill(i)
                for work in post(lane.link, True, srcs, tags):
                    work.wait()
            return
        works = []
        for i in range(n):
            if fill:
                with lane.on_stream():
                    fill(i)
                if lane.stream is not None:
                    lane.stream.synchronize()
            works += post(lane.link, True, [srcs[i]], [tags[i]])
        if defer:
            return works
        yield works
        return
    if lane.nccl:
        yield from _send_ring_nccl(lane, srcs, tags)
        return
    # gloo from CUDA memory: D2H into pinned staging (full, or a ring of two), then send
    if staging is not None:
        with lane.on_stream():
            torch._foreach_copy_([_byte(s) for s in staging], [_byte(t) for t in srcs], non_blocking=True)
            copied = _cuda.record(lane.stream)
        yield [_cuda.EventWork(copied)]
        yield post(lane.link, True, staging, tags)
        return
    ring = _cuda.POOL.buffers("pinned", max(_nbytes(t) for t in srcs), count=n)
    sent: list[Any] = [None, None]
    for i in range(n):
        if sent[i % 2] is not None:
            yield [sent[i % 2]]
        buf = ring[i % 2][: _nbytes(srcs[i])]
        with lane.on_stream():
            buf.copy_(_byte(srcs[i]), non_blocking=True)
            copied = _cuda.record(lane.stream)
        yield [_cuda.EventWork(copied)]
        sent[i % 2] = post(lane.link, True, [buf], [tags[i]])[0]
    yield [w for w in sent if w is not None]


def _wire_can_touch(lane: Lane, tensors: Sequence[Tensor]) -> bool:
    return not tensors or (tensors[0].device.type == "cuda") == lane.nccl


def _send_ring_nccl(lane: Lane, srcs, tags) -> Any:
    """NCCL from host memory: H2D copies into two device buffers on a second stream, then send."""
    n = len(srcs)
    device = lane.stream.device
    size = max(_nbytes(t) for t in srcs)
    ring = _cuda.POOL.buffers(device, size, count=n)
    copier = _cuda.copy_stream(device)
    sent: list[Any] = [None, None]
    for i in range(n):
        buf = ring[i % 2][: _nbytes(srcs[i])]
        if sent[i % 2] is not None:
            copier.wait_event(sent[i % 2])
        with torch.cuda.stream(copier):
            buf.copy_(_byte(srcs[i]), non_blocking=True)
            copied = _cuda.record(copier)
        lane.stream.wait_event(copied)
        with lane.on_stream():
            for work in post(lane.link, True, [buf], [tags[i]]):
                work.wait()
            sent[i % 2] = _cuda.record(lane.stream)
    return
    yield  # a generator, like the other sub-protocols


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()
