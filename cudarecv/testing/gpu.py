"""GPU gating for tests and benchmarks: whether two local NCCL ranks can run here, and why not.

Example:
    >>> problem = nccl_pair_problem(shared_gpu=False)
    >>> if problem: pytest.skip(problem)
"""

from __future__ import annotations

import torch

NCCL_SHARED_MIN = (2, 30)  # NCCL that lets two ranks share a GPU (NCCL_MULTI_RANK_GPU_ENABLE=1)


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL version of this torch build, or None without NCCL."""
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - no NCCL in this torch build
        return None
    if isinstance(version, int):  # old torch: NCCL_VERSION_CODE
        return (version // 10000, version // 100 % 100, version % 100)
    return tuple(int(v) for v in version)


def nccl_pair_problem(shared_gpu: bool) -> str | None:
    """Why two local NCCL ranks cannot run here (one GPU each, or both on one GPU), or None."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return "torch.distributed has no NCCL backend in this build"
    if shared_gpu:
        version = nccl_version()
        if version is None or version[:2] < NCCL_SHARED_MIN:
            return (
                f"two NCCL ranks on one GPU (CUDARECV_NCCL_SHARED_GPU=1) need NCCL >= "
                f"{NCCL_SHARED_MIN[0]}.{NCCL_SHARED_MIN[1]} (NCCL_MULTI_RANK_GPU_ENABLE=1); "
                f"this torch has NCCL {version}"
            )
        return None
    count = torch.cuda.device_count()
    if count < 2:
        return (
            f"two NCCL ranks need 2 GPUs (this machine: {count}), or one GPU with NCCL >= 2.30 "
            "and CUDARECV_NCCL_SHARED_GPU=1"
        )
    return None
