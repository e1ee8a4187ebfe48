"""New process groups, each used then dropped (the README's recovery after a LinkError), by transfers and by
weight sync (sync and latest, shared memory and wire), leak nothing of
cudarecv's (issue 32): threads, descriptors and shared mappings stay within plain gloo's own per-group cost,
measured in the same processes."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.testing.launch import Cluster

ROUNDS = 8  # (a leak of one thread or descriptor per group shows as 7, beyond SLACK)
SLACK = 4  # threads or descriptors a round may differ by (gloo's own come and go)


def counts() -> tuple[int, int, int]:
    """This process's threads, descriptors and shared mappings."""
    with open("/proc/self/maps") as f:
        shared = sum(1 for line in f if line.split()[1:2] and line.split()[1].endswith("s"))
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), shared


def one_round(rank: int, mode: str) -> None:
    """A new group, a few transfers on it, then the group destroyed and dropped."""
    g = dist.new_group([0, 1])
    td = TensorDict({"a": torch.arange(1000.0), "b": torch.ones(64, 64)}, [])
    if mode.startswith("weights/"):
        sync_weights(rank, g, td, mode.split("/", 1)[1])
    for _ in range(3 if not mode.startswith("weights/") else 0):
        if mode == "gloo":
            if rank == 0:
                dist.isend(td["a"], 1, group=g).wait()
            else:
                dist.irecv(td["a"], 0, group=g).wait()
            continue
        transport, bucket = mode.split("/")
        kwargs = {"transport": transport, "bucket_bytes": int(bucket) or None, "timeout": 30.0}
        if rank == 0:
            cudarecv.send(td, 1, group=g, **kwargs)
        else:
            cudarecv.recv(td, 0, group=g, **kwargs)
    dist.barrier()
    dist.destroy_process_group(g)
    del g, td
    gc.collect()


def sync_weights(rank: int, g, td: TensorDict, mode: str) -> None:
    """A weight sender (rank 0) and receiver (rank 1) on ``g``: three versions, then both closed."""
    transport, mode = mode.split("/")
    if rank == 0:
        with cudarecv.WeightSender(
            td, group=g, group_dst=1, mode=mode, transport=transport, timeout=30.0
        ) as sender:
            for _ in range(3):
                td["a"] += 1
                sender.push()
                if mode == "latest":  # the receiver pulls this version before the next is pushed
                    dist.barrier(group=g)
                    dist.barrier(group=g)
    else:
        with cudarecv.WeightReceiver(
            group=g, group_src=0, expect=td, transport=transport, timeout=30.0
        ) as receiver:
            for _ in range(3):
                if mode == "sync":
                    receiver.pull()
                else:
                    dist.barrier(group=g)
                    receiver.pull()
                    dist.barrier(group=g)
            assert receiver.td["a"][0].item() == 3.0


def churn(rank: int, world: int, group, modes: list[str]) -> dict[str, list[tuple[int, int, int]]]:
    """Per mode: the counts after each of ROUNDS rounds (one warm-up round first)."""
    out = {}
    for mode in modes:
        one_round(rank, mode)
        seen = []
        for _ in range(ROUNDS):
            one_round(rank, mode)
            seen.append(counts())
        out[mode] = seen
    return out


MODES = [
    "gloo",
    "auto/0",
    "auto/65536",
    "wire/0",
    "wire/65536",
    "weights/auto/sync",
    "weights/auto/latest",
    "weights/wire/sync",
    "weights/wire/latest",
]


@pytest.mark.long
@pytest.mark.timeout(900)
def test_groups_used_and_dropped_leave_nothing():
    with Cluster(2) as ranks:
        results = ranks.run(churn, args=(MODES,), timeout=600)
    for rank, by_mode in enumerate(results):
        base = by_mode["gloo"]
        gloo_growth = [base[-1][i] - base[0][i] for i in range(3)]
        for mode in MODES[1:]:
            seen = by_mode[mode]
            growth = [seen[-1][i] - seen[0][i] for i in range(3)]
            for what, g, b in zip(
                ("threads", "descriptors", "shared mappings"), growth, gloo_growth
            ):
                assert g <= max(b, 0) + SLACK, (
                    f"rank {rank}, {mode}: {what} grew by {g} over {ROUNDS - 1} groups "
                    f"(plain gloo: {b}): {seen}"
                )
