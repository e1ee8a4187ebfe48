"""BLAKE3-128 of a storage's bytes, computed where they are: what ``verify=True`` checks.

BLAKE3 (a cryptographic hash) detects any corruption, every single-bit flip
included, short of a deliberate forgery. Host memory (CPU or pinned) is hashed
by the ``blake3`` package (SIMD, several threads for large storages); device
memory by ``kernels/blake3.cu`` on the caller's current stream (cupy launches it;
without cupy the bytes are hashed from a host copy). Both give the standard
BLAKE3 digest, truncated to 16 bytes.

Example:
    >>> digest(torch.zeros(0, dtype=torch.uint8)).hex()  # BLAKE3("")[:16]
    'af1349b9f5f9a1a6a0404dea36dcc949'
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3
import numpy as np
import torch
from torch import Tensor

from ..core.errors import ArgumentError
from . import kernels as _kernels

DIGEST_BYTES = 16
KERNEL_FILE = "blake3.cu"
_CHUNK = 1024
_BLOCK = 128
_THREADED_FROM = 1 << 20  # below this, one thread hashes faster than several


def digest(storage: Tensor) -> bytes:
    """The 16-byte BLAKE3 digest of ``storage`` (a contiguous uint8 tensor) on its own device."""
    if storage.dtype != torch.uint8 or storage.dim() != 1 or not storage.is_contiguous():
        raise ArgumentError(
            f"digest() takes a contiguous 1-d uint8 tensor, got {storage.dtype} {list(storage.shape)}"
        )
    if storage.device.type == "cuda":
        if _kernels.gpu_available() and storage.data_ptr() % 4 == 0:
            return _digest_on_device(storage)
        storage = storage.cpu()  # no cupy here: hash a host copy
    data = storage.numpy()
    threads = blake3.blake3.AUTO if data.size >= _THREADED_FROM else 1
    return blake3.blake3(data.data, max_threads=threads).digest(DIGEST_BYTES)


def digest_parts(parts: Sequence[Tensor]) -> bytes:
    """The digest of a message list (1-d uint8 tensors on one device, wherever each lies): one message's own
    digest, else the digest of the messages' digests in order (each hashed where it lies: nothing gathered)."""
    if any(p.dtype != torch.uint8 or p.dim() != 1 for p in parts):
        raise ArgumentError("digest_parts() takes 1-d uint8 tensors")
    if len(parts) == 1:
        return digest(parts[0].contiguous())
    return blake3.blake3(b"".join(digest(p.contiguous()) for p in parts)).digest(DIGEST_BYTES)


def _digest_on_device(storage: Tensor) -> bytes:
    import cupy

    device = (
        storage.device.index if storage.device.index is not None else torch.cuda.current_device()
    )
    chunks_kernel = _kernels.function(KERNEL_FILE, "blake3_chunks", device)
    parents_kernel = _kernels.function(KERNEL_FILE, "blake3_parents", device)
    n = storage.numel()
    chunks = max(1, -(-n // _CHUNK))
    stream = torch.cuda.current_stream(storage.device)
    # the chaining values of two tree levels and the root, on the caller's stream
    level = torch.empty(8 * chunks, dtype=torch.int32, device=storage.device)
    above = torch.empty(8 * ((chunks + 1) // 2), dtype=torch.int32, device=storage.device)
    root = torch.zeros(4, dtype=torch.int32, device=storage.device)
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream.cuda_stream):
        data, cvs, up, out = (cupy.asarray(t) for t in (storage, level, above, root))
        chunks_kernel(
            (-(-chunks // _BLOCK),), (_BLOCK,), (data, np.uint64(n), np.uint64(chunks), cvs, out)
        )
        count = chunks
        while count > 1:
            parents = (count + 1) // 2
            parents_kernel((-(-parents // _BLOCK),), (_BLOCK,), (cvs, np.uint64(count), up, out))
            cvs, up, count = up, cvs, parents
    return root.cpu().numpy().tobytes()  # waits for the caller's stream
