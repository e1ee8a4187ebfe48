"""Copies between host buffers on one thread: the native copy (``native/host_copy.c``, built at
install where a C compiler is), else ``memmove``.

One thread because torch's ``copy_`` of a megabyte wakes its OpenMP threads, whose spinning starves
the peer process on the same cores. The native copy streams large copies past the caches where that
is faster: on some machines two processes copying at once (the sender into a segment, the receiver
out of it) otherwise share the memory bus at half speed; on others glibc's memcpy is faster at every
size. Nothing is measured in a transfer: ``CUDARECV_HOST_COPY=stream`` or ``=memcpy`` chooses, else
what ``python -m cudarecv tune`` kept for this machine (:mod:`cudarecv.core.tuned`), else glibc's memcpy (which
streams by itself past a threshold it sets from the caches; on this 2-core AMD EPYC VM two processes
copying 100 MB at once took 20 ms each with it, 33 ms streamed). The choice is made once, at the
first large copy, and logged (:data:`STREAMING` says it).

Example:
    >>> a, b = torch.arange(4.0), torch.zeros(4)
    >>> copy_bytes(b, a); b
    tensor([0., 1., 2., 3.])
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from torch import Tensor

from . import tuned as _tuned
from .errors import ArgumentError
from .log import logger

#: the native library's functions this module calls
_SYMBOLS = (
    "cudarecv_copy",
    "cudarecv_copy_many",
    "cudarecv_copy_streaming",
    "cudarecv_publish",
    "cudarecv_observe",
    "cudarecv_bump",
    "cudarecv_swap_if",
)


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    spec = importlib.util.find_spec("cudarecv.core.host_copy_native")
    if spec is None or spec.origin is None:
        return None, "cudarecv was installed without a C compiler: host copies use memmove"
    lib = ctypes.CDLL(spec.origin)
    missing = [name for name in _SYMBOLS if not hasattr(lib, name)]
    if missing:  # (a build older than this source: the package was updated without its build step)
        return None, (
            f"cudarecv's native build lacks {', '.join(missing)}: rebuild it "
            "(pip install -e . or python setup.py build_ext --inplace); host copies use memmove"
        )
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
    lib.cudarecv_bump.argtypes = [ctypes.c_void_p]
    lib.cudarecv_bump.restype = ctypes.c_uint64
    lib.cudarecv_swap_if.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
    lib.cudarecv_swap_if.restype = ctypes.c_uint64
    return lib, None


_LIB, WHY_NOT_NATIVE = _load()
NATIVE = _LIB is not None  # whether the native copies were built


def library() -> ctypes.CDLL | None:
    """The native library (None: not built), for the other native pieces to declare their calls on
    (:mod:`cudarecv.weights.delta`)."""
    return _LIB


def _native() -> ctypes.CDLL:
    """The native library, for the calls that need :data:`NATIVE` (their callers check it first)."""
    if _LIB is None:
        raise RuntimeError(f"cudarecv's native host copies are not built: {WHY_NOT_NATIVE}")
    return _LIB


ENV = "CUDARECV_HOST_COPY"  # "stream", "memcpy", or "auto" (as tuned, else DEFAULT_HOST_COPY; the default)
HOST_COPIES = ("stream", "memcpy")
DEFAULT_HOST_COPY = "memcpy"
STREAM_MIN = 256 * 1024  # below this no copy streams (native/host_copy.c)
#: whether large native copies stream (None until the first large copy chose)
STREAMING: bool | None = None
_choosing = threading.Lock()  # one thread sets a setting (and logs it) at its first use
_said: set[str] = set()  # what the logger was told, once each


def _say(text: str) -> None:
    if text not in _said:
        _said.add(text)
        logger.info(text)


def _setting(env: str, allowed: tuple[str, ...]) -> str:
    """The environment variable ``env``, checked: one of ``allowed`` or ``"auto"`` (unset)."""
    choice = os.environ.get(env, "auto")
    if choice != "auto" and choice not in allowed:
        raise ArgumentError(
            f"the environment variable {env}={choice!r} must be one of auto, {', '.join(allowed)}"
        )
    return choice


def host_copy_setting() -> tuple[str, str]:
    """The host copy in effect, ``"stream"`` or ``"memcpy"``, and why: :data:`ENV`, else ``tune``'s choice,
    else :data:`DEFAULT_HOST_COPY`; a bad value of either raises :class:`ArgumentError`."""
    choice = _setting(ENV, HOST_COPIES)
    if choice != "auto":
        return choice, f"{ENV}={choice}"
    kept = _tuned.tuned("host_copy")
    if kept is None:
        return DEFAULT_HOST_COPY, "the default; `python -m cudarecv tune` measures this machine"
    if kept[0] not in HOST_COPIES:
        raise _tuned.refused(f"host_copy={kept[0]!r} must be one of {', '.join(HOST_COPIES)}")
    return kept


def _choose() -> bool:
    """Set the native copy's streaming as :func:`host_copy_setting` says (once; logged)."""
    global STREAMING
    with _choosing:
        if STREAMING is None:
            choice, why = host_copy_setting()
            on = bool(_native().cudarecv_copy_streaming(choice == "stream"))
            _say(
                f"host copies: {'streaming' if on else 'memcpy'} ({why}"
                f"{'' if on or choice == 'memcpy' else '; this CPU has no AVX2'})"
            )
            STREAMING = on
    return STREAMING


