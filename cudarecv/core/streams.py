"""CUDA pieces: cudarecv's dedicated streams, event waits and reused staging buffers.

Nothing here initializes CUDA at import, so the package imports on a machine
without CUDA; the functions that create streams or events are called only for
transfers that touch a GPU.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from datetime import timedelta
from typing import Any

import torch

from .errors import ArgumentError
from .log import logger
from .lru import lru_get

#: cupy when it can make CUDA streams here, None when not (:func:`new_stream` decides at its first call)
_UNDECIDED: Any = object()
_CUPY: Any = _UNDECIDED
_LOCK = threading.Lock()


def new_stream(device: torch.device) -> torch.cuda.Stream:
    """A new CUDA stream on ``device`` that is cudarecv's alone: the one place cudarecv makes a stream.

    ``torch.cuda.Stream()`` does not create a stream: it hands out one of a pool of 32 per device and
    priority, round-robin (``getStreamFromPool`` in c10/cuda/CUDAStream.cpp: ``kStreamsPerPool = 1 <<
    kStreamsPerPoolBits`` with 5 bits, ``get_idx`` takes a counter modulo that), and ProcessGroupNCCL draws
    each communicator's NCCL stream from the same pool (``getStreamFromPool`` in ``getNCCLComm``), as do FSDP
    and other libraries. Once the counter wraps, a stream drawn for one link may be the very CUDA stream of
    another link, or of an NCCL communicator: its work then waits for theirs, and a stalled peer stalls
    the others again. So cudarecv's streams are made outside the pool, with cupy (``cudarecv[gpu]``): a
    non-blocking stream created with ``device`` current, seen by torch as an ``ExternalStream``, which
    holds the cupy stream (destroyed when the last reference to the returned stream goes: a link's streams
    live as long as its group object, an owner's as long as the owner). Without cupy (or where it cannot
    make streams) it falls back to torch's pool, and says once, on the ``cudarecv`` logger, that streams
    may alias.

    Example:
        >>> a, b = new_stream(torch.device("cuda", 0)), new_stream(torch.device("cuda", 0))
        >>> a.cuda_stream != b.cuda_stream
        True
    """
    index = _index(device)
    cupy = _cupy()
    if cupy is None:
        return torch.cuda.Stream(device=index)
    try:
        with cupy.cuda.Device(index):
            owned = cupy.cuda.Stream(non_blocking=True)
        stream = torch.cuda.ExternalStream(owned.ptr, device=torch.device("cuda", index))
    except Exception as error:  # noqa: BLE001 - a driver or context error: the pool still gives a stream
        logger.warning(
            "cudarecv could not make a CUDA stream of its own on cuda:%d with cupy (%s): this one comes from "
            "torch's pool, and may alias another link's or NCCL's",
            index,
            error,
        )
        return torch.cuda.Stream(device=index)
    # (torch does not own an external stream: the cupy object, destroying it when collected, goes with it)
    setattr(stream, "_cudarecv_owner", owned)  # noqa: B010 - an attribute torch's class does not declare
    return stream


def _cupy() -> Any:
    """cupy if it makes CUDA streams in this process, else None (said once on the logger); decided once."""
    global _CUPY
    with _LOCK:
        if _CUPY is _UNDECIDED:
            _CUPY, why = _try_cupy()
            if _CUPY is None:
                logger.warning(
                    "cudarecv makes its CUDA streams with torch.cuda.Stream(), i.e. from torch's pool of 32 "
                    "per device, which ProcessGroupNCCL and other libraries draw from too (%s): a weight "
                    "end's link streams may then alias each other's or NCCL's, and a stalled peer stall the "
                    "others; install cudarecv[gpu] (cupy) for streams of cudarecv's own",
                    why,
                )
        return _CUPY


def _try_cupy() -> tuple[Any, str]:
    try:
        import cupy
    except ImportError as error:
        return None, f"cupy cannot be imported: {error}"
    try:
        usable = cupy.cuda.is_available()
    except Exception as error:  # noqa: BLE001 - any failure of cupy's means: not usable here
        return None, f"cupy cannot use CUDA: {error!r}"
    return (cupy, "") if usable else (None, "cupy sees no CUDA device")


_STREAMS: dict[int, torch.cuda.Stream] = {}


def dedicated_stream(device: torch.device) -> torch.cuda.Stream:
    """cudarecv's own stream on ``device``, created once per device and reused (:func:`new_stream`: a
    pooled stream could be a communicator's or a link's, and a plain call then wait for their peers).

    Example:
        >>> s = dedicated_stream(torch.device("cuda", 0))
        >>> s is dedicated_stream(torch.device("cuda:0"))
        True
    """
    index = _index(device)
    with _LOCK:
        stream = _STREAMS.get(index)
    if stream is None:
        made = new_stream(torch.device("cuda", index))
        with _LOCK:
            stream = _STREAMS.setdefault(index, made)
    return stream


_COPY_STREAMS: dict[int, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """cudarecv's second stream on ``device``, for staging copies that overlap the wire, for the lanes of
    plain calls (one transfer at a time on the device's :func:`dedicated_stream`; a weight end's lanes have a
    copy stream per link, :func:`link_copy_stream`). Made by :func:`new_stream`, as that one."""
    index = _index(device)
    with _LOCK:
        stream = _COPY_STREAMS.get(index)
    if stream is None:
        made = new_stream(torch.device("cuda", index))
        with _LOCK:
            stream = _COPY_STREAMS.setdefault(index, made)
    return stream


#: per group object: (device index, peer, role) -> that link's stream (see :func:`link_stream`)
_LINK_STREAMS: weakref.WeakKeyDictionary[object, dict[tuple[int, int, str], torch.cuda.Stream]] = (
    weakref.WeakKeyDictionary()
)


def link_stream(device: torch.device, pg: object, peer: int) -> torch.cuda.Stream:
    """cudarecv's own stream on ``device`` for the link to ``peer`` in group ``pg``, created once and reused.

    A weight sender or receiver talks to several peers at once; ProcessGroupNCCL makes each op's NCCL
    stream wait for the stream current when the op is posted (``syncStream`` in ``pointToPoint``), and
    ``Work.wait()`` makes that stream wait for the op. On one stream shared by every link, each op would
    so wait for every op posted before it, whatever its peer: one stalled peer stalls the others, a
    relay loses its pipelining, and ops that wait on each other across ranks deadlock. A stream per link
    keeps only the waits a transfer asks for (an event of the chunk it forwards). Made by
    :func:`new_stream`, outside torch's pool (where, past 32 draws on a device, two links or a link and a
    communicator would share a CUDA stream); it lives as long as ``pg``.

    Example:
        >>> s = link_stream(torch.device("cuda", 0), group, 1)
        >>> s is link_stream(torch.device("cuda:0"), group, 1), s is link_stream(torch.device("cuda:0"), group, 2)
        (True, False)
    """
    return _per_link(device, pg, peer, "wire")


def link_copy_stream(device: torch.device, pg: object, peer: int) -> torch.cuda.Stream:
    """The copy stream of the link to ``peer`` in ``pg`` on ``device`` (host memory staged through device
    buffers on NCCL), created once and reused, as :func:`link_stream`.

    The copies of a transfer wait for its link stream (:func:`~cudarecv.wire.staging.recv_into`): on one
    copy stream per device, a link's copies would wait for every other link's backlog, its NCCL receives
    included, so a stalled peer would stall the others' copies (and the sends that wait for them), and a
    receive never matched (a failed transfer) every later staged transfer on the device."""
    return _per_link(device, pg, peer, "copy")


def _per_link(device: torch.device, pg: object, peer: int, role: str) -> torch.cuda.Stream:
    index = _index(device)
    with _LOCK:
        per_group = _LINK_STREAMS.get(pg)
        if per_group is None:
            per_group = _LINK_STREAMS[pg] = {}
        stream = per_group.get((index, peer, role))
    if stream is None:  # (made outside the lock: the first call may import cupy)
        made = new_stream(torch.device("cuda", index))
        with _LOCK:
            stream = per_group.setdefault((index, peer, role), made)
    return stream


def own_stream(device: torch.device) -> torch.cuda.Stream:
    """A new stream on ``device`` for one owner's work alone (a weight sender's copy-ins of its versions),
    made by :func:`new_stream`: it lives as long as its owner holds it."""
    return new_stream(device)


def transfer_stream(device: torch.device, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
    """The stream a transfer to/from ``device`` runs on: the caller's ``stream`` or the dedicated one."""
    if stream is None:
        return dedicated_stream(device)
    if _index(stream.device) != _index(device):
        raise ArgumentError(
            f"`stream` is on {stream.device} but the tensordict is on {device}: pass a stream of "
            f"{device} or None for cudarecv's dedicated stream"
        )
    return stream


