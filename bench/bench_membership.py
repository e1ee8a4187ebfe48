"""Elastic weight sync: receivers that joined through a store against ranks of one group, side by side.

Nine ranks on this machine (a trainer and 8 actors, gloo over loopback), a 16 MB model (16 float32 leaves):

- ``push``: sync mode, the trainer's ``push()`` time (it returns once all 8 hold the version), over the
  same-host transport (``auto``: shared memory), over the wire (``transport="wire"``) and through a relay
  chain on the wire (``relay``: ``fanout="relay"``; joined receivers' neighbours form pairs of their own), with
  the 8 as ranks of the world group (``dst=[1..8]``) and as receivers that joined one by one through a
  TCPStore (``ElasticSender(store=..., name=...)``); the modes alternate round by round;
- ``join``: latest mode, from an actor's ``ElasticReceiver(store=..., name=...)`` until its first ``pull()``
  returned the version published (the pair formed, the handshake, the transfer), 8 actors x 3 joins each.

Each bench's rounds are the times its mode measured, replayed through a virtual clock (``stats.median``).
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.testing.launch import Ranks
from cudarecv.tools import transfer_ranks as tb

ACTORS = 8
MODEL_BYTES = 16 * 10**6
ROUNDS = 15
JOINS = 3
PUSH_MODES = [
    (who, transport) for transport in ("auto", "wire", "relay") for who in ("fixed ranks", "joined")
]

CLOCK = tb.VirtualClock("membership_clock")
pytestmark = [pytest.mark.timeout(900), pytest.mark.benchmark(timer=CLOCK)]
_RESULTS: dict = {}


def _model(fill: float) -> TensorDict:
    return TensorDict(
        {f"layer{i:02d}": torch.full((MODEL_BYTES // 16 // 4,), fill) for i in range(16)}
    )


def _store(rank: int) -> dist.TCPStore:
    """A TCPStore hosted by rank 0, its port told to the others through the world group."""
    port = [0]
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=120),
        )
        port = [store.port]
    dist.broadcast_object_list(port, src=0)
    if rank:
        store = dist.TCPStore(
            "127.0.0.1", port[0], is_master=False, timeout=datetime.timedelta(seconds=120)
        )
    return store


def _sending(transport: str) -> dict:
    """A sender's options for a mode's transport (``relay``: a relay chain on the wire)."""
    return (
        {"transport": "wire", "fanout": "relay"}
        if transport == "relay"
        else {"transport": transport}
    )


def time_membership(rank: int, world: int, group) -> dict:
    store = _store(rank)
    out: dict = {"push": {}, "join": [], "ok": True}
    ends = {}
    for who, transport in PUSH_MODES:  # set up: the fixed ranks' handshake, or the joins one by one
        name = f"bench-{transport}"
        if who == "fixed ranks":
            if rank == 0:
                ends[who, transport] = cudarecv.WeightSender(
                    _model(0), dst=list(range(1, world)), **_sending(transport)
                )
            else:
                ends[who, transport] = cudarecv.WeightReceiver(
                    src=0, transport=_sending(transport)["transport"]
                )
            continue
        if rank == 0:
            ends[who, transport] = cudarecv.ElasticSender(
                _model(0), store=store, name=name, **_sending(transport)
            )
        for joiner in range(1, world):  # one by one
            if rank == joiner:
                ends[who, transport] = cudarecv.ElasticReceiver(
                    store=store, name=name, transport=_sending(transport)["transport"]
                )
            dist.barrier()
    for _ in range(ROUNDS):
        for mode in PUSH_MODES:
            dist.barrier()
            end = ends[mode]
            if rank == 0:
                started = time.perf_counter()
                end.push()
                out["push"].setdefault(f"{mode[0]} {mode[1]}", []).append(
                    time.perf_counter() - started
                )
            else:
                version = end.pull()
                out["ok"] &= version == end.version
    for end in ends.values():
        end.close()
    dist.barrier()
    # join-to-first-version: latest mode, a version published before each join
    sender = None
    if rank == 0:
        sender = cudarecv.ElasticSender(_model(1), store=store, name="bench-join", mode="latest")
        sender.push()
    dist.barrier()
    for _ in range(JOINS):
        for joiner in range(1, world):
            if rank == joiner:
                started = time.perf_counter()
                receiver = cudarecv.ElasticReceiver(store=store, name="bench-join")
                version = receiver.pull()
                out["join"].append(time.perf_counter() - started)
                with receiver.reading() as td:
                    out["ok"] &= version == 1 and bool((td["layer00"] == 1).all())
                receiver.close()
            dist.barrier()
    if sender is not None:
        out["receivers"] = len(sender.receivers)
        sender.close()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def nine_ranks():
    ranks = Ranks(ACTORS + 1, pg_timeout=120.0)
    yield ranks
    ranks.close()


def _results(nine_ranks) -> dict:
    if not _RESULTS:
        out = nine_ranks.get().run(time_membership, timeout=840)
        _RESULTS.update(
            push=out[0]["push"],
            join=[s for o in out[1:] for s in o["join"]],
            ok=all(o["ok"] for o in out),
        )
    return _RESULTS


@pytest.mark.parametrize(
    "who, transport", PUSH_MODES, ids=[f"{w.replace(' ', '-')}-{t}" for w, t in PUSH_MODES]
)
def test_push_to_8(benchmark, nine_ranks, who, transport):
    results = _results(nine_ranks)
    seconds = results["push"][f"{who} {transport}"]
    benchmark.extra_info.update(
        case=f"push {MODEL_BYTES // 10**6} MB to {ACTORS} receivers",
        impl="cudarecv",
        mode=f"{who}, transport={transport}",
        bytes=MODEL_BYTES,
        backend="gloo",
        ok=results["ok"],
    )
    tb.replay(benchmark, CLOCK, seconds)
    assert results["ok"], "a receiver held a wrong version"


def test_join_to_first_version(benchmark, nine_ranks):
    results = _results(nine_ranks)
    benchmark.extra_info.update(
        case=f"join to first version, {MODEL_BYTES // 10**6} MB",
        impl="cudarecv",
        mode="ElasticReceiver(store=...) + first pull (latest)",
        bytes=MODEL_BYTES,
        backend="gloo",
        ok=results["ok"],
    )
    tb.replay(benchmark, CLOCK, results["join"])
    assert results["ok"], "a receiver held a wrong version"
