"""Same-host links after a transfer ran out of its own time: other init_tags go on, nothing is left behind.

A fast-wire send through shared memory ends once the receiver has taken its header and ``READY``; one whose
receiver never posts leaves the link's sending thread waiting in gloo. Later sends on other tags get a thread of
their own and go on the wire (the failed one's segments are never written again), and its segments are let go.
Receives are taken in call order by the link's thread: posted out of the sender's order they wait for each other
and time out, saying so.
"""

from __future__ import annotations

import contextlib
import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.samehost import sides
from cudarecv.samehost.channels import ChannelState
from cudarecv.samehost.send_side import SendSide
from rawwire import set_flag, store, unique_key, wait_flag

SHORT = 2.0  # seconds: the own timeout of the transfer expected to time out
LONG = 60.0  # seconds: the own timeout of a transfer that must succeed


def _group(rank: int, world: int, key: str) -> object:
    """A new gloo group of the two ranks (on a prefix of the default store)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(key, store()), rank, world, timedelta(seconds=30))


def _outcome(transfer) -> tuple[str, str]:
    try:
        transfer.wait()
        return "ok", transfer.transport
    except cudarecv.Error as error:
        return type(error).__name__, str(error)


def _memfds() -> int:
    """How many memfd segments this process holds a descriptor of."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += "memfd:cudarecv" in os.readlink(f"/proc/self/fd/{fd}")
    return count


def _link_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t.name.startswith(("cudarecv-send-", "cudarecv-recv-"))
    ]


def _threads_left(before: set[int], pg: object) -> list[str]:
    """The link threads started since ``before`` still alive once the group's sides are closed as the group's
    collection closes them (each joined for up to 10 s: a thread told to stop ends once its gloo wait returns;
    the group itself lives on while the failed transfer's works are parked)."""
    sides.close_all(sides.sides_of(pg))
    started = [t for t in _link_threads() if t.ident not in before]
    for thread in started:
        thread.join(10.0)
    return [t.name for t in started if t.is_alive()]


def _send_side(pg: object) -> SendSide:
    return sides.sides_of(pg)[(1, "send")]


def timed_out_send_then_other_tags(rank, world, group, key, negotiate):
    """Rank 0 sends A (init_tag 1) with a short timeout that rank 1 does not receive (after ``negotiate``
    transfers on init_tag 0: 2 makes the link share memory, 0 leaves A the offer). Then B on init_tag 2 both
    ways round, then rank 1 takes A late (its messages are still posted), then the group goes."""
    before = {t.ident for t in _link_threads()}
    pg = _group(rank, world, key)
    kw = dict(
        group=pg,
        bucket_bytes=1 << 12,
        transport="auto",
        **({"group_dst": 1} if rank == 0 else {"group_src": 0}),
    )
    fill = 1.0 if rank == 0 else 0.0
    warm, a, b = (TensorDict(x=torch.full((4096,), fill * k)) for k in (1, 2, 3))
    routes = []
    for _ in range(negotiate):
        if rank == 0:
            routes.append(
                _outcome(cudarecv.isend(warm, init_tag=0, timeout=LONG, return_early=True, **kw)[0])
            )
        else:
            routes.append(
                _outcome(
                    cudarecv.irecv(warm, init_tag=0, timeout=LONG, return_premature=True, **kw)[0]
                )
            )
    if rank == 0:
        fds = _memfds()
        first = _outcome(cudarecv.isend(a, init_tag=1, timeout=SHORT, return_early=True, **kw)[0])
        side = _send_side(pg)
        host = side.channels["host"]
        kept = (host.state, len(host.segments), _memfds() - fds)
        set_flag(f"{key}_a")
        second = _outcome(cudarecv.isend(b, init_tag=2, timeout=LONG, return_early=True, **kw)[0])
        wait_flag(f"{key}_late")
        result = routes, first, kept, second
    else:
        wait_flag(f"{key}_a")
        first = _outcome(
            cudarecv.irecv(b, init_tag=2, timeout=LONG, return_premature=True, **kw)[0]
        )
        second = _outcome(
            cudarecv.irecv(a, init_tag=1, timeout=LONG, return_premature=True, **kw)[0]
        )
        exact = bool((b["x"] == 3.0).all()), bool((a["x"] == 2.0).all())
        set_flag(f"{key}_late")
        result = routes, first, second, exact
    set_flag(f"{key}_done_{rank}")
    wait_flag(f"{key}_done_{1 - rank}")  # neither drops the group while the other uses it
    return result, _threads_left(before, pg)


def _check_timed_out_send(results, negotiated: bool) -> None:
    ((routes, first, kept, second), sender_left), ((_, got_b, got_a, exact), receiver_left) = (
        results
    )
    if negotiated:
        assert routes[-1] == ("ok", "shared memory"), routes
    assert first[0] == "TransferTimeout" and "refused for sends" in first[1], first
    # before: the side kept its state ("shared", or "new" and the two segments A offered)
    assert kept == (ChannelState.WIRE, 0, 0), kept
    # before: B waited behind A on the link's stuck thread and timed out after 60 s on both ends
    assert second == ("ok", "wire") and got_b == ("ok", "wire"), (second, got_b)
    assert got_a[0] == "ok" and exact == (True, True), (got_a, exact)
    assert sender_left == [] and receiver_left == [], (sender_left, receiver_left)


def test_a_timed_out_send_through_shared_memory_leaves_other_tags_usable(cluster):
    try:
        results = cluster().run(
            timed_out_send_then_other_tags, args=(unique_key("send_late"), 2), timeout=240
        )
    finally:
        cluster().close()  # (whatever failed may have left messages posted)
    _check_timed_out_send(results, negotiated=True)


