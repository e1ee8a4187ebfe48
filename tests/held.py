"""What a rank's process holds (cudarecv's threads, descriptors, shared mappings, device memory), and the rank
functions of the lifecycle tests, for host tensors (tests/test_lifecycle.py) and GPU ones through CUDA IPC
(tests/test_gpu.py): the same code on every transport."""

from __future__ import annotations

import gc
import os
import threading
import weakref

import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from rawwire import store

SHARED_THREADS = {
    "cudarecv-deadlines"
}  # one per process, for every transfer (it holds them weakly)


def threads() -> set[str]:
    """cudarecv's threads alive in this process but the process-wide ones (named with their idents: several
    share a name)."""
    return {
        f"{t.name}#{t.ident}"
        for t in threading.enumerate()
        if t.name.startswith("cudarecv") and t.name not in SHARED_THREADS
    }


def stacks(names: set[str]) -> dict[str, str]:
    """Where each thread of ``names`` (as :func:`threads` names them) is now: its Python stack, for a failure's
    message (a thread left after close() says what it still waits for)."""
    import sys
    import traceback

    frames = sys._current_frames()
    found = {}
    for t in threading.enumerate():
        name = f"{t.name}#{t.ident}"
        if name in names and t.ident in frames:
            found[name] = "".join(traceback.format_stack(frames[t.ident])[-8:])
    return found


def shared_maps() -> int:
    """This process's shared mappings (segments, mapped storages): the private ones are its allocators' and
    thread stacks', which glibc caches as it likes."""
    with open("/proc/self/maps") as maps:
        return sum(line.split()[1][3] == "s" for line in maps)


def resources(device: str = "cpu") -> tuple[int, ...]:
    """cudarecv's threads, all threads, descriptors and shared mappings of this process (and on a GPU, the
    device memory allocated and reserved)."""
    gc.collect()
    held = (
        len(threads()),
        len(os.listdir("/proc/self/task")),
        len(os.listdir("/proc/self/fd")),
        shared_maps(),
    )
    if device != "cuda":
        return held
    torch.cuda.synchronize()
    return held + (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())


def sync_weights(rank: int, pg: object, td: TensorDict, mode: str, key: str) -> str:
    """One version of ``td`` from rank 0 to rank 1, each end closed after; what carried it."""
    if rank == 0:
        with cudarecv.WeightSender(td, group=pg, group_dst=1, mode=mode, timeout=20) as sender:
            carried = sender.transports[
                1
            ]  # (chosen at the handshake; a receiver closed is no longer listed)
            td["w"].fill_(3.0)
            sender.push()
            store().wait([f"{key}_{mode}"])  # (latest: not closed before the receiver has it)
            return carried
    with cudarecv.WeightReceiver(
        group=pg, group_src=0, device=td["w"].device, timeout=20
    ) as receiver:
        receiver.pull()
        assert bool((receiver.td["w"] == 3.0).all())
        store().set(f"{key}_{mode}", "1")
        return receiver.transport


def transfers(
    rank: int, pg: object, tds: list[TensorDict], good: TensorDict, transport: str
) -> tuple[int, list]:
    """Send each of ``tds`` (rank 0) into ``good`` (rank 1): how many the receiver refused, and what carried
    each transfer the receiver took."""
    refused, routes = 0, []
    for td in tds:
        if rank == 0:
            [sent] = cudarecv.isend(
                td,
                group=pg,
                group_dst=1,
                bucket_bytes=1 << 12,
                timeout=20,
                transport=transport,
                return_early=True,
            )
            sent.wait()
            continue
        [received] = cudarecv.irecv(
            good,
            group=pg,
            group_src=0,
            bucket_bytes=1 << 12,
            timeout=20,
            transport=transport,
            return_premature=True,
        )
        try:
            received.wait()
            routes.append(received.transport)
        except cudarecv.HeaderError:
            refused += 1
    return refused, routes


def both_done(key: str, rank: int) -> None:
    """Neither rank destroys the group while the other still uses it."""
    store().set(f"{key}_done_{rank}", "1")
    store().wait([f"{key}_done_{1 - rank}"])


def weights_and_transfers(rank, world, group, transport, bad, key, device="cpu"):
    """Weight sync (sync and latest) and four fast-wire transfers on a new group (``bad`` of them refused
    with HeaderError: the link stays usable), then close, destroy the group, collect: what carried the
    weights and the transfers, the cudarecv threads left, and whether the tensordicts and the group are still
    alive."""
    before = threads()
    pg = dist.new_group([0, 1], backend="gloo")
    weights = TensorDict(w=torch.zeros(1000, device=device))
    carried = [sync_weights(rank, pg, weights, mode, key) for mode in ("sync", "latest")]
    good = TensorDict(x=torch.full((4096,), 1.0 + rank, device=device))
    # same bytes, another dtype: refused by the header
    wrong = TensorDict(x=torch.zeros(4096, dtype=torch.int32, device=device))
    refused, routes = transfers(rank, pg, [wrong] * bad + [good] * (4 - bad), good, transport)
    exact = bool((good["x"] == 1.0).all())
    links = sorted(threads() - before)  # while the group lives
    refs = [weakref.ref(x) for x in (weights, good, wrong, pg)]
    both_done(key, rank)
    dist.destroy_process_group(pg)
    del pg, weights, good, wrong
    gc.collect()
    return (
        refused,
        exact,
        links,
        sorted(threads() - before),
        [r() is not None for r in refs],
        carried + routes,
    )


def many_transfers(rank, world, group, transport, key, device="cpu"):
    """1000 fast-wire transfers on a new group, every fourth refused: threads, descriptors and mappings (and
    device memory) after the first 20 and after all 1000."""
    pg = dist.new_group([0, 1], backend="gloo")
    good = TensorDict(
        x=torch.full((4096,), 1.0 + rank, device=device),
        y=torch.zeros(10, dtype=torch.int64, device=device),
    )
    wrong = TensorDict(
        x=torch.zeros(4096, dtype=torch.int32, device=device),
        y=torch.zeros(10, dtype=torch.int64, device=device),
    )
    tds = [wrong if i % 4 == 3 else good for i in range(1000)]
    refused, _ = transfers(rank, pg, tds[:20], good, transport)
    early = resources(device)
    refused += transfers(rank, pg, tds[20:], good, transport)[0]
    late = resources(device)
    both_done(key, rank)
    dist.destroy_process_group(pg)
    return refused, early, late
