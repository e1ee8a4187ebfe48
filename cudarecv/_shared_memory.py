"""Host memory shared by two processes of one machine: anonymous segments, never a name in ``/dev/shm``.

A :class:`Segment` is created by the process that writes it, with
``memfd_create``: an anonymous file with no name in any directory, mode 0600,
mapped read-write by its writer. The reader opens it through
``/proc/<writer pid>/fd/<fd>``, which the kernel allows only to a process that
may inspect the writer (same user, same PID namespace), maps it *read-only*
(:class:`Mapping`) and checks a 16-byte random nonce the writer put in its first
bytes, which proves it opened the segment it was offered. Once the reader has it
mapped the writer closes its descriptor: from then on nothing names the memory,
which the kernel frees when the last mapping goes, so a process killed with
``SIGKILL`` leaves nothing behind.

Example:
    >>> seg = Segment(1 << 20)                       # the writer
    >>> seg.data[:4].copy_(torch.arange(4, dtype=torch.uint8))
    >>> peer = Mapping(os.getpid(), seg.fd, seg.capacity, seg.nonce)  # the reader (another process)
    >>> seg.close_fd()
"""

from __future__ import annotations

import hashlib
import mmap
import os
import warnings

import torch
from torch import Tensor

NONCE = 16
DATA_OFFSET = 64  # the nonce, then the payload from this offset (cache-line aligned)
PAGE = 4096


def machine_key() -> bytes:
    """32 bytes naming this machine's boot, network host and user: two processes can share
    memory only if they agree (and the reader can then open what the writer made)."""
    from ._weights_wire import host_id

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{boot}|{host_id()}|{os.getuid()}".encode()).digest()


def available() -> str | None:
    """Why segments cannot be made here, or None."""
    if not hasattr(os, "memfd_create"):
        return "this platform has no memfd_create"
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return "/proc is not mounted"
    return None


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


class Segment:
    """An anonymous shared segment of ``capacity`` payload bytes, mapped read-write by its writer."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.nonce = os.urandom(NONCE)
        size = _round_up(DATA_OFFSET + capacity)
        self.fd: int | None = os.memfd_create("cudarecv", os.MFD_CLOEXEC)
        try:
            os.fchmod(self.fd, 0o600)
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            self.close_fd()
            raise
        self._map[:NONCE] = self.nonce
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        #: the payload bytes, writable
        self.data: Tensor = whole[DATA_OFFSET:DATA_OFFSET + capacity]

    def close_fd(self) -> None:
        """Let go of the descriptor (the reader has it mapped): nothing names the memory any more."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class MappingError(OSError):
    """The reader could not open or check a segment it was offered."""


class Mapping:
    """The reader's read-only view of another process's :class:`Segment`."""

    def __init__(self, pid: int, fd: int, capacity: int, nonce: bytes) -> None:
        size = _round_up(DATA_OFFSET + capacity)
        try:
            own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            raise MappingError(f"cannot open the peer's segment: {error.strerror}") from None
        try:
            if os.fstat(own).st_size < size:
                raise MappingError("the peer's segment is smaller than announced")
            self._map = mmap.mmap(own, size, prot=mmap.PROT_READ)
        finally:
            os.close(own)  # the mapping keeps the memory
        if self._map[:NONCE] != nonce:
            raise MappingError("the peer's segment does not hold the nonce it announced")
        self.capacity = capacity
        with warnings.catch_warnings():  # read-only memory: nothing here ever writes it
            warnings.simplefilter("ignore")
            whole = torch.frombuffer(self._map, dtype=torch.uint8)
        #: the payload bytes, read-only (never write: the pages are mapped PROT_READ)
        self.data: Tensor = whole[DATA_OFFSET:DATA_OFFSET + capacity]
