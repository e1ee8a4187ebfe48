"""GPU gating for tests and benchmarks: NCCL ranks on however many GPUs this machine has, and why not.

:func:`nccl_ranks` starts ``world`` NCCL ranks in one of three modes (:func:`nccl_mode`):

- ``"per_gpu"``: at least ``world`` GPUs: rank ``r`` on GPU ``r``, NCCL as it comes.
- ``"multi_rank"``: fewer GPUs, and the NCCL loaded here is >= 2.30: ranks share GPUs
  (rank ``r`` on GPU ``r % count``) with ``NCCL_MULTI_RANK_GPU_ENABLE=1``, NCCL's own way
  (its intra-node transports, fast).
- ``"hostid"``: fewer GPUs and an older NCCL (2.28 on the lent one-GPU machines), or NCCL's
  version unknown: NCCL refuses two ranks on one device ("Duplicate GPU detected": same host
  hash and bus id), but the host hash comes from ``NCCL_HOSTID`` when set, so each rank gets its
  own (``cudarecv-rank-<r>``) and NCCL takes the ranks for separate nodes, which talk over its
  socket transport on loopback (:data:`HOSTID_ENV`). Slow (the ranks share the GPU and every
  byte goes through host sockets) but every NCCL code path cudarecv has runs on one GPU.

``CUDARECV_NCCL_MODE`` (``per_gpu``, ``multi_rank`` or ``hostid``) forces a mode, e.g.
``hostid`` on a machine with many GPUs.

NCCL's version is the one of the library loaded (:func:`nccl_runtime_version`, ``ncclGetVersion``
through ctypes), not ``torch.cuda.nccl.version()`` (the one torch was built with).

Example:
    >>> problem = nccl_ranks_problem(2)
    >>> if problem: pytest.skip(problem)
    >>> ranks = nccl_ranks(2, pg_timeout=60.0)
    >>> ranks().run(fn)
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from collections.abc import Mapping
from typing import Any, Literal

import torch

from cudarecv.testing.launch import Ranks

NCCL_SHARED_MIN = (2, 30)  # NCCL that lets ranks share a GPU (NCCL_MULTI_RANK_GPU_ENABLE=1)
MODE_ENV = "CUDARECV_NCCL_MODE"  # forces a mode of nccl_ranks
#: every rank's environment in ``hostid`` mode: the socket transport over loopback, nothing else
HOSTID_ENV: Mapping[str, str] = {
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_MNNVL_ENABLE": "0",
    "NCCL_NET": "Socket",
}
MULTI_RANK_ENV: Mapping[str, str] = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}

Mode = Literal["per_gpu", "multi_rank", "hostid"]
MODES: tuple[Mode, ...] = ("per_gpu", "multi_rank", "hostid")


# --------------------------------------------------------------------------- NCCL's version


def decode_nccl_version(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s code as (major, minor, patch): ``major*10000 + minor*100 + patch``
    since NCCL 2.9, ``major*1000 + minor*100 + patch`` before (2.8.4 is 2804).

    Raises:
        ValueError: ``code`` is not a positive int.
    """
    if not isinstance(code, int) or code <= 0:
        raise ValueError(f"code must be a positive NCCL version code, got {code!r}")
    if code >= 10000:
        return (code // 10000, code // 100 % 100, code % 100)
    return (code // 1000, code // 100 % 10, code % 100)


def nccl_library_paths() -> list[str]:
    """Where the NCCL this process uses may be: already mapped (torch loads it with its CUDA
    libraries), then the nvidia-nccl wheel's copy on ``sys.path``; the loader's search comes last."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:  # address perms offset dev inode [path]
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if "/libnccl.so" in path and path not in found:
                    found.append(path)
    except OSError:
        pass
    for entry in sys.path:
        for pattern in ("nvidia/nccl/lib/libnccl.so*", "nvidia/*/lib/libnccl.so*"):
            for path in sorted(glob.glob(os.path.join(entry or ".", pattern))):
                if path not in found:
                    found.append(path)
    return found


def nccl_runtime_version() -> tuple[int, int, int] | None:
    """The version of the NCCL library loaded here (or that torch would load), from
    ``ncclGetVersion`` through ctypes; None where there is none (a CPU build of torch)."""
    for name in [*nccl_library_paths(), "libnccl.so.2"]:
        try:
            lib = ctypes.CDLL(name)
            get = lib.ncclGetVersion
        except (OSError, AttributeError):
            continue
        get.argtypes = [ctypes.POINTER(ctypes.c_int)]
        get.restype = ctypes.c_int
        code = ctypes.c_int(0)
        if get(ctypes.byref(code)) != 0 or code.value <= 0:  # ncclSuccess is 0
            continue
        return decode_nccl_version(code.value)
    return None


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL version torch was built with (``torch.cuda.nccl.version()``), or None without NCCL.
    Not the library loaded: see :func:`nccl_runtime_version`."""
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - no NCCL in this torch build
        return None
    if isinstance(version, int):  # old torch: NCCL_VERSION_CODE
        return decode_nccl_version(version)
    return tuple(int(v) for v in version)


# --------------------------------------------------------------------------- modes


def nccl_mode(
    world: int,
    gpus: int,
    version: tuple[int, ...] | None,
    forced: str | None = None,
) -> Mode:
    """How ``world`` NCCL ranks run on ``gpus`` GPUs with NCCL ``version`` (None: unknown);
    ``forced`` (one of :data:`MODES`, or ``None``/``""``) overrides the choice.

    Raises:
        ValueError: ``world`` < 1, or ``forced`` is not a mode.
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if forced:
        for mode in MODES:
            if forced == mode:
                return mode
        raise ValueError(f"{MODE_ENV} (forced) must be one of {MODES}, got {forced!r}")
    if gpus >= world:
        return "per_gpu"
    if version is not None and tuple(version[:2]) >= NCCL_SHARED_MIN:
        return "multi_rank"
    return "hostid"


def nccl_rank_env(mode: Mode, rank: int) -> dict[str, str]:
    """The environment a rank of ``mode`` gets beyond its parent's (see the module's docstring)."""
    if mode == "hostid":
        return {**HOSTID_ENV, "NCCL_HOSTID": f"cudarecv-rank-{rank}"}
    if mode == "multi_rank":
        return dict(MULTI_RANK_ENV)
    if mode == "per_gpu":
        return {}
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def current_nccl_mode(world: int) -> Mode:
    """:func:`nccl_mode` for this machine: its GPU count, its loaded NCCL, ``CUDARECV_NCCL_MODE``."""
    return nccl_mode(
        world,
        torch.cuda.device_count(),
        nccl_runtime_version(),
        os.environ.get(MODE_ENV) or None,
    )


def nccl_ranks_problem(world: int, mode: Mode | None = None) -> str | None:
    """Why :func:`nccl_ranks` cannot start ``world`` NCCL ranks here in ``mode`` (default: the mode
    it would choose), as a skip reason; or None."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return "torch.distributed has no NCCL backend in this build"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False: NCCL ranks need a visible GPU"
    try:
        chosen = current_nccl_mode(world) if mode is None else nccl_mode(world, 0, None, mode)
    except ValueError as exc:
        return str(exc)
    count = torch.cuda.device_count()
    if chosen == "per_gpu" and count < world:
        return f"per_gpu mode: {world} NCCL ranks need {world} GPUs (this machine: {count})"
    if chosen == "multi_rank":
        version = nccl_runtime_version()
        if version is None or version[:2] < NCCL_SHARED_MIN:
            return (
                f"multi_rank mode needs NCCL >= {NCCL_SHARED_MIN[0]}.{NCCL_SHARED_MIN[1]} "
                f"(NCCL_MULTI_RANK_GPU_ENABLE=1); the NCCL loaded here is {version}"
            )
    return None


class NcclRanks(Ranks):
    """:class:`~cudarecv.testing.launch.Ranks` of :func:`nccl_ranks`, which also say their ``mode``."""

    def __init__(self, mode: Mode, world_size: int, **cluster_kwargs: Any) -> None:
        super().__init__(world_size, **cluster_kwargs)
        self.mode: Mode = mode


def nccl_ranks(world: int, *, mode: Mode | None = None, **cluster_kwargs: Any) -> NcclRanks:
    """``world`` NCCL ranks (a :class:`~cudarecv.testing.launch.Ranks`, started on first use) in
    ``mode`` (default: :func:`current_nccl_mode`); ``cluster_kwargs`` go to
    :class:`~cudarecv.testing.launch.Cluster` (``pg_timeout``, ``env``, ...). A ``rank_env`` given
    there is applied after the mode's. Check :func:`nccl_ranks_problem` first.

    Raises:
        ValueError: a bad ``world`` or ``mode``, or a ``backend`` other than ``"nccl"``.
    """
    if cluster_kwargs.setdefault("backend", "nccl") != "nccl":
        raise ValueError(
            f"backend must be 'nccl' for nccl_ranks, got {cluster_kwargs['backend']!r}"
        )
    chosen: Mode = current_nccl_mode(world) if mode is None else nccl_mode(world, 0, None, mode)
    theirs = cluster_kwargs.pop("rank_env", None)

    def rank_env(rank: int) -> dict[str, str]:
        env = nccl_rank_env(chosen, rank)
        if theirs is not None:
            env.update(theirs(rank))
        return env

    return NcclRanks(chosen, world, rank_env=rank_env, **cluster_kwargs)


def nccl_pair_problem(shared_gpu: bool) -> str | None:
    """Why two local NCCL ranks cannot run here with one GPU each (``shared_gpu`` False) or both on
    one GPU with ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (``shared_gpu`` True: needs the loaded NCCL >= 2.30),
    or None. For callers that start NCCL ranks themselves (vLLM's engine); :func:`nccl_ranks_problem`
    for ranks of :func:`nccl_ranks`, which also run on one GPU with an older NCCL."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return "torch.distributed has no NCCL backend in this build"
    if shared_gpu:
        version = nccl_runtime_version()
        if version is None or version[:2] < NCCL_SHARED_MIN:
            return (
                f"two NCCL ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1) need NCCL >= "
                f"{NCCL_SHARED_MIN[0]}.{NCCL_SHARED_MIN[1]}; the NCCL loaded here is {version}"
            )
        return None
    count = torch.cuda.device_count()
    if count < 2:
        return (
            f"two NCCL ranks need 2 GPUs (this machine: {count}), or one GPU with NCCL >= 2.30 "
            "(NCCL_MULTI_RANK_GPU_ENABLE=1)"
        )
    return None
