"""cudarecv's CUDA sources (``cudarecv/kernels/*.cu``): read, compiled with NVRTC, loaded with cupy.

cupy is imported inside the functions: importing this module needs neither
cupy nor a GPU, and :func:`compile_source` needs NVRTC only (no GPU).
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any

from ..core.errors import KernelCompileError, UsageError


def kernel_source(name: str) -> str:
    """Text of ``cudarecv/kernels/<name>`` (package data)."""
    from importlib.resources import files

    try:
        return files("cudarecv.kernels").joinpath(name).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(
            f"cannot read the CUDA source cudarecv/kernels/{name}: reinstall cudarecv "
            f"(pip install -e .)"
        ) from exc


def compile_source(
    source: str, name: str, arch: str | None = None, options: tuple[str, ...] = ()
) -> str:
    """Compile CUDA ``source`` to PTX with NVRTC (via ``cupy.cuda.nvrtc``); no GPU needed.

    ``arch`` is e.g. ``"compute_90"`` (default: NVRTC's own). Raises
    :class:`KernelCompileError` with the NVRTC log when compilation fails.

    Example:
        >>> ptx = compile_source(kernel_source("blake3.cu"), "blake3.cu", arch="compute_90")
    """
    try:
        from cupy.cuda import nvrtc
    except ImportError as exc:
        raise UsageError(
            f"compiling {name} needs cupy with NVRTC: pip install 'cudarecv[gpu]' ({exc})"
        ) from exc

    opts = tuple(options) + ((f"-arch={arch}",) if arch else ())
    prog = nvrtc.createProgram(source, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as exc:
            try:
                log = nvrtc.getProgramLog(prog)
            except Exception:  # pragma: no cover - log unavailable
                log = "<no NVRTC log>"
            raise KernelCompileError(
                f"NVRTC failed to compile {name} with options {list(opts)}: {exc}\n{log}"
            ) from exc
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if isinstance(ptx, bytes):
        ptx = ptx.decode("utf-8")
    return ptx.rstrip("\x00")


#: the oldest GPU architecture cudarecv's kernels are compiled for (Volta); NVRTC 13 starts at 75 (Turing)
OLDEST_ARCH = 70


def oldest_arch() -> str:
    """The oldest virtual architecture this NVRTC compiles for, from :data:`OLDEST_ARCH` on.

    CUDA 13 dropped ``compute_70``, so a fixed ``-arch=compute_70`` fails there; this asks NVRTC.

    Example:
        >>> compile_source(kernel_source("blake3.cu"), "blake3.cu", arch=oldest_arch())  # compute_70 on 12.x
    """
    try:
        from cupy.cuda import nvrtc
    except ImportError as exc:
        raise UsageError(
            f"asking NVRTC for its architectures needs cupy: pip install 'cudarecv[gpu]' ({exc})"
        ) from exc
    archs = sorted(int(a) for a in nvrtc.getSupportedArchs() if int(a) >= OLDEST_ARCH)
    if not archs:
        raise KernelCompileError(
            f"this NVRTC ({nvrtc.getVersion()}) compiles for no architecture from "
            f"compute_{OLDEST_ARCH} on: {nvrtc.getSupportedArchs()}"
        )
    return f"compute_{archs[0]}"


def gpu_available() -> bool:
    """True when cupy imports and sees at least one CUDA device; never raises."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


#: the modules compiled and loaded so far, per ``(source name, device)``: each is built once (tests read it)
loaded: collections.Counter[tuple[str, int]] = collections.Counter()
_modules: dict[tuple[str, int], Any] = {}
_loading = threading.Lock()


def module(name: str, device: int) -> Any:
    """``kernels/<name>`` compiled (NVRTC, through cupy, which keeps the binary in its on-disk cache) and loaded on
    ``device``, once per process (threads that ask at once wait for the first): every kernel of the source
    comes from this one module."""
    import cupy

    with _loading:
        built = _modules.get((name, device))
        if built is None:
            with cupy.cuda.Device(device):
                built = cupy.RawModule(code=kernel_source(name), backend="nvrtc")
                built.compile()  # (cupy compiles lazily, at the first get_function: here, now)
            _modules[(name, device)] = built
            loaded[(name, device)] += 1
        return built


@functools.cache
def function(name: str, kernel: str, device: int) -> Any:
    """The cupy function ``kernel`` of ``kernels/<name>``, compiled and loaded once per device."""
    import cupy

    with cupy.cuda.Device(device):
        return module(name, device).get_function(kernel)
