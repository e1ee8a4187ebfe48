"""Hand-made messages on a real link: what a buggy or hostile peer could put on the wire."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _pg(group):
    return group if group is not None else dist.distributed_c10d._get_default_group()


def raw_send(group, peer: int, data: bytes, tag: int, timeout: float = 10.0) -> None:
    """Send ``data`` as one message with ``tag`` (bounded wait)."""
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.zeros(0, dtype=torch.uint8)
    )
    _pg(group).send([buf], peer, tag).wait(timedelta(seconds=timeout))


def raw_recv(group, peer: int, size: int, tag: int, timeout: float = 10.0) -> bytes:
    """Receive one message of at most ``size`` bytes with ``tag`` (zero-filled past its end)."""
    buf = torch.zeros(size, dtype=torch.uint8)
    _pg(group).recv([buf], peer, tag).wait(timedelta(seconds=timeout))
    return buf.numpy().tobytes()


def unique_key(name: str) -> str:
    """A store key no earlier test (or run of this one) on the same ranks has used."""
    return f"{name}_{time.monotonic_ns()}"


def store():
    """The ranks' shared TCPStore (for signals between ranks outside the link under test)."""
    return dist.distributed_c10d._get_default_store()


def set_flag(key: str) -> None:
    """Tell the other ranks (through the shared store) that ``key`` happened."""
    store().set(key, "1")


def wait_flag(key: str, seconds: float = 90.0) -> None:
    """Wait until a rank has signalled ``key`` (bounded: a missing signal fails the call)."""
    store().wait([key], timedelta(seconds=seconds))
