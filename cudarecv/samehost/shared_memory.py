"""Host memory shared by two processes of one machine: anonymous segments, never a name in ``/dev/shm``.

A :class:`Segment` is created by the process that writes it, with
``memfd_create``: an anonymous file with no name in any directory, mode 0600,
mapped read-write by its writer and sealed against shrinking (``F_SEAL_SHRINK``:
a lying writer cannot cut the file under a reader's mapping, whose touch past
its end would be ``SIGBUS``; a reader refuses an unsealed one). The reader opens it through
``/proc/<writer pid>/fd/<fd>``, which the kernel allows only to a process that
may inspect the writer (same user, same PID namespace), maps it *read-only*
(:class:`Mapping`) and checks a 16-byte random nonce the writer put in its first
bytes, which proves it opened the segment it was offered. Once the reader has it
mapped the writer closes its descriptor: from then on nothing names the memory,
which the kernel frees when the last mapping goes, so a process killed with
``SIGKILL`` leaves nothing behind.

Two version stamps in the segment's first bytes make a reader's copy checkable
(a sequence lock): the writer stamps *writing v* before its first byte changes
and *written v* after its last; a reader that copied version v reads *written*
before and *writing* after its copy, and the copy is whole only if both are v.
Two more words say how far a fast-wire transfer's writer got (its number, and
how many of its bytes are in), stored after the bytes they count and loaded
before them (the native build's ordered stores and loads), so a reader can copy
each message as soon as it is written.

A tensor storage that torch already put in shared memory (``share_memory_()``,
``consolidate(share_memory=True)``, a tensor sent through ``torch.multiprocessing``)
is an anonymous file of the same kind, held open by torch: a reader maps it the
same way (:class:`StorageMapping`, read-only, checked by the file's device and
inode instead of a nonce) and copies straight out of the sender's own memory. torch's
files are not sealed: a same-user sender that shrinks its own storage while a reader
copies out of it can still kill that reader with ``SIGBUS`` (the size is checked when
it is mapped, not after).

Example:
    >>> seg = Segment(1 << 20)                       # the writer
    >>> seg.data[:4].copy_(torch.arange(4, dtype=torch.uint8))
    >>> peer = Mapping(os.getpid(), seg.fd, seg.capacity, seg.nonce)  # the reader (another process)
    >>> seg.close_fd()
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import mmap
import os
import struct
import weakref
from typing import NamedTuple

import torch
from torch import Tensor

from ..core.errors import Error
from ..core.host_copy import NATIVE, observe, publish
from ..core.records import Table
from .machine import machine_key

NONCE = 16
WRITING, WRITTEN = (
    16,
    24,
)  # two u64 stamps after the nonce: the version being written, the last one written
# the fast wire's progress words (written with the native build only): the transfer being written, how many
# of its payload bytes are in
PROGRESS_SEQ, PROGRESS_BYTES = 32, 40
DATA_OFFSET = 64  # the nonce and stamps, then the payload from this offset (cache-line aligned)
_STAMP = struct.Struct("<Q")
PAGE = 4096
SEALS = (
    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
)  # a segment's file cannot shrink, nor be sealed otherwise


@functools.cache
def available() -> str | None:
    """Why segments cannot be made here, or None (asked once: every fast-wire receive asks)."""
    if not hasattr(os, "memfd_create"):
        return "this platform has no memfd_create"
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return "/proc is not mounted"
    return None


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23  # Linux 5.14: allocate a range's pages without writing them
_libc.syscall.restype = ctypes.c_long
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # (shared, not private: the word is in memory two processes map)
_ETIMEDOUT = 110


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futexes() -> bool:
    """Whether this machine's futexes are known here (x86-64, aarch64)."""
    return _SYS_FUTEX is not None


