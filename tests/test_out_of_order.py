"""Receives posted out of the sender's order time out; what the link does for fresh tensordicts afterwards.

gloo matches messages with one tag in order and cannot take back a posted receive or send: after a transfer
timed out, a fresh tensordict on one of its tags could take its late message (or a stale receive take the
fresh one's). Such a call is refused at once (``LinkError`` naming the tag), in the direction that timed
out; other tags and new process groups go on.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from rawwire import store, unique_key

SHORT = 1.5  # seconds: the out-of-order pair's own timeout


def _outcome(call, *args, **kwargs) -> tuple[str, str, float]:
    started = time.monotonic()
    try:
        call(*args, **kwargs)
        return "ok", "", time.monotonic() - started
    except cudarecv.Error as error:
        return type(error).__name__, str(error), time.monotonic() - started


def _wait(transfer) -> tuple[str, str]:
    try:
        transfer.wait()
        return "ok", ""
    except cudarecv.Error as error:
        return type(error).__name__, str(error)


def out_of_order_then_fresh(rank, world, group, key):
    """Rank 0 sends A (init_tag 0) then B (init_tag 1); rank 1 receives B, then A, both with a short timeout
    (the link's thread sends A, whose receive waits behind B's on the receiver's link thread: both time out).
    Then both ranks move a fresh tensordict C (another key and dtype) on init_tag 0 of the same link."""
    pg = dist.new_group([0, 1], backend="gloo")
    a = TensorDict(a=torch.full((1000,), 1.0 if rank == 0 else 0.0))
    b = TensorDict(b=torch.full((10,), 2.0 if rank == 0 else 0.0))
    c = TensorDict(c=torch.full((7,), 3.0 if rank == 0 else 0.0, dtype=torch.float64))
    peer = {"group_dst": 1} if rank == 0 else {"group_src": 0}
    kw = dict(group=pg, bucket_bytes=1 << 10, transport="auto", **peer)
    if rank == 0:
        pair = [
            cudarecv.isend(td, init_tag=tag, return_early=True, timeout=SHORT, **kw)[0]
            for td, tag in ((a, 0), (b, 1))
        ]
    else:
        pair = [
            cudarecv.irecv(td, init_tag=tag, return_premature=True, timeout=SHORT, **kw)[0]
            for td, tag in ((b, 1), (a, 0))
        ]
    first = [_wait(t) for t in pair]
    _both_at(f"{key}_pair", rank)  # neither posts C before the other's pair has ended
    fresh = _outcome(cudarecv.send if rank == 0 else cudarecv.recv, c, timeout=5.0, **kw)
    _both_at(f"{key}_end", rank)  # the group outlives the other's last call
    return first, fresh


def _both_at(key: str, rank: int) -> None:
    store().set(f"{key}_{rank}", "1")
    store().wait([f"{key}_{1 - rank}"], timedelta(seconds=30))


def test_a_fresh_tensordict_on_a_timed_out_tag_is_refused_at_once(cluster):
    try:
        results = cluster().run(out_of_order_then_fresh, args=(unique_key("order"),), timeout=120)
    finally:
        cluster().close()  # the pair's messages stay posted
    for rank, (first, (kind, message, _)) in enumerate(results):
        assert [k for k, _ in first] == ["TransferTimeout"] * 2, (rank, first)
        # before: the receiver's C took A's late header (HeaderError), the sender's C timed out
        assert kind == "LinkError", (rank, kind, message)
        assert "on tag 1073741824 failed (it timed out after 1.5 s)" in message, (rank, message)
        assert "pass another init_tag" in message, (rank, message)
    assert "refused for sends on this link" in results[0][0][0][1], results[0][0]
    assert "refused for receives on this link" in results[1][0][0][1], results[1][0]


def timed_out_receive_then_fresh(rank, world, group, key):
    """On the wire alone: rank 1's receive of A (init_tag 0) times out, nothing sent; then rank 1 receives C,
    another tensordict: on A's tags (refused at once: A's stale receive would take C's header), then on
    init_tag 5, where rank 0 sends it."""
    pg = dist.new_group([0, 1], backend="gloo")
    c = TensorDict(c=torch.full((10,), 3.0 if rank == 0 else 0.0))
    kw = dict(group=pg, bucket_bytes=1 << 10, transport="wire")
    if rank == 0:
        store().wait([key], timedelta(seconds=30))  # A's receive has timed out
        cudarecv.send(c, group_dst=1, init_tag=5, timeout=20, **kw)
        _both_at(f"{key}_end", rank)
        return None
    timed_out = _outcome(
        cudarecv.recv, TensorDict(a=torch.zeros(10)), group_src=0, timeout=SHORT, **kw
    )
    store().set(key, "1")
    refused = _outcome(cudarecv.recv, c, group_src=0, timeout=3.0, **kw)
    other = _outcome(cudarecv.recv, c, group_src=0, init_tag=5, timeout=20, **kw)
    exact = bool((c["c"] == 3.0).all())
    _both_at(f"{key}_end", rank)
    return timed_out, refused, other, exact


def test_a_timed_out_receive_refuses_its_tags_and_other_tags_go_on(cluster):
    try:
        _, (timed_out, refused, other, exact) = cluster().run(
            timed_out_receive_then_fresh, args=(unique_key("stale"),), timeout=120
        )
    finally:
        cluster().close()  # A's receive stays posted
    assert timed_out[0] == "TransferTimeout", timed_out
    # before: C's receive waited on A's tags behind A's stale receive, and timed out
    assert refused[0] == "LinkError" and "receive from rank 0 on tag 1073741824" in refused[1], (
        refused
    )
    assert other[0] == "ok" and exact, (other, exact)
