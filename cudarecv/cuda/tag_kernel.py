"""CUDA twin of :func:`cudarecv.plan.tags.tag_map` (``kernels/int_generator.cu``).

cupy is imported lazily, inside the functions: importing this module needs
neither cupy nor a GPU. :func:`compile_ptx` only needs NVRTC (no GPU).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.errors import ArgumentError
from . import kernels as _kernels
from .kernels import KernelCompileError, gpu_available

__all__ = [
    "KERNEL_FILE",
    "KernelCompileError",
    "compile_ptx",
    "gpu_available",
    "kernel_source",
    "tag_map_gpu",
    "time_tag_map_gpu",
]

KERNEL_FILE = "int_generator.cu"
_RANGE_KERNEL = "int_generator_range"
_MAP_SIZE = 10_001  # seeds 0..10000
_BLOCK = 256


def kernel_source() -> str:
    """Text of ``int_generator.cu`` (see :func:`cudarecv.cuda.kernels.kernel_source`)."""
    return _kernels.kernel_source(KERNEL_FILE)


def compile_ptx(arch: str | None = None, options: tuple[str, ...] = ()) -> str:
    """Compile the kernel to PTX with NVRTC; no GPU needed (see :func:`cudarecv.cuda.kernels.compile_source`)."""
    return _kernels.compile_source(kernel_source(), KERNEL_FILE, arch, options)


def _range_kernel():
    import cupy

    return _kernels.function(KERNEL_FILE, _RANGE_KERNEL, cupy.cuda.runtime.getDevice())


def _launch(kernel, out) -> None:
    n = out.size
    kernel(((n + _BLOCK - 1) // _BLOCK,), (_BLOCK,), (np.uint32(0), out, np.int32(n)))


#: per device, the non-blocking stream the tag kernel runs on (made once: cupy's memory pool keeps its blocks per
#: stream, so a later map reuses the first one's)
_STREAMS: dict[int, Any] = {}


def _own_stream() -> Any:
    """This device's stream for the tag kernel: a cupy stream created non-blocking, used by nothing else."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = cupy.cuda.Stream(non_blocking=True)
    return stream


def tag_map_gpu() -> np.ndarray:
    """``_int_generator(s)`` for ``s in 0..10000`` computed on the current GPU (int64, on host).

    The kernel and its copy back run on a stream of their own, created non-blocking: neither cupy's default
    (CUDA's legacy default stream, which waits for every blocking stream's work, torch's default stream
    included) nor torch's current stream (where the caller may have queued a training step), so the host waits
    for this kernel alone. It reads nothing the caller writes: no order with the caller's streams is needed.
    """
    import cupy

    stream = _own_stream()
    with stream:
        out = cupy.empty(_MAP_SIZE, dtype=cupy.int64)
        _launch(_range_kernel(), out)
        return cupy.asnumpy(out, stream=stream)  # waits for this stream only


def time_tag_map_gpu(repeats: int = 100) -> float:
    """Microseconds of GPU time per full map launch (cupy events, after one warm-up launch)."""
    import cupy

    if repeats < 1:
        raise ArgumentError(f"repeats must be >= 1, got {repeats}")
    kernel = _range_kernel()
    stream = (
        _own_stream()
    )  # (as tag_map_gpu: no legacy default stream; one stream per device, made once)
    with stream:
        out = cupy.empty(_MAP_SIZE, dtype=cupy.int64)
        _launch(kernel, out)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(repeats):
            _launch(kernel, out)
        end.record(stream)
        end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / repeats