def wake(address: int) -> None:
    """Wake whoever sleeps on the 32-bit word at ``address`` (a futex; a no-op for nobody: ~3 us)."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), FUTEX_WAKE, 2**31 - 1, None, None, 0)


def sleep_on(address: int, value: int, timeout: float) -> bool:
    """Sleep in the kernel while the 32-bit word at ``address`` holds ``value``, up to ``timeout`` s; False
    if the time ran out (True: woken, or the word had changed already)."""
    span = _Timespec(int(timeout), int(timeout % 1 * 1e9))
    if (
        _libc.syscall(
            _SYS_FUTEX,
            ctypes.c_void_p(address),
            FUTEX_WAIT,
            ctypes.c_uint32(value),
            ctypes.byref(span),
            None,
            0,
        )
        == 0
    ):
        return True
    return ctypes.get_errno() != _ETIMEDOUT


def _map(fd: int, size: int, writable: bool) -> ctypes.Array:
    """Map ``fd`` shared, as a byte array unmapped when the last reference goes (Python's ``mmap``
    would keep a duplicate of the descriptor open for as long as the mapping lives)."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    ptr = _libc.mmap(None, size, prot, mmap.MAP_SHARED, fd, 0)
    if ptr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap: {os.strerror(ctypes.get_errno())}")
    array = (ctypes.c_uint8 * size).from_address(ptr)
    # not at exit: a thread may still copy out of it then; the process's end unmaps it anyway
    weakref.finalize(array, _libc.munmap, ptr, size).atexit = False
    return array


class Segment:
    """An anonymous shared segment of ``capacity`` payload bytes, mapped read-write by its writer."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.nonce = os.urandom(NONCE)
        size = _round_up(DATA_OFFSET + capacity)
        self.fd: int | None = os.memfd_create("cudarecv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._closer = weakref.finalize(
            self, os.close, self.fd
        )  # (a segment dropped unoffered: a failed send)
        try:
            os.fchmod(self.fd, 0o600)
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self._map = _map(self.fd, size, writable=True)
        except BaseException:
            self.close_fd()
            raise
        ctypes.memmove(self._map, self.nonce, NONCE)
        self._words = ctypes.addressof(
            self._map
        )  # where the progress words are (PROGRESS_SEQ, PROGRESS_BYTES)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        #: the payload bytes, writable
        self.data: Tensor = whole[DATA_OFFSET : DATA_OFFSET + capacity]

    def populate(self) -> None:
        """Allocate every page now, where a first write of each (page faults: about 0.1 s per GB) would fall
        inside a push. With no ``MADV_POPULATE_WRITE`` (older kernels) the payload is zeroed instead."""
        if _libc.madvise(ctypes.addressof(self._map), len(self._map), MADV_POPULATE_WRITE) != 0:
            ctypes.memset(self.data.data_ptr(), 0, self.capacity)

    def begin_write(self, version: int) -> None:
        """Stamp the segment as being overwritten with ``version`` (before the first byte changes)."""
        _STAMP.pack_into(self._map, WRITING, version)

    def end_write(self, version: int) -> None:
        """Stamp ``version`` as wholly written (after the last byte)."""
        _STAMP.pack_into(self._map, WRITTEN, version)

    def start(self, seq: int) -> None:
        """Say that fast-wire transfer ``seq`` is being written, none of its bytes yet (before its header is
        sent; no-op without the native build, whose ordered stores the reader needs)."""
        if NATIVE:
            publish(self._words + PROGRESS_BYTES, 0)
            publish(self._words + PROGRESS_SEQ, seq)

    def advance(self, nbytes: int) -> None:
        """Say that the first ``nbytes`` payload bytes of the transfer are in (after they are), and wake a
        reader that sleeps on the word (:meth:`Mapping.follow`)."""
        if NATIVE:
            publish(self._words + PROGRESS_BYTES, nbytes)
            if _SYS_FUTEX is not None:
                wake(self._words + PROGRESS_BYTES)

    def close_fd(self) -> None:
        """Let go of the descriptor (the reader has it mapped): nothing names the memory any more."""
        if self.fd is not None:
            self._closer()
            self.fd = None


class MappingError(Error, OSError):
    """The reader could not open or check a segment it was offered: for good (``lasting``: another machine or
    user, a lying offer), or for now (descriptors, memory: a later offer may be taken). The link is fine: the
    payload comes on the wire."""

    def __init__(self, text: str, lasting: bool = True) -> None:
        super().__init__(text)
        self.lasting = lasting


#: what a failed open or map of an offered segment may clear up by itself (descriptors, memory)
TRANSIENT = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN)


def _check_sealed(fd: int) -> None:
    """Refuse a segment its writer could still shrink under a mapping (:data:`SEALS`)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memfd, or one made without MFD_ALLOW_SEALING
    if seals & SEALS != SEALS:
        raise MappingError(
            "the peer's segment is not sealed against shrinking (F_SEAL_SHRINK): a sender that "
            "could cut it under this mapping would kill this process with SIGBUS"
        )


