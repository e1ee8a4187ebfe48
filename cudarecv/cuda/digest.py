"""BLAKE3-128 of a storage's bytes, computed where they are: what ``verify=True`` checks.

BLAKE3 (a cryptographic hash) detects any corruption, every single-bit flip
included, short of a deliberate forgery. Host memory (CPU or pinned) is hashed
by the ``blake3`` package (SIMD, several threads for large storages); device
memory by ``kernels/blake3.cu`` on the caller's current stream (cupy launches it;
without cupy the bytes are hashed from a host copy). Both give the standard
BLAKE3 digest, truncated to 16 bytes.

On the device, a message's digest is 16 bytes of a result vector (one slot per
message); the host reads the whole vector back once, after an event
(:func:`digest_parts_pending`: a pull yields that event, bounded by its deadline,
instead of waiting per message). The kernels keep one chaining value per 128 KiB
between launches, at most 32768 (:func:`workspace_bytes`: 1.5 MiB at most, whatever
the size of the bytes hashed). :func:`prepare` compiles and loads the kernels ahead
(a receiver's or sender's construction), so that no pull's deadline pays NVRTC.

Example:
    >>> digest(torch.zeros(0, dtype=torch.uint8)).hex()  # BLAKE3("")[:16]
    'af1349b9f5f9a1a6a0404dea36dcc949'
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import blake3
import numpy as np
import torch
from torch import Tensor

from ..core import streams
from ..core.errors import ArgumentError
from ..core.log import logger
from ..core.protocol import Work
from . import kernels as _kernels

DIGEST_BYTES = 16
KERNEL_FILE = "blake3.cu"
KERNELS = ("blake3_blocks", "blake3_parents")
#: the most threads (runs of chunks) a storage is hashed by: past 4 GiB a thread hashes several chunks, so the
#: blocks' chaining values kept between launches are at most ``MAX_RUNS / 128`` (1.5 MiB with two levels)
MAX_RUNS = 1 << 22
_CHUNK = 1024
_CV_BYTES = 32
_BLOCK = 128  # threads per block (BLAKE3_THREADS in blake3.cu)
_THREADED_FROM = 1 << 20  # below this, one thread hashes faster than several


def plan(n: int, max_runs: int = MAX_RUNS) -> tuple[int, int, int]:
    """``(chunks, per, blocks)`` for ``n`` bytes: its 1024-byte chunks, hashed in runs of ``per`` (the least
    power of two that leaves at most ``max_runs`` runs), a thread a run, 128 runs a block."""
    if n < 0 or max_runs < 1:
        raise ArgumentError(f"plan() takes n >= 0 and max_runs >= 1, got {n}, {max_runs}")
    chunks = max(1, -(-n // _CHUNK))
    per = 1
    while -(-chunks // per) > max_runs:
        per *= 2
    runs = -(-chunks // per)
    return chunks, per, -(-runs // _BLOCK)


def workspace_bytes(n: int, max_runs: int = MAX_RUNS) -> int:
    """Bytes of device memory the kernels take besides the 16-byte result to hash ``n`` bytes: two levels of the
    blocks' chaining values (none for a single block, which writes the root); at most ``48 * max_runs / 128``
    (1.5 MiB), 48 bytes per 128 KiB below that."""
    blocks = plan(n, max_runs)[2]
    return 0 if blocks == 1 else _CV_BYTES * (blocks + (blocks + 1) // 2)


def prepare(device: torch.device | str | int | None) -> bool:
    """Compile and load the digest kernels for ``device`` now (once per process and device), where its pulls
    would hash on it: a CUDA device, with cupy and a GPU. Returns whether they are ready there (a failure is
    logged, not raised: it is raised by the first digest that needs them, if any does)."""
    device = (
        torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cpu")
    )
    if device.type != "cuda" or not _kernels.gpu_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        for kernel in KERNELS:
            _kernels.function(KERNEL_FILE, kernel, index)
    except Exception as error:  # noqa: BLE001 - a version that asks for a digest raises it then
        logger.warning(
            "the BLAKE3 kernels could not be built for cuda:%d (%s): a digest (verify=True) hashed there will fail",
            index,
            error,
        )
        return False
    return True


class _Done:
    """A work that is done: what a digest computed on the host yields."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


class Pending:
    """A digest under way: ``work`` (yield it, or wait for it) is done once :meth:`value` can be read without
    waiting; the device's results come back to the host in one copy, after one event."""

    def __init__(
        self, digests: list[bytes | None], results: Tensor | None, event: torch.cuda.Event | None
    ) -> None:
        self._digests, self._results, self._event = digests, results, event
        self.work: Work = _Done() if event is None else streams.EventWork(event)

    def value(self) -> bytes:
        """The digest: one message's own, else the digest of the messages' digests in order (waits for ``work``
        if it was not waited for)."""
        if self._event is not None:
            self._event.synchronize()
        if self._results is not None:
            words = iter(self._results.numpy().reshape(-1, 4))
            digests = [d if d is not None else next(words).tobytes() for d in self._digests]
        else:
            digests = [d for d in self._digests if d is not None]
        if len(digests) == 1:
            return digests[0]
        return blake3.blake3(b"".join(digests)).digest(DIGEST_BYTES)


