"""GPU checks of issue 47, items 6 and 7 (their CPU checks: ``tests/test_ipc_sharded_logic.py``).

6. CUDA IPC across two GPUs of a node: a reader on another GPU than the writer's opens the writer's memory where
   it lies and copies device to device (before: it declined every offer, and the wire carried the payloads).
   Needs two GPUs (``gpus(2)``: skipped on one-GPU machines).
7. A sharded pull into CUDA buffers waits for its own stream only: a long kernel the caller queued on another
   stream is still running when the pull returns (before: ``torch.cuda.synchronize(device)``, twice per pull,
   waited for it).

Run on a GPU machine with ``pytest --gpus 1 tests/test_gpu_ipc_sharded.py`` (``--gpus 2`` for item 6). Every test
is also skipped when ``torch.cuda.is_available()`` is False. The ranks are two spawned gloo ranks
(:class:`cudarecv.testing.launch.Ranks`); every wait is bounded.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.testing.launch import Ranks

PG_TIMEOUT = 60.0
RUN_TIMEOUT = 120.0
WAIT = 30.0  # the receivers' and senders' timeouts inside the ranks
SLEEP = 4.0  # seconds the caller's kernel on its other stream spins

pytestmark = [
    pytest.mark.gpus(1),
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="torch.cuda.is_available() is False: needs a CUDA build of torch and a visible GPU",
    ),
]


@pytest.fixture(scope="module")
def gloo():
    ranks = Ranks(2, pg_timeout=PG_TIMEOUT)
    yield ranks
    ranks.close()


def _weights(device: torch.device) -> TensorDict:
    return TensorDict(
        w=torch.zeros(512, 256, device=device),
        b=torch.zeros(256, device=device),
        steps=torch.zeros(3, dtype=torch.int64, device=device),
    )


def _holds(td: TensorDict, version: int) -> bool:
    return all(bool((t == version).all()) for t in td.values(True, True))


def _set(td: TensorDict, version: int) -> None:
    td.apply_(lambda t: t.fill_(version))


def _sleep_on(stream: torch.cuda.Stream, seconds: float) -> None:
    """Queue a kernel on ``stream`` that spins for about ``seconds`` (its clock rate measured first)."""
    probe = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(probe):
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
    end.synchronize()
    per_second = 20_000_000 / (start.elapsed_time(end) / 1e3)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(per_second * seconds))


# -- 6: CUDA IPC across two GPUs -------------------------------------------------------------------------------


def across_gpus(rank, world, group):
    """Rank r on GPU r: weight sync, fast-wire transfers and a sharded pull from GPU 0 into GPU 1, each through
    CUDA IPC (device-to-device copies), every value exact."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    out: dict = {}
    weights = _weights(device)
    if rank == 0:
        with cudarecv.WeightSender(weights, dst=1, timeout=WAIT) as sender:
            for version in (1, 2, 3):
                _set(weights, version)
                sender.push()
            out["weights"] = sender.transports
    else:
        with cudarecv.WeightReceiver(src=0, device=device, timeout=WAIT) as receiver:
            got = [receiver.pull() for _ in range(3)]
            with receiver.reading() as td:
                out["weights"] = (receiver.transport, got, _holds(td, 3))
    routes = []
    td = TensorDict(a=torch.zeros(300_000, device=device), b=torch.zeros(77, device=device))
    for step in (1, 2, 3):
        if rank == 0:
            _set(td, step)
            [t] = cudarecv.isend(td, 1, bucket_bytes=1 << 18, return_early=True)
        else:
            [t] = cudarecv.irecv(td, 0, bucket_bytes=1 << 18, return_premature=True)
        t.wait(WAIT)
        routes.append((t.transport, rank == 0 or _holds(td, step)))
    out["fast wire"] = routes
    if rank == 0:
        with cudarecv.ShardedSender(weights, dst=[1], timeout=WAIT) as sender:
            for version in (4, 5):
                _set(weights, version)
                sender.push()
            dist.barrier()
    else:
        with cudarecv.ShardedReceiver(src=[0], device=device, timeout=WAIT) as receiver:
            got = [receiver.pull() for _ in range(2)]
            out["sharded"] = (receiver.transport, got, _holds(receiver.td, 5))
            dist.barrier()
    torch.cuda.synchronize(device)
    return out


@pytest.mark.gpus(2)
@pytest.mark.timeout(300)
def test_cuda_ipc_engages_across_two_gpus(gloo):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    sender, receiver = gloo().run(across_gpus, timeout=RUN_TIMEOUT)
    assert sender["weights"] == {1: "cuda ipc"}, sender
    assert receiver["weights"] == ("cuda ipc", [1, 2, 3], True), receiver
    # (the first transfer offers the segments on the wire; the next ones go through them)
    assert [route for route, _ in sender["fast wire"][1:]] == ["cuda ipc"] * 2, sender
    assert receiver["fast wire"][1:] == [("cuda ipc", True)] * 2, receiver
    assert receiver["sharded"] == ("cuda ipc", [4, 5], True), receiver


# -- 7: a sharded pull waits for its own stream only ------------------------------------------------------------


def busy_caller(rank, world, group, transport):
    """Both ranks on GPU 0. After a first version, the receiver queues a long kernel on a stream of its own
    (unrelated work) and pulls the second: the pull returns while that kernel still runs. Every piece is copied
    by the sharded pull (its rank's receiver lands in storage of its own, as after a failed relay forward)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    weights = _weights(device)
    if rank == 0:
        with cudarecv.ShardedSender(weights, dst=[1], timeout=WAIT, transport=transport) as sender:
            _set(weights, 1)
            sender.push()
            dist.barrier()  # the receiver's kernel is queued
            _set(weights, 2)
            sender.push()
            dist.barrier()
        torch.cuda.synchronize(device)
        return None
    with cudarecv.ShardedReceiver(
        src=[0], device=device, timeout=WAIT, transport=transport
    ) as receiver:
        inner = receiver._inner[0][2]
        for index in (0, 1):
            inner._slots.renew(index, inner.schema, inner._puller.bucket_bytes, device)
        first = receiver.pull() == 1 and _holds(receiver.td, 1)
        side = torch.cuda.Stream(device)
        _sleep_on(side, SLEEP)
        queued = time.monotonic()
        dist.barrier()
        version = receiver.pull(timeout=WAIT)
        took = time.monotonic() - queued
        still_running = not side.query()  # (read before anything waits for it)
        side.synchronize()
        exact = _holds(receiver.td, 2)
        transport_taken = receiver.transport
        dist.barrier()
    torch.cuda.synchronize(device)
    return first, version, exact, still_running, took, transport_taken


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["wire", "auto"])
def test_a_sharded_pull_into_cuda_does_not_wait_for_the_callers_other_stream(gloo, transport):
    """The pull orders its copies after its ranks' pulls by stream waits and waits for its own stream's event:
    the caller's kernel on another stream is still running when it returns, and the pull took far less than
    that kernel."""
    _, (first, version, exact, still_running, took, taken) = gloo().run(
        busy_caller, args=(transport,), timeout=RUN_TIMEOUT
    )
    assert first and version == 2 and exact, (first, version, exact)
    assert still_running, (
        f"the pull returned after the caller's {SLEEP:g} s kernel on another stream ended ({took:.2f} s): "
        "it waited for the whole device"
    )
    assert took < SLEEP / 2, f"the pull took {took:.2f} s beside a {SLEEP:g} s kernel"
    assert taken in ("wire", "cuda ipc"), taken