def test_a_timed_out_offer_lets_its_segments_go_and_other_tags_go_on(cluster):
    try:
        results = cluster().run(
            timed_out_send_then_other_tags, args=(unique_key("offer_late"), 0), timeout=240
        )
    finally:
        cluster().close()
    _check_timed_out_send(results, negotiated=False)


def receives_out_of_order(rank, world, group, key, negotiate):
    """Rank 0 sends A (init_tag 1) then B (init_tag 2) with a short timeout; rank 1 posts B's receive, then A's
    (after ``negotiate`` transfers on init_tag 0: 0 leaves A the offer of a fresh link)."""
    pg = _group(rank, world, key)
    kw = dict(
        group=pg,
        bucket_bytes=1 << 12,
        transport="auto",
        **({"group_dst": 1} if rank == 0 else {"group_src": 0}),
    )
    warm, a, b = (
        TensorDict(x=torch.full((4096,), float(k) if rank == 0 else 0.0)) for k in (1, 2, 3)
    )
    routes = []
    for _ in range(negotiate):
        call = cudarecv.isend if rank == 0 else cudarecv.irecv
        routes.append(
            _outcome(
                call(
                    warm,
                    init_tag=0,
                    timeout=LONG,
                    **{"return_early" if rank == 0 else "return_premature": True},
                    **kw,
                )[0]
            )
        )
    if rank == 0:
        pair = [
            cudarecv.isend(td, init_tag=k, timeout=SHORT, return_early=True, **kw)[0]
            for k, td in ((1, a), (2, b))
        ]
    else:
        pair = [
            cudarecv.irecv(td, init_tag=k, timeout=SHORT, return_premature=True, **kw)[0]
            for k, td in ((2, b), (1, a))
        ]
    outcomes = [_outcome(t) for t in pair]
    set_flag(f"{key}_done_{rank}")
    wait_flag(f"{key}_done_{1 - rank}")  # neither drops the group while the other uses it
    return routes, outcomes


@pytest.mark.parametrize("negotiate", [0, 2], ids=["fresh_link", "shared_link"])
def test_receives_posted_out_of_order_time_out_saying_so(cluster, negotiate):
    try:
        (routes, sent), (_, received) = cluster().run(
            receives_out_of_order, args=(unique_key("order"), negotiate), timeout=120
        )
    finally:
        cluster().close()  # the pair's messages stay posted
    if negotiate:
        assert routes[-1] == ("ok", "shared memory"), routes
    assert [kind for kind, _ in sent + received] == ["TransferTimeout"] * 4, (sent, received)
    first, later = received
    assert "queued behind" not in first[1], first  # B's receive ran: it waited for B's header
    # before: "receive of the fast-wire header (tag 1073741825): rank 0 did not answer within 2 s (does the sender
    # send on the fast wire too ...?)"
    assert (
        "queued behind an earlier receive from rank 0 on this link's thread" in later[1]
        and "were the receives posted in the order of its sends?" in later[1]
    ), later
    # (its tags are refused all the same: the sender's A may still come on them)
    assert (
        "tags 1073741825 and 1342177281 for any tensordict, are refused for receives" in later[1]
    ), later


def queued_receive_times_out(rank, world, group, key):
    """On a fresh link rank 1 posts R1 (init_tag 0), R2 (init_tag 5, a short timeout: it runs out while queued
    behind R1), then, once R2 has timed out, R3 (init_tag 0 again); only then rank 0 sends R1's and R3's
    tensordicts (the first with the offer, after its header on the header's tag)."""
    pg = _group(rank, world, key)
    kw = dict(
        group=pg,
        bucket_bytes=1 << 12,
        transport="auto",
        **({"group_dst": 1} if rank == 0 else {"group_src": 0}),
    )
    one, three = (TensorDict(x=torch.full((4096,), float(k) if rank == 0 else 0.0)) for k in (1, 3))
    if rank == 0:
        wait_flag(f"{key}_posted")
        result = [
            _outcome(cudarecv.isend(td, init_tag=0, timeout=LONG, return_early=True, **kw)[0])
            for td in (one, three)
        ]
    else:
        first = cudarecv.irecv(one, init_tag=0, timeout=LONG, return_premature=True, **kw)[0]
        queued = _outcome(
            cudarecv.irecv(
                TensorDict(x=torch.zeros(8)), init_tag=5, timeout=SHORT, return_premature=True, **kw
            )[0]
        )
        third = cudarecv.irecv(three, init_tag=0, timeout=LONG, return_premature=True, **kw)[0]
        set_flag(f"{key}_posted")
        result = [
            queued,
            _outcome(first),
            _outcome(third),
            (bool((one["x"] == 1.0).all()), bool((three["x"] == 3.0).all())),
        ]
    set_flag(f"{key}_done_{rank}")
    wait_flag(f"{key}_done_{1 - rank}")
    return result


def test_a_receive_timed_out_in_the_queue_keeps_the_links_order(cluster):
    try:
        sent, (queued, first, third, exact) = cluster().run(
            queued_receive_times_out, args=(unique_key("queue"),), timeout=240
        )
    finally:
        cluster().close()
    assert queued[0] == "TransferTimeout" and "queued behind an earlier receive" in queued[1], (
        queued
    )
    # before: R2's timeout gave the link a new thread, where R3 posted its header receive beside R1's: it took
    # the offer (OutOfStepError) and R1, whose offer receive then waited for R3's header, timed out after 60 s
    assert first == ("ok", "wire") and third == ("ok", "shared memory") and exact == (True, True), (
        first,
        third,
    )
    assert sent == [("ok", "wire"), ("ok", "shared memory")], sent