def _check(storage: Tensor, what: str) -> None:
    if storage.dtype != torch.uint8 or storage.dim() != 1 or not storage.is_contiguous():
        raise ArgumentError(
            f"{what} takes a contiguous 1-d uint8 tensor, got {storage.dtype} {list(storage.shape)}"
        )


def _on_device(storage: Tensor, gpu: bool) -> bool:
    """Whether ``storage`` is hashed by the kernels (``gpu``: cupy sees a GPU)."""
    return gpu and storage.device.type == "cuda" and storage.data_ptr() % 4 == 0


def _host_digest(storage: Tensor) -> bytes:
    if storage.device.type == "cuda":
        storage = storage.cpu()  # no cupy here: hash a host copy
    data = storage.numpy()
    threads = blake3.blake3.AUTO if data.size >= _THREADED_FROM else 1
    return blake3.blake3(data.data, max_threads=threads).digest(DIGEST_BYTES)


def digest_parts_pending(parts: Sequence[Tensor]) -> Pending:
    """Start the digest of a message list (contiguous 1-d uint8 tensors, wherever each lies; device ones on the
    caller's current stream): messages in host memory are hashed now, those on the device each into a slot of
    one result vector, copied back to page-locked memory at once. Nothing here waits for the device."""
    for part in parts:
        _check(part, "digest_parts()")
    gpu = any(p.device.type == "cuda" for p in parts) and _kernels.gpu_available()
    device = [p for p in parts if _on_device(p, gpu)]
    digests: list[bytes | None] = [None if _on_device(p, gpu) else _host_digest(p) for p in parts]
    if not device:
        return Pending(digests, None, None)
    at = device[0].device
    if any(p.device != at for p in device):
        raise ArgumentError(
            f"digest_parts() takes the messages of one device, got {sorted({str(p.device) for p in device})}"
        )
    stream = torch.cuda.current_stream(at)
    results = torch.empty(4 * len(device), dtype=torch.int32, device=at)
    _launch_all(device, results, stream)
    host = torch.empty(4 * len(device), dtype=torch.int32, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(results, non_blocking=True)
        done = streams.record(stream)
    return Pending(digests, host, done)


def _launch_all(parts: Sequence[Tensor], results: Tensor, stream: torch.cuda.Stream) -> None:
    """Queue the kernels of every message in ``parts`` on ``stream``, message i's digest into
    ``results[4 i : 4 i + 4]``; their chaining values in one workspace, reused message after message."""
    import cupy

    at = results.device
    index = at.index if at.index is not None else torch.cuda.current_device()
    blocks_kernel = _kernels.function(KERNEL_FILE, "blake3_blocks", index)
    parents_kernel = _kernels.function(KERNEL_FILE, "blake3_parents", index)
    plans = [plan(p.numel(), MAX_RUNS) for p in parts]
    most = max(blocks for _, _, blocks in plans)
    # (allocated on the stream the kernels run on: the caching allocator orders its reuse after them)
    with torch.cuda.stream(stream):
        level = torch.empty(8 * most if most > 1 else 1, dtype=torch.int32, device=at)
        above = torch.empty(8 * ((most + 1) // 2), dtype=torch.int32, device=at)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream):
        cvs0, up0, out = (cupy.asarray(t) for t in (level, above, results))
        for i, (part, (chunks, per, blocks)) in enumerate(zip(parts, plans)):
            root = out[4 * i : 4 * i + 4]
            data = cupy.asarray(part) if part.numel() else cupy.zeros(4, dtype=cupy.uint8)
            blocks_kernel(
                (blocks,),
                (_BLOCK,),
                (data, np.uint64(part.numel()), np.uint64(chunks), np.uint64(per), cvs0, root),
            )
            cvs, up, count = cvs0, up0, blocks
            while count > 1:
                parents = (count + 1) // 2
                parents_kernel(
                    (-(-parents // _BLOCK),), (_BLOCK,), (cvs, np.uint64(count), up, root)
                )
                cvs, up, count = up, cvs, parents


def digest_pending(storage: Tensor) -> Pending:
    """:func:`digest_parts_pending` of one storage: its own digest."""
    _check(storage, "digest()")
    return digest_parts_pending([storage])


def digest(storage: Tensor) -> bytes:
    """The 16-byte BLAKE3 digest of ``storage`` (a contiguous uint8 tensor) on its own device (the host waits
    for the device's result)."""
    return digest_pending(storage).value()


def digest_parts(parts: Sequence[Tensor]) -> bytes:
    """The digest of a message list (1-d uint8 tensors on one device, wherever each lies): one message's own
    digest, else the digest of the messages' digests in order (each hashed where it lies: nothing gathered; the
    host waits once, for all of them)."""
    if any(p.dtype != torch.uint8 or p.dim() != 1 for p in parts):
        raise ArgumentError("digest_parts() takes 1-d uint8 tensors")
    return digest_parts_pending([p.contiguous() for p in parts]).value()