def set_streaming(on: bool) -> bool:
    """Stream large native copies or not, from now on, whatever was chosen (``tune`` measures both);
    returns whether streaming is on (AVX2 only). Needs :data:`NATIVE`."""
    global STREAMING
    with _choosing:
        STREAMING = bool(_native().cudarecv_copy_streaming(int(on)))
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
    _native().cudarecv_publish(address, value)


def observe(address: int) -> int:
    """Load the 8-byte word at ``address``, ordered before every load after it. Needs :data:`NATIVE`."""
    return int(_native().cudarecv_observe(address))


def bump(address: int) -> int:
    """Add one to the 8-byte word at ``address`` atomically (two threads that bump it at once both count), as a
    full barrier: ordered after every store before it and before every load after it; the new value. Needs
    :data:`NATIVE`."""
    return int(_native().cudarecv_bump(address))


def swap_if(address: int, expected: int, desired: int) -> int:
    """Store ``desired`` in the 8-byte word at ``address`` if it holds ``expected`` (atomically); return what it
    held (``expected``: replaced). A full barrier either way: ``swap_if(a, x, x)`` is a load ordered after every
    store before it, so two ends that each store a word and then load the other's never both miss the other's
    store. Needs :data:`NATIVE`."""
    return int(_native().cudarecv_swap_if(address, expected, desired))


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

    The memory must outlive the table and stay where it is (a :class:`~cudarecv.plan.plan.Plan` is rebuilt
    when a leaf's data pointer moves).
    """

    def __init__(self, rows: Sequence[tuple[int, int, int]] | np.ndarray) -> None:
        self._table = np.array(rows, dtype=np.uint64, order="C").reshape(
            -1, 3
        )  # a copy, rows contiguous

    def __len__(self) -> int:
        return len(self._table)

    def reversed(self) -> CopyTable:
        """The same copies the other way (sources and destinations swapped)."""
        return CopyTable(self._table[:, [1, 0, 2]])

    def run(self, start: int, stop: int) -> None:
        """Do the copies of rows ``start`` to ``stop`` (excluded)."""
        if _LIB is not None:
            if STREAMING is None:
                _choose()
            _LIB.cudarecv_copy_many(
                self._table.ctypes.data + start * self._table.strides[0], stop - start
            )
        else:
            for dst, src, n in self._table[start:stop].tolist():
                ctypes.memmove(dst, src, n)


# -- reading another process's memory (Linux cross-memory attach) -------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
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
    assert _readv is not None  # (callers ask first whether process_vm_readv may be used)
    got = 0
    for start in range(0, len(local), IOV_MAX):
        count = min(IOV_MAX, len(local) - start)
        want = int(local[start : start + count, 1].sum())
        n = _readv(
            pid, local.ctypes.data + start * 16, count, remote.ctypes.data + start * 16, count, 0
        )
        if (
            n < 0 and ctypes.get_errno() == 14
        ):  # EFAULT: the first region is not mapped, nothing was read
            break
        if n < 0:
            raise OSError(
                ctypes.get_errno(), f"process_vm_readv: {os.strerror(ctypes.get_errno())}"
            )
        got += n
        if n < want:
            break
    return got


DIRECT_ENV = "CUDARECV_DIRECT_READ"  # "on", "off", or "auto" (as tuned, else DEFAULT_DIRECT_READ; the default)
#: how much slower than one copy a direct read may be and still beat the segments' two copies, which run
#: at once on the two processes' cores (each ~one copy's time) plus filling the pipeline and its messages
DIRECT_SLACK = 1.5


class DirectRead(NamedTuple):
    """Where reading a same-host peer's memory directly beats the shared segments: for many small
    regions (a tensordict's leaves) and for one large region (a consolidated storage)."""

    leaves: bool
    storages: bool

    def describe(self) -> str:
        """``"leaves on, storages off"``..."""
        return (
            f"leaves {'on' if self.leaves else 'off'}, storages {'on' if self.storages else 'off'}"
        )


DEFAULT_DIRECT_READ = DirectRead(leaves=False, storages=False)
#: what reading a peer's memory directly beats as tuned or by default (None until first asked with ``auto``)
DIRECT_PAYS: DirectRead | None = None


def direct_read_setting() -> str:
    """``CUDARECV_DIRECT_READ``, checked: ``"auto"`` (unset), ``"on"`` or ``"off"``. Checks the other host
    settings too (``CUDARECV_HOST_COPY``, the ``tune`` file), so that a bad one is refused before a
    transfer sends anything rather than at its first large copy."""
    choice = _setting(DIRECT_ENV, ("on", "off"))
    host_copy_setting()
    if choice == "auto" and DIRECT_PAYS is None:
        direct_read_choice()
    return choice


def direct_read_choice() -> tuple[DirectRead, str]:
    """What reading a same-host peer's memory directly is for, and why: ``CUDARECV_DIRECT_READ``, else
    ``tune``'s choice, else :data:`DEFAULT_DIRECT_READ`; a bad value of either raises :class:`ArgumentError`."""
    choice = _setting(DIRECT_ENV, ("on", "off"))
    if choice != "auto":
        return DirectRead(choice == "on", choice == "on"), f"{DIRECT_ENV}={choice}"
    kept = _tuned.tuned("direct_read")
    if kept is None:
        return DEFAULT_DIRECT_READ, "the default; `python -m cudarecv tune` measures this machine"
    value, why = kept
    if not (
        isinstance(value, dict)
        and set(value) == set(DirectRead._fields)
        and all(isinstance(v, bool) for v in value.values())
    ):
        raise _tuned.refused(f'direct_read={value!r} must be {{"leaves": bool, "storages": bool}}')
    return DirectRead(**value), why


def direct_read_pays() -> DirectRead:
    """Whether a receiver should read a same-host sender's host memory straight out of it
    (``process_vm_readv``: one copy, by the kernel) rather than take it through shared segments
    (the sender's copy in, this process's copy out, overlapping): for leaves, and for storages.

    ``CUDARECV_DIRECT_READ=on`` or ``=off`` decides both; ``auto`` (the default) takes what
    ``python -m cudarecv tune`` measured on this machine, else :data:`DEFAULT_DIRECT_READ`: the
    segments, whose cost is two overlapping copies wherever the kernel's read is slow (on this 2-core
    AMD EPYC VM 3-4x a copy in 8 KiB regions, 2x in one: 2000 x 8 KiB leaves took 6.1 ms through
    segments, 8.9 ms directly; where it is as fast as a copy, ``tune`` turns it on). Nothing is
    measured here; the choice is logged once.

    Example:
        >>> direct_read_pays()  # untuned, or tuned on that VM
        DirectRead(leaves=False, storages=False)
    """
    global DIRECT_PAYS
    if (
        direct_read_setting() != "auto"
    ):  # (the environment may change between transfers: read each time)
        pays, why = direct_read_choice()
        _say(f"direct reads of same-host peers: {pays.describe()} ({why})")
        return pays
    with _choosing:
        if DIRECT_PAYS is None:
            DIRECT_PAYS, why = direct_read_choice()
            _say(f"direct reads of same-host peers: {DIRECT_PAYS.describe()} ({why})")
    return DIRECT_PAYS
