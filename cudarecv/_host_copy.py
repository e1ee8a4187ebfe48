"""Copies between host buffers on one thread: the native copy (``native/host_copy.c``, built at
install where a C compiler is), else ``memmove``.

One thread because torch's ``copy_`` of a megabyte wakes its OpenMP threads, whose spinning starves
the peer process on the same cores. The native copy streams large copies past the caches where that
is faster: on some machines two processes copying at once (the sender into a segment, the receiver
out of it) otherwise share the memory bus at half speed; on others glibc's memcpy is faster at every
size. The first large copy measures both on 64 MiB (about 0.1 s, once per process) and keeps the
faster; ``CUDARECV_HOST_COPY=stream`` or ``=memcpy`` chooses without measuring (:data:`STREAMING`
says what was chosen, once a large copy ran).

Example:
    >>> a, b = torch.arange(4.0), torch.zeros(4)
    >>> copy_bytes(b, a); b
    tensor([0., 1., 2., 3.])
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import time
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from ._errors import ArgumentError


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    spec = importlib.util.find_spec("cudarecv._host_copy_native")
    if spec is None or spec.origin is None:
        return None, "cudarecv was installed without a C compiler: host copies use memmove"
    lib = ctypes.CDLL(spec.origin)
    lib.cudarecv_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.cudarecv_copy.restype = None
    lib.cudarecv_copy_many.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.cudarecv_copy_many.restype = None
    lib.cudarecv_copy_streaming.argtypes = [ctypes.c_int]
    lib.cudarecv_copy_streaming.restype = ctypes.c_int
    lib.cudarecv_publish.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.cudarecv_publish.restype = None
    lib.cudarecv_observe.argtypes = [ctypes.c_void_p]
    lib.cudarecv_observe.restype = ctypes.c_uint64
    return lib, None


_LIB, WHY_NOT_NATIVE = _load()
NATIVE = _LIB is not None  # whether the native copies were built
ENV = "CUDARECV_HOST_COPY"  # "stream", "memcpy", or "auto" (measure at the first large copy; the default)
STREAM_MIN = 256 * 1024  # below this no copy streams (native/host_copy.c)
_PROBE = 64 << 20  # larger than the last-level caches of today's servers
#: whether large native copies stream (None until the first large copy chose)
STREAMING: bool | None = None


def _choose() -> bool:
    """Set the native copy's streaming as ``CUDARECV_HOST_COPY`` says, else to the faster one here."""
    global STREAMING
    choice = os.environ.get(ENV, "auto")
    if choice not in ("auto", "stream", "memcpy"):
        raise ArgumentError(f"the environment variable {ENV}={choice!r} must be one of auto, stream, memcpy")
    if choice != "auto":
        STREAMING = bool(_LIB.cudarecv_copy_streaming(choice == "stream"))
        return STREAMING
    src, dst = np.ones(_PROBE, dtype=np.uint8), np.zeros(_PROBE, dtype=np.uint8)  # (pages touched)
    best = {}
    for on in (0, 1, 0, 1):
        _LIB.cudarecv_copy_streaming(on)
        start = time.perf_counter()
        _LIB.cudarecv_copy(dst.ctypes.data, src.ctypes.data, _PROBE)
        best[on] = min(best.get(on, math.inf), time.perf_counter() - start)
    STREAMING = bool(_LIB.cudarecv_copy_streaming(int(best[1] < best[0])))
    return STREAMING


