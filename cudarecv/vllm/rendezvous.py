"""Where the trainer and the engine's workers meet: the trainer's TCP store, each worker's entry in it, and the
gloo group of their own (rank 0 the trainer, worker ``i`` rank ``i + 1``) built on a prefix of it. The user's
process groups, and vLLM's, are never touched."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from ..core.groups import store_group  # (an internal helper: pyproject.toml's contract allows it)


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def member_key(session: str, index: int) -> str:
    """The store key where worker ``index`` says it joined (its engine's worker count, dtype and host)."""
    return f"cudarecv/vllm/{session}/worker/{index}"


def joined_key(session: str, index: int) -> str:
    """The store key where worker ``index`` of a fleet's engine says which of the fleet sender's receivers it is
    (JSON: its ``id`` and the sender's ``generation``)."""
    return f"cudarecv/vllm/{session}/joined/{index}"


def staged_key(session: str, index: int, version: int) -> str:
    """The store key where worker ``index`` says it has staged ``version`` (or tried: its value says which), so that
    the trainer asks the engine to pause only once there is nothing left to do in the pause but put it in place."""
    return f"cudarecv/vllm/{session}/staged/{index}/{version}"


def loaded_key(session: str, index: int, version: int) -> str:
    """The store key where worker ``index`` says how it put ``version`` in place (JSON: a :class:`~.info.Loaded`)."""
    return f"cudarecv/vllm/{session}/loaded/{index}/{version}"


def group_of(
    store: dist.Store, session: str, rank: int, size: int, timeout: float
) -> dist.ProcessGroup:
    """This process's rank of the session's gloo group (every member calls it; bounded by ``timeout``)."""
    who = "the trainer" if rank == 0 else f"vLLM worker {rank - 1}"
    return store_group(
        store,
        f"cudarecv/vllm/{session}/group",
        rank,
        size,
        timeout,
        f"cudarecv weight transfer: for {who}, the group of the trainer and {size - 1} vLLM worker(s)",
    )
