"""Host memory staged over NCCL, on the CPU: ``irecv``/``isend`` never block on the peer (issue 47, defect 3).

A copy between device memory and *pageable* host memory is synchronous on a GPU: device to host it returns
once the copy has run, host to device it may first wait for the stream, so either waits for the stream's
earlier work, such as an NCCL receive the peer has not matched yet. The strict NCCL stand-in models that
(``stand_in_cuda(memory="host", pageable=True)``: ``Work.wait()`` only orders the stream, and such a copy
waits for what the stream has pending). Ordering between the ranks comes from store signals: the peer posts
its side only once the call under test has returned, so a call that waits for the peer cannot return at all
(the stand-in then fails it within its timeout, naming the op).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from cudarecv.plan.plan import plan_for
from cudarecv.testing.launch import Ranks
from cudarecv.testing.strict_nccl import NcclRuleError, StrictNccl, stand_in_cuda
from policies import holds_version, policy, set_version
from rawwire import set_flag, store, unique_key, wait_flag

TIMEOUT = 10.0  # the stand-in group's bound on every wait, and each transfer's own timeout

MODES = {  # mode: (consolidated, bucket_bytes); the storage is 12756 bytes: 4 chunks of 4096
    "consolidated": (True, None),  # one message, the stock wire
    "per-leaf": (False, None),  # three messages (one per leaf), the stock wire
    "chunks": (True, 4096),  # a header, then four chunks: the fast wire
}
# (not the fast wire's buckets of per-leaf host memory: they are staged in a device buffer of the plan's, not
# here; the stand-in's device is the CPU, and the plan unpacks a CPU staging buffer on the host at once)


def _td(fill: float, consolidated: bool) -> TensorDict:
    td = TensorDict(
        a=torch.full((3000,), fill),
        b=torch.arange(77, dtype=torch.float64) + fill,
        c=TensorDict(d=torch.full((5, 7), -fill), batch_size=[]),
        batch_size=[],
    )
    return td.consolidate(metadata=True) if consolidated else td


def _same(td: TensorDict, fill: float) -> bool:
    want = _td(fill, False)
    return all(torch.equal(td.get(k), want.get(k)) for k in want.keys(True, True))


def _outcome(call):
    try:
        return "ok", call()
    except NcclRuleError as error:
        return "NcclRuleError", str(error)
    except cudarecv.Error as error:
        return type(error).__name__, str(error)


def _kw(mode: str) -> dict:
    consolidated, bucket_bytes = MODES[mode]
    return dict(consolidated=consolidated, bucket_bytes=bucket_bytes, timeout=TIMEOUT)


def _warm(pg, rank: int, mode: str) -> None:
    """One transfer rank 0 -> rank 1 as the test's, both ends posting at once: NCCL makes a communicator
    with both ranks inside their first op on it (the group's, for a batch), which no test here is about."""
    consolidated = MODES[mode][0]
    td = _td(9.0 if rank == 0 else 0.0, consolidated)
    if rank == 0:
        cudarecv.send(td, group=pg, group_dst=1, **_kw(mode))
    else:
        cudarecv.recv(td, group=pg, group_src=0, **_kw(mode))
        assert _same(td, 9.0)


def irecv_then_signal(rank, world, group, key, mode):
    """Rank 1 calls ``irecv`` into pageable host memory, then signals; rank 0 sends only once signalled."""
    consolidated = MODES[mode][0]
    with stand_in_cuda("host", pageable=True):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)
        _warm(pg, rank, mode)
        if rank == 0:
            wait_flag(f"{key}/irecv returned", 3 * TIMEOUT)
            return _outcome(
                lambda: cudarecv.send(_td(1.0, consolidated), group=pg, group_dst=1, **_kw(mode))
            )
        td = _td(0.0, consolidated)
        assert not td.get("a").is_pinned()  # (pageable: the case under test)
        try:
            started = _outcome(
                lambda: cudarecv.irecv(
                    td, group=pg, group_src=0, return_premature=True, **_kw(mode)
                )
            )
        finally:
            # (also after a failure: rank 0 must not wait for good)
            set_flag(f"{key}/irecv returned")
        if started[0] != "ok":
            return started
        [transfer] = started[1]
        waited = _outcome(lambda: transfer.wait(3 * TIMEOUT))
        return waited[0], _same(td, 1.0)