class Mapping:
    """The reader's read-only view of another process's :class:`Segment` (``writable``: read-write, for a segment
    both processes write, each its own words: :mod:`cudarecv.samehost.doorbell`)."""

    def __init__(
        self, pid: int, fd: int, capacity: int, nonce: bytes, writable: bool = False
    ) -> None:
        size = _round_up(DATA_OFFSET + capacity)
        try:
            flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
            own = os.open(f"/proc/{pid}/fd/{fd}", flags)
        except OSError as error:
            raise MappingError(
                f"cannot open the peer's segment: {error.strerror}",
                lasting=error.errno not in TRANSIENT,
            ) from None
        try:
            _check_sealed(own)
            if os.fstat(own).st_size < size:
                raise MappingError("the peer's segment is smaller than announced")
            self._map = _map(own, size, writable=writable)
        finally:
            os.close(own)  # the mapping keeps the memory
        if ctypes.string_at(self._map, NONCE) != nonce:
            raise MappingError("the peer's segment does not hold the nonce it announced")
        self._words = ctypes.addressof(
            self._map
        )  # where the progress words are (PROGRESS_SEQ, PROGRESS_BYTES)
        self.pid = pid
        self.capacity = capacity
        whole = torch.frombuffer(
            self._map, dtype=torch.uint8
        )  # read-only pages (unless ``writable``): nothing here writes them
        #: the payload bytes, read-only unless ``writable`` (never write otherwise: the pages are mapped PROT_READ)
        self.data: Tensor = whole[DATA_OFFSET : DATA_OFFSET + capacity]

    def written(self) -> int:
        """The last version the writer stamped as wholly written (read before copying it out)."""
        return _STAMP.unpack_from(self._map, WRITTEN)[0]

    def progress(self, seq: int) -> int | None:
        """How many payload bytes of fast-wire transfer ``seq`` the writer says are in the segment (read them
        after this), or None if it says nothing of that transfer (no native build on either side)."""
        if not NATIVE:
            return None
        if observe(self._words + PROGRESS_SEQ) != seq:
            return None
        return observe(self._words + PROGRESS_BYTES)

    def follow(self, seen: int, timeout: float) -> bool:
        """Sleep until the writer's count of bytes moves from ``seen`` (in the kernel: a futex on its low 32 bits,
        which the writer wakes after each store); False if it stood still for ``timeout`` s (or, on a machine
        without futexes here, at once)."""
        return _SYS_FUTEX is not None and sleep_on(
            self._words + PROGRESS_BYTES, seen & 0xFFFFFFFF, timeout
        )

    def writing(self) -> int:
        """The version the writer is writing or last wrote (read after copying: if it is still the one
        copied, no write overlapped the copy)."""
        return _STAMP.unpack_from(self._map, WRITING)[0]


HOST = 1  # the kind of an offer of host segments (CUDA IPC offers are kind 2: :mod:`cudarecv.samehost.cuda_ipc`)
MAX_SEGMENTS = 1024


def offer_table(name: str, each: str) -> Table:
    """The record of an offer of segments each described by struct ``each``: a version, the offer's kind, this
    process's machine key and pid, the entries (:class:`~cudarecv.core.records.Table`); a malformed one raises
    :class:`MappingError` (the payload comes on the wire)."""
    return Table(
        name,
        b"CDRO",
        "HH32sI",
        each=each,
        most=MAX_SEGMENTS,
        error=MappingError,
        hint="the payload comes on the wire",
    )


HOST_OFFER = offer_table(
    "host-memory offer", "iQ16s"
)  # each host segment: fd, payload bytes, nonce


def seal_offer(table: Table, kind: int, entries: list[tuple]) -> bytes:
    """An offer of ``kind`` (``table``'s): this process's machine key and pid, then one entry per segment."""
    return table.pack(1, kind, machine_key(), os.getpid(), entries=entries)


def offer_kind(raw: bytes) -> int | None:
    """The kind an offer says it is (unchecked: its parser checks it), or None if ``raw`` is too short to say."""
    head = HOST_OFFER.peek(raw)
    return None if head is None else head[1]


