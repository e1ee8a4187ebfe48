"""CUDA twin of :func:`cudarecv._tags.tag_map` (``kernels/int_generator.cu``).

cupy is imported lazily, inside the functions: importing this module needs
neither cupy nor a GPU. :func:`compile_ptx` only needs NVRTC (no GPU).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

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


class KernelCompileError(RuntimeError):
    """NVRTC rejected the kernel source; the message carries the NVRTC log."""


def kernel_source() -> str:
    """Text of ``int_generator.cu``: package data if installed, else the repo's ``kernels/``."""
    try:
        from importlib.resources import files

        return files("cudarecv.kernels").joinpath(KERNEL_FILE).read_text(encoding="utf-8")
    except (ImportError, OSError, TypeError, ValueError):
        pass
    path = Path(__file__).resolve().parents[1] / "kernels" / KERNEL_FILE
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FileNotFoundError(
            f"cannot find the CUDA source {KERNEL_FILE}: neither package data of cudarecv.kernels "
            f"nor {path}; reinstall cudarecv (pip install -e .)"
        ) from exc


def compile_ptx(arch: str | None = None, options: tuple[str, ...] = ()) -> str:
    """Compile the kernel to PTX with NVRTC (via ``cupy.cuda.nvrtc``); no GPU needed.

    ``arch`` is e.g. ``"compute_90"`` (default: NVRTC's own default). Raises
    :class:`KernelCompileError` with the NVRTC log when compilation fails.
    """
    try:
        from cupy.cuda import nvrtc
    except ImportError as exc:
        raise ImportError(
            f"compile_ptx needs cupy with NVRTC: pip install 'cudarecv[gpu]' ({exc})"
        ) from exc

    opts = tuple(options) + ((f"-arch={arch}",) if arch else ())
    prog = nvrtc.createProgram(kernel_source(), KERNEL_FILE, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as exc:
            try:
                log = nvrtc.getProgramLog(prog)
            except Exception:  # pragma: no cover - log unavailable
                log = "<no NVRTC log>"
            raise KernelCompileError(
                f"NVRTC failed to compile {KERNEL_FILE} with options {list(opts)}: {exc}\n{log}"
            ) from exc
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(ptx, bytes):
        ptx = ptx.decode("utf-8")
    return ptx.rstrip("\x00")


def gpu_available() -> bool:
    """True when cupy imports and sees at least one CUDA device; never raises."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def _range_kernel():
    import cupy

    module = cupy.RawModule(code=kernel_source(), backend="nvrtc")
    return module.get_function(_RANGE_KERNEL)


def _launch(kernel, out) -> None:
    n = out.size
    kernel(((n + _BLOCK - 1) // _BLOCK,), (_BLOCK,), (np.uint32(0), out, np.int32(n)))


def tag_map_gpu() -> np.ndarray:
    """``_int_generator(s)`` for ``s in 0..10000`` computed on the current GPU (int64, on host)."""
    import cupy

    out = cupy.empty(_MAP_SIZE, dtype=cupy.int64)
    _launch(_range_kernel(), out)
    return cupy.asnumpy(out)


def time_tag_map_gpu(repeats: int = 100) -> float:
    """Microseconds of GPU time per full map launch (cupy events, after one warm-up launch)."""
    import cupy

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    kernel = _range_kernel()
    out = cupy.empty(_MAP_SIZE, dtype=cupy.int64)
    _launch(kernel, out)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        _launch(kernel, out)
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / repeats