@pytest.mark.parametrize("mode", list(MODES))
def test_irecv_into_pageable_host_memory_returns_before_the_peer_sends(cluster, mode):
    """``irecv`` of a host tensordict over NCCL posts its receives and returns; the peer sends only then.

    Before the fix the stock wire's receive (consolidated, per-leaf) copied each message into pageable host
    memory in the call that posted it, which waited for the message: the call never returned (the stand-in
    failed it after its timeout)."""
    sent, got = cluster().run(
        irecv_then_signal, args=(unique_key(f"irecv-{mode}"), mode), timeout=8 * TIMEOUT
    )
    assert got == ("ok", True), got
    assert sent == ("ok", None), sent


def isend_then_signal(rank, world, group, key, mode):
    """Rank 0 calls ``isend`` out of pageable host memory, then signals; rank 1 receives only once signalled."""
    consolidated = MODES[mode][0]
    with stand_in_cuda("host", pageable=True):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)
        _warm(pg, rank, mode)
        if rank == 1:
            wait_flag(f"{key}/isend returned", 3 * TIMEOUT)
            td = _td(0.0, consolidated)
            got = _outcome(lambda: cudarecv.recv(td, group=pg, group_src=0, **_kw(mode)))
            return got[0], _same(td, 1.0)
        td = _td(1.0, consolidated)
        try:
            started = _outcome(
                lambda: cudarecv.isend(td, group=pg, group_dst=1, return_early=True, **_kw(mode))
            )
        finally:
            set_flag(f"{key}/isend returned")
        if started[0] != "ok":
            return started
        [transfer] = started[1]
        return _outcome(lambda: transfer.wait(3 * TIMEOUT))


@pytest.mark.parametrize("mode", list(MODES))
def test_isend_out_of_pageable_host_memory_returns_before_the_peer_receives(cluster, mode):
    """``isend`` of a host tensordict over NCCL posts every message and returns; the peer receives only then.

    Before the fix the stock and fast wires' sends of more than two messages (per-leaf, chunks) copied
    message 3 out of pageable memory after waiting for the send of message 1 to leave, i.e. for the peer's
    receive: the call never returned."""
    sent, got = cluster().run(
        isend_then_signal, args=(unique_key(f"isend-{mode}"), mode), timeout=8 * TIMEOUT
    )
    assert sent == ("ok", None), sent
    assert got == ("ok", True), got


def exchange(rank, world, group, key, mode):
    """Each rank calls ``irecv`` from the other, then ``isend`` to it, then waits for both."""
    consolidated = MODES[mode][0]
    with stand_in_cuda("host", pageable=True):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)
        _warm(pg, rank, mode)
        peer, got = 1 - rank, _td(0.0, consolidated)
        out = {}
        started = _outcome(
            lambda: cudarecv.irecv(
                got, group=pg, group_src=peer, return_premature=True, **_kw(mode)
            )
        )
        out["irecv"] = started[0]
        if started[0] != "ok":
            return out
        sending = _outcome(
            lambda: cudarecv.isend(
                _td(float(rank + 1), consolidated),
                group=pg,
                group_dst=peer,
                return_early=True,
                **_kw(mode),
            )
        )
        out["isend"] = sending[0]
        if sending[0] == "ok":
            out["send"] = _outcome(lambda: sending[1][0].wait(3 * TIMEOUT))[0]
        out["recv"] = _outcome(lambda: started[1][0].wait(3 * TIMEOUT))[0]
        return out


def test_an_exchange_on_one_nccl_pair_returns_and_fails_in_time(cluster):
    """Two ranks that each ``irecv`` then ``isend`` a consolidated host tensordict: both calls return (before the
    fix ``irecv`` waited for the peer's send, which the peer, waiting in its own ``irecv``, never posted), and
    each transfer ends within its own timeout, the first receive to time out failing. It cannot complete on NCCL:
    single ops of both directions go on the pair's one communicator and stream, where each rank's send waits
    behind its receive, which waits for the other's send (the stand-in's one stream per process waits the same
    way); what was queued behind the receive that timed out may then end ok."""
    results = cluster().run(
        exchange, args=(unique_key("exchange"), "consolidated"), timeout=8 * TIMEOUT
    )
    ended = ("ok", "TransferTimeout", "NcclRuleError")
    for out in results:
        assert out["irecv"] == "ok" and out["isend"] == "ok", results
        # each ends in time (none is left waiting past its bound); once the first receive has timed out, the send
        # queued behind it may meet the peer's receive, still posted, and end ok, and so may what follows it
        assert out["send"] in ended and out["recv"] in ended, results
    assert any(out[kind] != "ok" for out in results for kind in ("send", "recv")), results


