"""GPU memory shared by two processes of one node: CUDA IPC, exported once and opened once.

A :class:`DeviceSegment` is a device buffer its writer allocates with
``cudaMalloc`` (through cupy's runtime bindings, outside PyTorch's caching
allocator, so its IPC handle is of this allocation alone and nothing in the
allocator's pools ever moves or is exported per sync) together with an
interprocess CUDA event. The reader opens both once (:class:`DeviceMapping`) and
keeps them for every later sync: memory never grows per sync, which is the most
reported bug of per-sync IPC handles.

Another GPU of the node: the memory stays on the writer's GPU, and CUDA (and torch,
which places a pointer on the device ``cudaPointerGetAttributes`` names) sees it
there. So the reader opens the handle on the writer's GPU, as torch's own CUDA
tensor sharing does (the offer names that GPU by its PCI bus id, the same in every
process whatever its ``CUDA_VISIBLE_DEVICES``), its view lies on that GPU, and the
copies into the reader's GPU are device-to-device copies between the two: torch runs
each on the writer GPU's current stream (cudarecv's dedicated stream there, while
:meth:`DeviceMapping.reading`) between two event waits with the reader's stream, so
they stay ordered after the writer's event and before what the reader's stream does
next. With peer access between the GPUs (NVLink, or PCIe P2P) they go straight
across; without it the CUDA driver stages them through host memory (slower, still one
copy for the caller, no socket). A writer's GPU that this process cannot see is refused
(the wire carries the payload).

Order: the writer records its event on the stream that wrote the buffer, then
sends the header (host order); the reader's stream waits on that event before
its copy, so it never reads bytes still being written. The reader tells the
writer it is done only once its copy has landed (its host waits for it), so the
writer's next write never overtakes the read.

Needs cupy (the ``gpu`` extra) and a GPU; :func:`available` says why not.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..core.log import logger
from ..core.streams import dedicated_stream
from .shared_memory import MappingError, offer_kind, offer_table, open_offer, seal_offer

OFFER = offer_table(
    "CUDA IPC offer", "64s64sQI32s"
)  # memory handle, event handle, bytes, the writer's device ordinal (its numbering), its GPU's PCI bus id
KIND = 2


def available(device: torch.device) -> str | None:
    """Why ``device`` memory cannot be shared over CUDA IPC here, or None. The first ask per device exports a
    one-byte segment (some virtual machines and sandboxes refuse IPC): the answer is kept, and logged."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed (pip install 'cudarecv[gpu]')"
    return _exports(_index(device))


@functools.cache
def _exports(index: int) -> str | None:
    """Whether this process can export CUDA IPC handles of device ``index`` (tried once)."""
    try:
        DeviceSegment(1, torch.device("cuda", index))
    except Exception as error:  # noqa: BLE001 - whatever refuses it: the reason is the answer
        reason = (
            f"exporting a CUDA IPC handle on cuda:{index} failed: {type(error).__name__}: {error}"
        )
        logger.warning(
            "CUDA IPC is off for cuda:%d in this process: %s; its transfers go on the wire",
            index,
            reason,
        )
        return reason
    return None


class _Pointer:
    """A raw device pointer as a ``__cuda_array_interface__``, for a zero-copy torch view that keeps it alive:
    ``release(ptr)`` (free, or close the opened handle) runs on ``device`` once the last view is gone."""

    def __init__(self, ptr: int, nbytes: int, device: torch.device, release: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }
        weakref.finalize(
            self, _release, release, ptr, device
        ).atexit = False  # (the process's end frees it)


