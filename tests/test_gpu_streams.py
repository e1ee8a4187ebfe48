"""GPU tests of issue 47's streams: a stream per link, eager initialisation, lanes made on other threads.

Marked ``gpus(1)`` and skipped without CUDA (or without NCCL for the NCCL ones: the reason says why). Run on
a GPU machine with::

    pytest --gpus 1 tests/test_gpu_streams.py

The NCCL ranks come from :func:`cudarecv.testing.gpu.nccl_ranks` (three ranks, sharing one GPU where there
is one). Every wait is bounded: the groups time out after ``PG_TIMEOUT`` s, each call into the ranks after
``RUN_TIMEOUT`` s, a stalled receiver waits at most ``STALL`` s for the other's signal. The CPU tests of the
same defects run against the strict NCCL stand-in (``tests/test_nccl_rules.py``, ``tests/test_cuda_logic.py``).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.core import streams as _cuda
from cudarecv.core.link import Link
from cudarecv.testing.gpu import nccl_ranks, nccl_ranks_problem
from cudarecv.wire.staging import lane_for
from rawwire import store, unique_key

HAS_CUDA = torch.cuda.is_available()
WAIT = 30.0  # each pull's and push's own timeout
STALL = 40.0  # the longest a stalled receiver waits for the other's signal (longer than a pull)
PG_TIMEOUT = STALL + 20.0  # longer than a send stays posted while its receiver is stalled
RUN_TIMEOUT = 2 * (STALL + WAIT) + 10.0  # two versions, each a stall and a pull at worst
START = 60.0  # what starting three NCCL ranks (the module's first test) may take
LEAF = 4 << 20  # bytes per leaf: a message NCCL holds until its receiver posts the receive
CHUNK = 1 << 20

pytestmark = [
    pytest.mark.gpus(1),
    pytest.mark.timeout(RUN_TIMEOUT + START),
    pytest.mark.skipif(
        not HAS_CUDA,
        reason="torch.cuda.is_available() is False: needs a CUDA build of torch and a visible GPU",
    ),
]


@pytest.fixture(scope="module")
def three():
    """Three NCCL ranks (a GPU each where there are enough, else sharing GPU 0)."""
    reason = nccl_ranks_problem(3)
    if reason:
        pytest.skip(reason)
    ranks = nccl_ranks(3, pg_timeout=PG_TIMEOUT)
    yield ranks
    ranks.close()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _weights(version: int, device: torch.device) -> TensorDict:
    return TensorDict(
        {
            f"w{i}": torch.full((LEAF // 4,), float(version * 10 + i), device=device)
            for i in range(4)
        },
        batch_size=[],
    )


def _fill(td: TensorDict, version: int) -> None:
    """Write ``version``'s values into ``td``'s own leaves (what the sender reads at each push)."""
    for i in range(4):
        td.get(f"w{i}").fill_(float(version * 10 + i))


def _holds(td: TensorDict, version: int) -> bool:
    return all(bool((td.get(f"w{i}").float() == float(version * 10 + i)).all()) for i in range(4))


def weight_sync(rank, world, group, key, fanout, eager, stalled, memory):
    """Rank 0 pushes two versions to ranks 1 and 2 (a star, or a relay 1 -> 2) over the default group, or over
    a group initialised eagerly (``device_id=``); rank ``stalled`` pulls only once the other receiver has each
    version (or after ``STALL`` s). Receivers hold ``memory`` ("cuda" or "cpu"); each says what it holds, and
    whether it had to wait out the stall."""
    device = _device()
    pg = dist.new_group(list(range(world)), device_id=device) if eager else None
    if eager:
        assert pg.bound_device_id is not None  # (what cudarecv reads to pair its links)
    if rank == 0:
        td = _weights(0, device)
        with cudarecv.WeightSender(
            td, group=pg, group_dst=[1, 2], bucket_bytes=CHUNK, timeout=WAIT, fanout=fanout
        ) as sender:
            for version in (1, 2):
                _fill(td, version)
                sender.push()
            return sender.fanout
    with cudarecv.WeightReceiver(
        group=pg,
        group_src=0,
        expect=_weights(0, device),
        device=device if memory == "cuda" else "cpu",
        timeout=WAIT,
    ) as receiver:
        held, waited_out = [], False
        for step in (1, 2):
            if rank == stalled:
                try:
                    store().wait([f"{key}/got/{step}"], timedelta(seconds=STALL))
                except Exception:  # noqa: BLE001 - the other never got it: said below
                    waited_out = True
            version = receiver.pull()
            torch.cuda.current_stream().synchronize()
            store().set(f"{key}/got/{step}", "1")
            held.append(_holds(receiver.td, version))
        return held, waited_out


@pytest.mark.parametrize(
    "fanout, stalled",
    [("star", 1), ("relay", 2)],
    ids=["star-first-stalls", "relay-tail-stalls"],
)
@pytest.mark.nccl
def test_a_stalled_receiver_does_not_stall_the_other(three, fanout, stalled):
    """Issue 47 item 1 on NCCL: each link of a weight end has a stream of its own, so the other receiver gets
    every version while one has not posted its receives (with one stream per device it waited for them)."""
    out = three.get().run(
        weight_sync,
        args=(unique_key(f"stall-{fanout}"), fanout, False, stalled, "cuda"),
        timeout=RUN_TIMEOUT,
    )
    assert out[0] == fanout, out
    for rank in (1, 2):
        held, waited_out = out[rank]
        assert held == [True, True], out
        assert not waited_out, out  # (the stalled one was released by the other's signal)


@pytest.mark.nccl
@pytest.mark.parametrize("memory", ["cuda", "cpu"])
def test_a_relay_of_three_on_an_eagerly_initialised_group(three, memory):
    """Issue 47 item 4 on NCCL: with ``device_id=`` torch runs every op of the group on its one communicator;
    the relay (whose chunks go on as they land) would wait in a cycle there. cudarecv's weight ends pair up
    on groups of their own: both versions land at both receivers. Host-memory receivers (``"cpu"``) also make
    their relay lanes on the pulls' threads (item 5: staged on the receiver's device)."""
    out = three.get().run(
        weight_sync,
        args=(unique_key(f"eager-{memory}"), "relay", True, -1, memory),
        timeout=RUN_TIMEOUT,
    )
    assert out[0] == "relay", out
    assert out[1:] == [([True, True], False)] * 2, out


class _Lazy:
    """As much of a lazily initialised NCCL group of three as a lane needs (nothing is posted here)."""

    def name(self) -> str:
        return "NCCL"

    def size(self) -> int:
        return 3

    def rank(self) -> int:
        return 1


def test_a_lane_made_on_a_thread_is_on_the_owners_device():
    """Issue 47 item 5, on the GPU there is: a lane made on another thread stages on the device it is given
    (a relay lane: the receiver's), and each link's stream is its own, on the tensordict's device."""
    device = _device()
    link = Link(_Lazy(), 2, False, "nccl")
    made = []

    def make():
        made.append(
            lane_for(
                link,
                torch.device("cpu"),
                None,
                _cuda.StagingPool(),
                peers_at_once=True,
                cuda=device,
            )
        )
        made.append(
            lane_for(
                Link(link.pg, 0, False, "nccl"),
                device,
                None,
                _cuda.StagingPool(),
                peers_at_once=True,
            )
        )

    thread = threading.Thread(target=make)
    thread.start()
    thread.join(30)
    host, on_device = made
    assert host.stream.device == device and on_device.stream.device == device
    assert host.stream != on_device.stream
    assert host.stream != torch.cuda.default_stream(device)


def test_cudarecvs_streams_never_alias_torchs_pool():
    """Review of issue 47, item 1: ``torch.cuda.Stream()`` hands out one of 32 pooled streams per device and
    priority, round-robin, as ProcessGroupNCCL's communicators get theirs; 40 draws must repeat one. cudarecv's
    link streams (and copy streams) are made outside that pool (cupy's): 40 links on one device plus 40 draws
    from the pool are all distinct CUDA streams, and work queued on each runs."""
    pytest.importorskip(
        "cupy", reason="cudarecv's own streams need cupy (pip install cudarecv[gpu])"
    )
    device = _device()
    group = _Lazy()
    links = [_cuda.link_stream(device, group, peer) for peer in range(40)]
    copies = [_cuda.link_copy_stream(device, group, peer) for peer in range(40)]
    owners = [_cuda.own_stream(device), _cuda.dedicated_stream(device), _cuda.copy_stream(device)]
    pooled = [torch.cuda.Stream(device=device) for _ in range(40)]
    assert (
        len({s.cuda_stream for s in pooled}) <= 32
    )  # (the pool wraps: what the links must not share)
    ours = links + copies + owners
    assert all(s.device == device for s in ours)
    handles = [s.cuda_stream for s in ours] + [s.cuda_stream for s in pooled]
    assert len(set(handles)) == len(ours) + len({s.cuda_stream for s in pooled}), (
        "a stream of cudarecv's is one of torch's pool"
    )
    assert torch.cuda.default_stream(device).cuda_stream not in {s.cuda_stream for s in ours}
    count = torch.zeros(1, device=device)
    for stream in ours:
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            count.add_(1)
        torch.cuda.current_stream(device).wait_stream(stream)
    assert count.item() == len(ours)