def four_transfers(rank, world, group, key, mode, memory):
    """Four transfers rank 0 -> rank 1, each rank's memory as given (host: pageable); the receiver's staging
    allocations after each."""
    consolidated = MODES[mode][0]
    with stand_in_cuda(memory[rank], pageable=memory[rank] == "host"):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)

        def run():
            seen, allocations = [], []
            td = _td(0.0, consolidated)
            for step in range(4):
                if rank == 0:
                    cudarecv.send(
                        _td(float(step + 1), consolidated), group=pg, group_dst=1, **_kw(mode)
                    )
                else:
                    cudarecv.recv(td, group=pg, group_src=0, **_kw(mode))
                    seen.append(_same(td, float(step + 1)))
                    allocations.append(
                        plan_for(td, layout=MODES[mode][1] is not None).pool.allocations
                    )
            return seen, allocations

        return _outcome(run), sorted({op[0] for op in pg.ops})


@pytest.mark.parametrize(
    "memory",
    [("host", "host"), ("device", "host"), ("host", "device")],
    ids=["host-host", "device-host", "host-device"],
)
@pytest.mark.parametrize("mode", list(MODES))
def test_pageable_staging_matches_and_allocates_once(cluster, mode, memory):
    """Through pinned staging, both ends still post on one communicator in one order, every value is exact,
    and the receiver allocates no staging in steady state (the fast wire's first transfer and second, whose
    control messages differ in size, each allocate their own)."""
    (sent, comms0), (got, comms1) = cluster().run(
        four_transfers, args=(unique_key(f"four-{mode}"), mode, memory), timeout=8 * TIMEOUT
    )
    assert sent[0] == "ok", sent
    assert got[0] == "ok", got
    seen, allocations = got[1]
    assert seen == [True] * 4, got
    assert allocations[1] == allocations[2] == allocations[3], allocations
    assert comms0 == comms1, (comms0, comms1)


class _Unfired:
    """A fence whose copy never runs (a failed transfer's, queued behind a send that is never received)."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise AssertionError("the host waited for a fence that never fires")


def staged_send(rank, world, group, stale):
    """Rank 0 alone: the first step of a send of two messages out of pageable memory, through a lane whose
    posts are only recorded; the pool's pinned buffer fenced by a copy that never runs when ``stale``."""
    if rank != 0:
        return None
    from cudarecv.core.link import Link
    from cudarecv.core.streams import StagingPool
    from cudarecv.wire import staging

    class Recording(staging.Lane):
        def post(self, sending, tensors, tags):
            return []

    with stand_in_cuda("host", pageable=True):
        pool = StagingPool()
        lane = Recording(Link(None, 1, False, "nccl"), torch.cuda.Stream(), pool)
        srcs = [torch.arange(40, dtype=torch.uint8), torch.arange(100, 124, dtype=torch.uint8)]
        pooled = pool.buffers("pinned", 64, count=1)[0]
        pooled.fill_(7)
        if stale:
            pool.set_fence(pooled, _Unfired())
        protocol = staging.send_from(lane, srcs, [0, 0])
        works = next(protocol)  # the first step: every message posted
        for work in works:
            work.wait()
        ring = pool.buffers(torch.device("cpu"), 40, count=2)
        sent = [ring[0][:40].tolist(), ring[1][:24].tolist()]
        with pytest.raises(StopIteration):
            next(protocol)
        return {
            "sent": sent == [t.tolist() for t in srcs],
            "pooled used": pooled.tolist() == torch.cat(srcs).tolist(),
            "pooled untouched": pooled.tolist() == [7] * 64,
            "fence kept": isinstance(pool.fence(pooled), _Unfired),
        }


def test_a_send_never_waits_for_a_stale_pinned_buffer(cluster):
    """The pool's pinned buffer stages the send; one that a failed transfer's copy may still read (its fence has
    not fired) is left alone, and the send stages through a buffer of its own instead of waiting in the call."""
    fresh = cluster().run(staged_send, args=(False,))[0]
    assert fresh == {
        "sent": True,
        "pooled used": True,
        "pooled untouched": False,
        "fence kept": False,
    }, fresh
    stale = cluster().run(staged_send, args=(True,))[0]
    assert stale == {
        "sent": True,
        "pooled used": False,
        "pooled untouched": True,
        "fence kept": True,
    }, stale