def _release(release: Any, ptr: int, device: torch.device) -> None:
    try:
        with torch.cuda.device(device):
            release(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
        pass


def _view(ptr: int, nbytes: int, device: torch.device, release: Any) -> Tensor:
    """A uint8 tensor over ``nbytes`` at device pointer ``ptr`` on ``device`` (the GPU the memory lies on), never
    a copy: torch copies memory it finds on another device than the one asked, which would leave the reader
    with stale bytes; that is refused here (the offer is then declined and the wire carries it)."""
    view = torch.as_tensor(_Pointer(ptr, nbytes, device, release), device=device)
    if view.data_ptr() != ptr or view.device != device:
        raise MappingError(
            f"torch gave a copy of the device memory at {ptr:#x} (on {view.device}, at "
            f"{view.data_ptr():#x}) instead of a view on {device}"
        )
    return view


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _bus_id(index: int) -> bytes:
    """The PCI bus id of GPU ``index`` of this process (``0000:65:00.0``): what names it in every process."""
    from cupy.cuda import runtime

    return str(runtime.deviceGetPCIBusId(index)).encode("ascii")


def _index_of_bus(bus_id: bytes, ordinal: int) -> int:
    """This process's index of the GPU with PCI bus id ``bus_id`` (the writer's GPU ``ordinal``, in its own
    numbering); raises :class:`MappingError` if this process cannot see it."""
    from cupy.cuda import runtime

    bus = bus_id.rstrip(b"\0").decode("ascii", "replace")
    try:
        return int(runtime.deviceGetByPCIBusId(bus))
    except Exception as error:  # noqa: BLE001 - cupy's CUDARuntimeError
        raise MappingError(
            f"the writer's GPU (its cuda:{ordinal}, PCI bus {bus or '?'}) is not visible to this process "
            f"(CUDA_VISIBLE_DEVICES?): its memory cannot be opened here ({error})"
        ) from None


class DeviceSegment:
    """``capacity`` bytes of ``device`` memory and an interprocess event, exported once."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        from cupy.cuda import runtime

        self.device = torch.device("cuda", _index(device))
        self.capacity = capacity
        self.bus_id = _bus_id(self.device.index)  # (names the GPU to readers with other numberings)
        with torch.cuda.device(self.device):
            self._ptr = runtime.malloc(max(capacity, 1))
            self.handle = bytes(runtime.ipcGetMemHandle(self._ptr))
            self.written = torch.cuda.Event(interprocess=True)
            self.written.record()  # the event exists (and has completed) before anyone opens it
            self.event_handle = bytes(self.written.ipc_handle())
        #: the payload bytes, writable (the allocation is freed with the last view of it)
        self.data: Tensor = _view(self._ptr, capacity, self.device, runtime.free)

    def close_fd(self) -> None:
        """(Nothing names a device segment but its handle, which readers opened once.)"""


class DeviceMapping:
    """The reader's view of another process's :class:`DeviceSegment`, opened once on the GPU it lies on
    (``owner``), for copies into the reader's ``device`` (the same GPU, or another of the node: see the module
    docstring)."""

    def __init__(
        self,
        handle: bytes,
        event_handle: bytes,
        capacity: int,
        device: torch.device,
        owner: torch.device | None = None,
    ) -> None:
        from cupy.cuda import runtime

        #: where the reader's copies land (its tensordict's or weights' GPU)
        self.device = torch.device("cuda", _index(device))
        #: where the memory lies: the writer's GPU, in this process's numbering
        self.owner = self.device if owner is None else torch.device("cuda", _index(owner))
        self.capacity = capacity
        with torch.cuda.device(self.owner):
            try:
                self._ptr = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
            except Exception as error:  # noqa: BLE001 - cupy's CUDARuntimeError
                raise MappingError(
                    f"cannot open the peer's CUDA IPC handle: {error}", lasting=False
                ) from None
            self.written = torch.cuda.Event.from_ipc_handle(self.owner, event_handle)
        #: the payload bytes, on :attr:`owner` (read them only; the handle is closed with the last view of it)
        self.data: Tensor = _view(self._ptr, capacity, self.owner, runtime.ipcCloseMemHandle)

    @property
    def crossing(self) -> str | None:
        """How the copies cross to the reader's GPU (for the log), or None on the same GPU."""
        if self.owner == self.device:
            return None
        peer = torch.cuda.can_device_access_peer(self.device, self.owner)
        return (
            f"the writer's memory is on {self.owner}: device-to-device copies to {self.device}, "
            + (
                "peer to peer"
                if peer
                else "without peer access between them (the CUDA driver stages them through host memory)"
            )
        )

    def before_read(self, stream: Any) -> None:
        """Make ``stream`` wait for the writer's last write (recorded before its header was sent); with no
        stream (host memory receiving), the host waits."""
        if stream is None:
            self.written.synchronize()
        else:
            stream.wait_event(self.written)

    @contextlib.contextmanager
    def reading(self, stream: Any) -> Iterator[None]:
        """Copies out of :attr:`data` queued in this context come after the writer's last write (``stream``, the
        reader's, waits for it; None: the host does). Memory on another GPU than the reader's is copied by torch
        on the owner GPU's current stream, ordered between the reader's stream's work before and after: here
        that is cudarecv's dedicated stream there, never the owner GPU's default stream (whatever else this
        process runs on it). Put the reader's stream current inside this context (``lane.on_stream()``)."""
        self.before_read(stream)
        if self.owner == self.device:
            yield
            return
        with torch.cuda.stream(dedicated_stream(self.owner)):
            yield


def offer(segments: list[DeviceSegment]) -> bytes:
    """What a reader needs to open ``segments``."""
    return seal_offer(
        OFFER,
        KIND,
        [(s.handle, s.event_handle, s.capacity, s.device.index, s.bus_id) for s in segments],
    )


def is_device_offer(raw: bytes) -> bool:
    return offer_kind(raw) == KIND


def map_offer(raw: bytes, most_bytes: int, device: torch.device) -> list[DeviceMapping]:
    """Open every segment of a device offer, for copies into ``device``: each on the GPU it lies on (``device``
    or another of this node); raises :class:`MappingError` with the reason this process cannot (another
    machine, no CUDA or cupy, the writer's GPU not visible here, a bad handle, ...)."""
    _, entries = open_offer(raw, OFFER, KIND, 2, available(device), most_bytes)
    return [
        DeviceMapping(
            handle,
            event_handle,
            capacity,
            device,
            torch.device("cuda", _index_of_bus(bus_id, ordinal)),
        )
        for handle, event_handle, capacity, ordinal, bus_id in entries
    ]