def open_offer(
    raw: bytes, table: Table, kind: int, capacity_at: int, problem: str | None, most_bytes: int
) -> tuple[int, list[tuple]]:
    """Check an offer (``table``'s form, checksum, ``kind``, this process's ``problem`` with such segments, the
    machine, field ``capacity_at`` of each entry: the segment's bytes, within ``most_bytes``); return the peer's pid
    and the entries. Raises :class:`MappingError` with the reason this process cannot map them."""
    (version, got, key, pid), entries = table.unpack(raw)
    if version != 1 or got != kind:
        raise MappingError(f"unknown offer (version {version}, kind {got})")
    if not entries:  # (a reader would take it, then have no segment for the first payload)
        raise MappingError("the offer names no segments")
    if problem:
        raise MappingError(problem)
    if key != machine_key():
        raise MappingError("the peer is on another machine, boot, network namespace or user")
    for entry in entries:
        capacity = entry[capacity_at]
        if not 0 < capacity <= most_bytes:
            raise MappingError(
                f"an offered segment of {capacity} bytes is out of range (at most {most_bytes})",
                lasting=capacity <= 0,
            )
    return pid, entries


def offer(segments: list[Segment]) -> bytes:
    """What a reader needs to map ``segments`` (no secret: only a process that may inspect this one
    can open them, and it must read the right nonce in each)."""
    return seal_offer(HOST_OFFER, HOST, [(s.fd, s.capacity, s.nonce) for s in segments])


def map_offer(raw: bytes, most_bytes: int) -> list[Mapping]:
    """Map every segment of an offer read-only; raises :class:`MappingError` with the reason this
    process cannot (another machine or user, a segment larger than ``most_bytes``, ...)."""
    pid, entries = open_offer(raw, HOST_OFFER, HOST, 1, available(), most_bytes)
    return [Mapping(pid, fd, capacity, nonce) for fd, capacity, nonce in entries]


STORAGE_OFFER = offer_table(
    "storage offer", "iQQQQ"
)  # fd, the file's device and inode, its bytes, the payload's offset
STORAGE = 3  # the kind of an offer of a tensor storage in torch's shared memory
STORAGE_OFFER_SIZE = STORAGE_OFFER.size_of(1)


class StorageWhere(NamedTuple):
    """Where the bytes of a tensor in torch's shared memory lie (a row of :data:`STORAGE_OFFER`)."""

    fd: int
    dev: int  #: the file's device and inode: never reused while it lives
    ino: int
    size: int  #: the file's bytes
    offset: int  #: of the tensor's first byte

    @property
    def key(self) -> tuple[int, int, int]:
        """What names the storage's bytes across transfers (its file and offset; not the fd, one per open)."""
        return self.dev, self.ino, self.offset


def shared_storage(tensor: Tensor) -> StorageWhere | None:
    """Where the bytes of host ``tensor`` lie if torch shares its storage by file descriptor (its default
    on Linux); else None.

    Never moves the storage (``_share_fd_cpu_`` would, for one shared by file name)."""
    if tensor.device.type != "cpu":
        return None
    whole = tensor.untyped_storage()
    try:
        fd = whole._get_shared_fd()  # type: ignore[attr-defined]  # (private: missing from torch's stubs)
    except RuntimeError:  # not in shared memory, or shared by file name
        return None
    st = os.fstat(fd)
    return StorageWhere(fd, st.st_dev, st.st_ino, st.st_size, tensor.data_ptr() - whole.data_ptr())


def storage_offer(where: StorageWhere) -> bytes:
    """What a reader needs to map a storage :func:`shared_storage` found."""
    return seal_offer(STORAGE_OFFER, STORAGE, [where])


class StorageMapping:
    """The reader's read-only view of another process's shared storage, from its offset on."""

    def __init__(self, raw: bytes, most_bytes: int) -> None:
        pid, entries = open_offer(raw, STORAGE_OFFER, STORAGE, 3, available(), most_bytes)
        if len(entries) != 1:
            raise MappingError(f"a storage offer names {len(entries)} storages, not one")
        fd, dev, ino, size, offset = entries[0]
        if offset >= size:
            raise MappingError(f"the offered storage starts at byte {offset} of a {size}-byte file")
        try:
            own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            raise MappingError(f"cannot open the peer's storage: {error.strerror}") from None
        try:
            st = os.fstat(own)
            if (st.st_dev, st.st_ino) != (dev, ino) or st.st_size < size:
                raise MappingError("the peer's descriptor is not the storage it announced")
            self._map = _map(own, size, writable=False)
        finally:
            os.close(own)  # the mapping keeps the memory
        self.capacity = size - offset
        #: the storage's bytes from the offset on, read-only (never write: the pages are mapped PROT_READ)
        self.data: Tensor = torch.frombuffer(self._map, dtype=torch.uint8)[offset:]