def pinned_model(rank, world, group):
    """The stand-in's model itself: which copies wait for the stream, and what ``is_pinned`` says."""
    with stand_in_cuda("host", pageable=True):
        pageable = torch.zeros(8)
        pinned = torch.zeros(8, pin_memory=True)
        device = torch.zeros(8, device=torch.device("cpu"))
        return {
            "pageable pinned": pageable.is_pinned(),
            "pinned pinned": pinned.is_pinned(),
            "pin_memory() pinned": pageable.pin_memory().is_pinned(),
            "view of pinned pinned": pinned[2:].is_pinned(),
            "device pinned": device.is_pinned(),
        }


def test_the_pageable_model_tells_pinned_from_pageable(cluster):
    out = cluster().run(pinned_model)[0]
    assert out == {
        "pageable pinned": False,
        "pinned pinned": True,
        "pin_memory() pinned": True,
        "view of pinned pinned": True,
        "device pinned": False,
    }, out


def blocked_copy(rank, world, group, key):
    """A receive waited for on the stream, then a copy of a device buffer into pageable or pinned memory."""
    with stand_in_cuda("host", pageable=True):
        pg = StrictNccl(store(), rank, world, timeout=2.0, name=key)
        if rank == 0:
            wait_flag(f"{key}/done", 30)
            return None
        device = torch.zeros(8, device=torch.device("cpu"))
        pg.recv([device], 0, 0).wait()  # never matched: rank 0 sends nothing
        out = {"pinned": _outcome(lambda: torch.zeros(8, pin_memory=True).copy_(device, True))[0]}
        out["pageable"] = _outcome(lambda: torch.zeros(8).copy_(device, non_blocking=True))[0]
        set_flag(f"{key}/done")
        return out


def test_the_pageable_model_blocks_where_cuda_does(cluster):
    """(The rule the tests above lean on, shown to bite: the copy into pageable memory waits for the unmatched
    receive and fails within the stand-in's timeout; into pinned memory it does not wait.)"""
    out = cluster().run(blocked_copy, args=(unique_key("blocked"),), timeout=60)[1]
    assert out == {"pinned": "ok", "pageable": "NcclRuleError"}, out


@pytest.fixture(scope="module")
def three():
    ranks = Ranks(3, pg_timeout=60.0)
    yield ranks
    ranks.close()


def weight_sync(rank, world, group, key, fanout):
    """Weight sync over the strict group from device memory to a receiver in pageable host memory (rank 1) and
    one in device memory (rank 2): a star, or a relay through rank 1 (which forwards out of host memory)."""
    model = policy()
    memory = "host" if rank == 1 else "device"
    with stand_in_cuda(memory, pageable=memory == "host"):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)
        if rank == 0:

            def push_all():
                with cudarecv.WeightSender(
                    TensorDict.from_module(model),
                    group=pg,
                    group_dst=[1, 2],
                    bucket_bytes=1024,
                    timeout=TIMEOUT,
                    fanout=fanout,
                ) as sender:
                    for version in (1, 2, 3):
                        set_version(model, version)
                        sender.push()
                    return sender.fanout

            return _outcome(push_all)

        def pull_all():
            with cudarecv.WeightReceiver(
                group=pg, group_src=0, expect=model, timeout=TIMEOUT
            ) as receiver:
                held = []
                for _ in range(3):
                    version = receiver.pull()
                    held.append(holds_version(receiver.td, version))
                return held

        return _outcome(pull_all)


def test_weight_sync_into_pageable_host_memory(three):
    """A weight receiver in pageable host memory pulls every version exact through the pinned staging.

    (Not a relay through it: the stand-in's one stream per process puts the relay's receive from upstream
    behind its forward downstream, a wait cycle that separate streams do not have; it fails this way with
    and without pinned staging.)"""
    results = three().run(weight_sync, args=(unique_key("w-star"), "star"), timeout=8 * TIMEOUT)
    assert results[0] == ("ok", "star"), results
    assert results[1:] == [("ok", [True, True, True])] * 2, results