def follow_caller(stream: torch.cuda.Stream) -> None:
    """Order ``stream`` after the caller's current stream (what it queued comes first),
    without blocking either the caller's stream or the host."""
    stream.wait_stream(torch.cuda.current_stream(stream.device))


def explicit(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` means the calling thread's current device, resolved here (a
    background thread's current device is 0 whatever the caller's).

    Example:
        >>> torch.cuda.set_device(1); explicit(torch.device("cuda"))
        device(type='cuda', index=1)
    """
    device = torch.device(device)
    if device.type != "cuda" or device.index is not None or not torch.cuda.is_available():
        return device  # (without CUDA the first use says so)
    return torch.device("cuda", torch.cuda.current_device())


def _index(device: torch.device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


class EventWork:
    """A recorded CUDA event seen as a ``Work``: ``wait()`` blocks the host until it fires."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block in ``cudaEventSynchronize`` until the event fires (:func:`record`'s events sleep
        there, no polling). ``timeout`` is not taken: CUDA cannot bound the wait, and a transfer's
        own deadline is kept without its driver (:mod:`cudarecv.core.transfer`)."""
        self.event.synchronize()
        return True

    def is_completed(self) -> bool:
        return self.event.query()


def record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A new event recorded on ``stream``; waiting for it blocks the host thread in the OS
    (``cudaEventBlockingSync``) rather than spinning a core."""
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


class StagingPool:
    """Staging buffers allocated once and reused: at most ``depth`` per (place, size).

    ``place`` is ``"pinned"`` (page-locked host memory, for gloo <-> CUDA) or a
    CUDA device (for NCCL <-> host). The same request returns the same buffers,
    so steady state allocates nothing; at most ``sizes`` distinct (place, size)
    pairs are kept (message sizes follow the peer's ``bucket_bytes``), the least
    recently used freed once its fences have fired. ``allocations`` counts the
    buffers ever allocated (for tests). Each
    owner (a tensordict's plan, a weight sender or receiver) has its own pool,
    used by one transfer at a time; :meth:`fence` is the CUDA event of the last
    stream copy that touches a buffer (see :mod:`cudarecv.wire.staging`).

    Example:
        >>> pool = StagingPool()
        >>> a = pool.buffers("pinned", 1 << 20)
        >>> a is pool.buffers("pinned", 1 << 20)
        True
    """

    def __init__(self, depth: int = 2, sizes: int = 4) -> None:
        self.depth = depth
        self.sizes = sizes
        self.allocations = 0
        self._buffers: OrderedDict[tuple[str, int], list[torch.Tensor]] = OrderedDict()
        self._fences: dict[int, torch.cuda.Event] = {}

    def buffers(
        self, place: str | torch.device, nbytes: int, count: int | None = None
    ) -> list[torch.Tensor]:
        """``min(count, depth)`` uint8 buffers of ``nbytes`` on ``place``, reused across calls."""
        count = self.depth if count is None else min(count, self.depth)
        found = lru_get(self._buffers, (str(place), nbytes), list, self.sizes, evict=self._retire)
        while len(found) < count:
            found.append(_allocate(place, nbytes))
            self.allocations += 1
        return found[:count]

    def fence(self, buffer: torch.Tensor) -> torch.cuda.Event | None:
        """The event of the last stream copy into or out of ``buffer`` (or None)."""
        return self._fences.get(buffer.data_ptr())

    def set_fence(self, buffer: torch.Tensor, event: torch.cuda.Event) -> None:
        self._fences[buffer.data_ptr()] = event

    def _retire(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            event = self._fences.pop(buffer.data_ptr(), None)
            if event is not None:
                event.synchronize()  # a queued copy may still use it


def _allocate(place: str | torch.device, nbytes: int) -> torch.Tensor:
    if str(place) == "pinned":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.empty(nbytes, dtype=torch.uint8, device=place)