def copy(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to ``dst`` (the two do not overlap); the GIL is released."""
    if _LIB is None:
        ctypes.memmove(dst, src, n)
        return
    if STREAMING is None and n >= STREAM_MIN:
        _choose()
    _LIB.cudarecv_copy(dst, src, n)


def publish(address: int, value: int) -> None:
    """Store ``value`` in the 8-byte word at ``address``, ordered after every store before it: a reader that
    loads it with :func:`observe` sees them. Needs the native build (:data:`NATIVE`)."""
    _LIB.cudarecv_publish(address, value)


def observe(address: int) -> int:
    """Load the 8-byte word at ``address``, ordered before every load after it. Needs :data:`NATIVE`."""
    return _LIB.cudarecv_observe(address)


def copy_bytes(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` of contiguous bytes; between host buffers one thread's :func:`copy`."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        copy(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
    else:
        dst.copy_(src, non_blocking=True)


class CopyTable:
    """Many host copies, rows of (destination address, source address, bytes), done a run of rows at a
    time in one call: e.g. the leaves of each message of a layout gathered into a segment or scattered
    out of one.

    The memory must outlive the table and stay where it is (a :class:`~cudarecv._plan.Plan` is rebuilt
    when a leaf's data pointer moves).
    """

    def __init__(self, rows: Sequence[tuple[int, int, int]] | np.ndarray) -> None:
        self._table = np.array(rows, dtype=np.uint64, order="C").reshape(-1, 3)  # a copy, rows contiguous

    def reversed(self) -> "CopyTable":
        """The same copies the other way (sources and destinations swapped)."""
        return CopyTable(self._table[:, [1, 0, 2]])

    def run(self, start: int, stop: int) -> None:
        """Do the copies of rows ``start`` to ``stop`` (excluded)."""
        if _LIB is not None:
            if STREAMING is None:
                _choose()
            _LIB.cudarecv_copy_many(self._table.ctypes.data + start * self._table.strides[0], stop - start)
        else:
            for dst, src, n in self._table[start:stop].tolist():
                ctypes.memmove(dst, src, n)


# -- reading another process's memory (Linux cross-memory attach) -------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _readv.restype = ctypes.c_ssize_t
IOV_MAX = 1024  # iovecs per process_vm_readv call


def may_read_process(pid: int) -> str | None:
    """Why this process cannot read the memory of process ``pid`` directly, or None if it can.

    Probes with one byte at address 0: a process allowed to read (the kernel's ptrace access check:
    same user, no Yama or seccomp veto) gets EFAULT, any other gets EPERM, ENOSYS, ..."""
    if _readv is None:
        return "this C library has no process_vm_readv"
    byte = ctypes.c_uint64(0)
    iov = (ctypes.c_uint64 * 4)(ctypes.addressof(byte), 1, 0, 1)
    if _readv(pid, ctypes.addressof(iov), 1, ctypes.addressof(iov) + 16, 1, 0) == -1:
        errno = ctypes.get_errno()
        if errno == 14:  # EFAULT: allowed, and address 0 is unmapped
            return None
        return f"process_vm_readv of pid {pid}: {os.strerror(errno)}"
    return "process_vm_readv read address 0"


def read_process(pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """Copy each region ``remote[i]`` (address, bytes) of process ``pid`` into ``local[i]`` (uint64 arrays of
    shape (n, 2), the layout of ``struct iovec``); the GIL is released. Returns the bytes read, fewer than
    asked if a remote region is not mapped."""
    got = 0
    for start in range(0, len(local), IOV_MAX):
        count = min(IOV_MAX, len(local) - start)
        want = int(local[start:start + count, 1].sum())
        n = _readv(pid, local.ctypes.data + start * 16, count, remote.ctypes.data + start * 16, count, 0)
        if n < 0 and ctypes.get_errno() == 14:  # EFAULT: the first region is not mapped, nothing was read
            break
        if n < 0:
            raise OSError(ctypes.get_errno(), f"process_vm_readv: {os.strerror(ctypes.get_errno())}")
        got += n
        if n < want:
            break
    return got


DIRECT_ENV = "CUDARECV_DIRECT_READ"  # "on", "off", or "auto" (measure once whether it pays; the default)
_DIRECT_PROBE, _DIRECT_PIECE = 16 << 20, 8 << 10
#: how much slower than one copy a direct read may be and still beat the segments' two copies, which run
#: at once on the two processes' cores (each ~one copy's time) plus filling the pipeline and its messages
DIRECT_SLACK = 1.5


class DirectRead(NamedTuple):
    """Where reading a same-host peer's memory directly beats the shared segments: for many small
    regions (a tensordict's leaves) and for one large region (a consolidated storage)."""

    leaves: bool
    storages: bool


#: what reading a peer's memory directly beat (None until first asked with ``auto``)
DIRECT_PAYS: DirectRead | None = None


def direct_read_setting() -> str:
    """``CUDARECV_DIRECT_READ``, checked: ``"auto"`` (unset), ``"on"`` or ``"off"``."""
    choice = os.environ.get(DIRECT_ENV, "auto")
    if choice not in ("auto", "on", "off"):
        raise ArgumentError(f"the environment variable {DIRECT_ENV}={choice!r} must be one of auto, on, off")
    return choice


def _read_vs_copy(dst: Tensor, src: Tensor, piece: int) -> tuple[bool, float, float]:
    """Whether this process reads all of ``src`` into ``dst`` (in regions of ``piece`` bytes) with
    ``process_vm_readv``, and the best of 3 times of that read and of the same copies by :class:`CopyTable`."""
    starts = np.arange(0, src.numel(), piece, dtype=np.uint64)
    sizes = np.full_like(starts, piece)
    local = np.stack([dst.data_ptr() + starts, sizes], axis=1)
    remote = np.stack([src.data_ptr() + starts, sizes], axis=1)
    table = CopyTable(np.stack([local[:, 0], remote[:, 0], sizes], axis=1))
    table.run(0, len(starts))  # (and the copy's own choice, once)
    whole, read, copied = True, math.inf, math.inf
    for _ in range(3):
        start = time.perf_counter()
        whole = whole and read_process(os.getpid(), local, remote) == src.numel()
        middle = time.perf_counter()
        table.run(0, len(starts))
        read, copied = min(read, middle - start), min(copied, time.perf_counter() - middle)
    return whole, read, copied


def direct_read_pays() -> DirectRead:
    """Whether a receiver should read a same-host sender's host memory straight out of it
    (``process_vm_readv``: one copy, by the kernel) rather than take it through shared segments
    (the sender's copy in, this process's copy out, overlapping): for leaves, and for storages.

    ``CUDARECV_DIRECT_READ=on`` or ``=off`` decides both; ``auto`` (the default) measures once per
    process (about 0.1 s), on 16 MiB of torch's memory read from this process itself, in 8 KiB regions
    (leaves) and in one (a storage). On some machines the kernel's read is as fast as a copy (direct
    wins); on others it is slower (the segments win): on this 2-core AMD EPYC VM 3-4x in 8 KiB regions
    and 2x in one, where 2000 x 8 KiB leaves took 6.1 ms through segments and 8.9 ms directly.

    Example:
        >>> direct_read_pays()  # on that VM
        DirectRead(leaves=False, storages=False)
    """
    global DIRECT_PAYS
    choice = direct_read_setting()
    if choice != "auto":
        return DirectRead(choice == "on", choice == "on")
    if DIRECT_PAYS is None:
        # torch's memory, as what is read: numpy's large arrays may sit on huge pages, which the kernel reads
        # 2.4x faster than torch's (256 MiB on this VM: 18.7 vs 45.0 ms)
        src, dst = torch.ones(_DIRECT_PROBE, dtype=torch.uint8), torch.zeros(_DIRECT_PROBE, dtype=torch.uint8)
        pays = [whole and read <= DIRECT_SLACK * copied
                for whole, read, copied in (_read_vs_copy(dst, src, piece) for piece in (_DIRECT_PIECE, _DIRECT_PROBE))]
        DIRECT_PAYS = DirectRead(leaves=pays[0], storages=pays[0] or pays[1])
    return DIRECT_PAYS
