"""GPU memory shared by two processes of one node: CUDA IPC, exported once and opened once.

A :class:`DeviceSegment` is a device buffer its writer allocates with
``cudaMalloc`` (through cupy's runtime bindings, outside PyTorch's caching
allocator, so its IPC handle is of this allocation alone and nothing in the
allocator's pools ever moves or is exported per sync) together with an
interprocess CUDA event. The reader opens both once (:class:`DeviceMapping`:
``cudaIpcOpenMemHandle`` with lazy peer access, so a reader on another GPU of
the node copies over NVLink/PCIe) and keeps them for every later sync: memory
never grows per sync, which is the most reported bug of per-sync IPC handles.

Order: the writer records its event on the stream that wrote the buffer, then
sends the header (host order); the reader's stream waits on that event before
its copy, so it never reads bytes still being written. The reader tells the
writer it is done only once its copy has landed (its host waits for it), so the
writer's next write never overtakes the read.

Needs cupy (the ``gpu`` extra) and a GPU; :func:`available` says why not.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import Tensor

from ..core.log import logger
from .shared_memory import MappingError, offer_kind, offer_table, open_offer, seal_offer

OFFER = offer_table(
    "CUDA IPC offer", "64s64sQI"
)  # memory handle, event handle, bytes, the writer's device ordinal
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
    """A uint8 tensor over ``nbytes`` at device pointer ``ptr`` on ``device``, never a copy: torch copies memory
    it finds on another device than the one asked (an IPC pointer of a peer GPU), which would leave the
    reader with stale bytes; that is refused here (the offer is then declined and the wire carries it)."""
    view = torch.as_tensor(_Pointer(ptr, nbytes, device, release), device=device)
    if view.data_ptr() != ptr or view.device != device:
        raise MappingError(
            f"torch gave a copy of the device memory at {ptr:#x} (on {view.device}, at "
            f"{view.data_ptr():#x}) instead of a view on {device}"
        )
    return view


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class DeviceSegment:
    """``capacity`` bytes of ``device`` memory and an interprocess event, exported once."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        from cupy.cuda import runtime

        self.device = torch.device("cuda", _index(device))
        self.capacity = capacity
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
    """The reader's view of another process's :class:`DeviceSegment`, opened once."""

    def __init__(
        self, handle: bytes, event_handle: bytes, capacity: int, device: torch.device
    ) -> None:
        from cupy.cuda import runtime

        self.device = torch.device("cuda", _index(device))
        self.capacity = capacity
        with torch.cuda.device(self.device):
            try:
                self._ptr = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
            except Exception as error:  # noqa: BLE001 - cupy's CUDARuntimeError
                raise MappingError(
                    f"cannot open the peer's CUDA IPC handle: {error}", lasting=False
                ) from None
            self.written = torch.cuda.Event.from_ipc_handle(self.device, event_handle)
        #: the payload bytes (read them only; the handle is closed with the last view of it)
        self.data: Tensor = _view(self._ptr, capacity, self.device, runtime.ipcCloseMemHandle)

    def before_read(self, stream: Any) -> None:
        """Make ``stream`` wait for the writer's last write (recorded before its header was sent); with no
        stream (host memory receiving), the host waits."""
        if stream is None:
            self.written.synchronize()
        else:
            stream.wait_event(self.written)


def offer(segments: list[DeviceSegment]) -> bytes:
    """What a reader needs to open ``segments``."""
    return seal_offer(
        OFFER, KIND, [(s.handle, s.event_handle, s.capacity, s.device.index) for s in segments]
    )


def is_device_offer(raw: bytes) -> bool:
    return offer_kind(raw) == KIND


def map_offer(raw: bytes, most_bytes: int, device: torch.device) -> list[DeviceMapping]:
    """Open every segment of a device offer on ``device``; raises :class:`MappingError` with the reason
    this process cannot (another machine, no CUDA or cupy, a bad handle, ...)."""
    _, entries = open_offer(raw, OFFER, KIND, 2, available(device), most_bytes)
    return [
        DeviceMapping(handle, event_handle, capacity, device)
        for handle, event_handle, capacity, _ in entries
    ]
