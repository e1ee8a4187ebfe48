"""GPU tests: host tensordicts over NCCL, staged through pinned memory, never block the call on the peer.

Issue 47, defect 3: a copy between device memory and pageable host memory is synchronous (device to host
it returns once the copy has run; host to device it may first wait for the stream), so it waits for the
stream's earlier work, an NCCL receive the peer has not matched, or a send the peer has not received.
Done in the call that posts, ``irecv`` returned only once the peer had sent and ``isend`` (more than two
messages) only once the peer received. Here the peer posts its side only once the call has returned,
signalled through the store: a call that waits for the peer never returns (the signal's wait, bounded,
fails the test instead).

Two NCCL ranks from :func:`cudarecv.testing.gpu.nccl_ranks` (on a one-GPU machine both share it). Run on a
GPU machine with ``pytest --gpus 1 tests/test_gpu_staging.py``.

(Two ranks that each ``irecv`` then ``isend`` on one NCCL group are not tested: a single point-to-point op
of either direction goes on the pair's one communicator and stream, so each rank's send kernel queues
behind its receive, which waits for the other's send: NCCL itself deadlocks there, whatever the host does.)
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from cudarecv.testing.gpu import nccl_ranks, nccl_ranks_problem
from rawwire import set_flag, unique_key, wait_flag

HAS_CUDA = torch.cuda.is_available()
WAIT = 30.0  # each transfer's own timeout, and each wait for the other rank's signal
PG_TIMEOUT = 2 * WAIT  # longer than an op stays posted while the other rank waits for a signal
RUN_TIMEOUT = 4 * WAIT  # a warm-up, a wait for the signal, the transfer, its wait
START = 60.0  # what starting two NCCL ranks (the module's first test) may take

pytestmark = [
    pytest.mark.gpus(1),
    pytest.mark.nccl,
    pytest.mark.timeout(RUN_TIMEOUT + START),
    pytest.mark.skipif(
        not HAS_CUDA,
        reason="torch.cuda.is_available() is False: needs a CUDA build of torch and a visible GPU",
    ),
]

# mode: (consolidated, bucket_bytes); the storage is 64 MiB and a little, each message far more than NCCL
# and the loopback sockets buffer, so a send completes only once the peer receives
MODES = {
    "consolidated": (True, None),  # one message, the stock wire
    "per-leaf": (False, None),  # three messages, the stock wire
    "chunks": (True, 16 << 20),  # a header, then five chunks of 16 MiB: the fast wire
}


@pytest.fixture(scope="module")
def nccl():
    problem = nccl_ranks_problem(2)
    if problem:
        pytest.skip(problem)
    ranks = nccl_ranks(2, pg_timeout=PG_TIMEOUT)
    yield ranks
    ranks.close()


def _td(fill: float, consolidated: bool) -> TensorDict:
    """Pageable host memory (consolidated: one storage, not pinned)."""
    td = TensorDict(
        a=torch.arange(16 << 20, dtype=torch.float32) + fill,
        b=torch.full((1000,), fill, dtype=torch.float64),
        c=TensorDict(
            d=torch.arange(35, dtype=torch.int64).reshape(5, 7) * int(fill + 1), batch_size=[]
        ),
        batch_size=[],
    )
    return td.consolidate(metadata=True) if consolidated else td


def _same(td: TensorDict, fill: float) -> bool:
    want = _td(fill, False)
    return all(torch.equal(td.get(k), want.get(k)) for k in want.keys(True, True))


def _kw(mode: str) -> dict:
    consolidated, bucket_bytes = MODES[mode]
    return dict(consolidated=consolidated, bucket_bytes=bucket_bytes, timeout=WAIT)


def _warm(rank: int, mode: str) -> None:
    """One transfer rank 0 -> rank 1 as the test's, both ends posting at once: NCCL makes a communicator
    with both ranks inside their first op on it (the store exchange and ``ncclCommInitRank`` block the host),
    which no test here is about."""
    consolidated = MODES[mode][0]
    td = _td(9.0 if rank == 0 else 0.0, consolidated)
    if rank == 0:
        cudarecv.send(td, dst=1, **_kw(mode))
    else:
        cudarecv.recv(td, src=0, **_kw(mode))
        assert _same(td, 9.0)


def irecv_then_signal(rank, world, group, key, mode):
    """Rank 1 calls ``irecv`` into pageable host memory and signals; rank 0 sends only once signalled."""
    consolidated = MODES[mode][0]
    _warm(rank, mode)
    if rank == 0:
        td = _td(1.0, consolidated)
        wait_flag(f"{key}/irecv returned", WAIT)
        cudarecv.send(td, dst=1, **_kw(mode))
        return "sent"
    td = _td(0.0, consolidated)
    assert not td.get("a").is_pinned()  # (pageable: the case under test)
    try:
        [transfer] = cudarecv.irecv(td, src=0, return_premature=True, **_kw(mode))
    finally:
        # (also after a failure: rank 0 must not wait for good)
        set_flag(f"{key}/irecv returned")
    transfer.wait(WAIT)
    return _same(td, 1.0)


@pytest.mark.parametrize("mode", list(MODES))
def test_irecv_into_pageable_host_memory_returns_before_the_peer_sends(nccl, mode):
    results = nccl().run(
        irecv_then_signal, args=(unique_key(f"gpu-irecv-{mode}"), mode), timeout=RUN_TIMEOUT
    )
    assert results == ["sent", True], results


def isend_then_signal(rank, world, group, key, mode):
    """Rank 0 calls ``isend`` out of pageable host memory and signals; rank 1 receives only once signalled."""
    consolidated = MODES[mode][0]
    _warm(rank, mode)
    if rank == 1:
        td = _td(0.0, consolidated)
        wait_flag(f"{key}/isend returned", WAIT)
        cudarecv.recv(td, src=0, **_kw(mode))
        return _same(td, 1.0)
    td = _td(1.0, consolidated)
    assert not td.get("a").is_pinned()
    try:
        [transfer] = cudarecv.isend(td, dst=1, return_early=True, **_kw(mode))
    finally:
        set_flag(f"{key}/isend returned")
    transfer.wait(WAIT)
    return "sent"


@pytest.mark.parametrize("mode", list(MODES))
def test_isend_out_of_pageable_host_memory_returns_before_the_peer_receives(nccl, mode):
    results = nccl().run(
        isend_then_signal, args=(unique_key(f"gpu-isend-{mode}"), mode), timeout=RUN_TIMEOUT
    )
    assert results == ["sent", True], results
