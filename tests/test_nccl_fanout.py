"""A weight sender's star push over NCCL, on the CPU: the strict NCCL stand-in with NCCL's completion of a send.

On NCCL a posted send's ``Work`` is done once it is enqueued on the pair's stream, not once the peer has the
bytes; a send whose peer never posts the matching receive stays posted for good (torch's watchdog then takes the
process down once the group's timeout has passed). :class:`~cudarecv.testing.strict_nccl.StrictNccl` with
``sends_done_at_posting=True`` completes sends so. A push must still return only once each receiver said it has
the version, drop a receiver that never pulls within the push's timeout, and leave nothing posted that NCCL
cannot end: it aborts that receiver's process group (docs/weight-sync.md, "NCCL failure semantics"). The same on
a GPU: ``tests/test_gpu_fanout.py``.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from cudarecv.testing.launch import Ranks
from cudarecv.testing.strict_nccl import StrictNccl, stand_in_cuda
from policies import holds_version, policy, set_version
from rawwire import store, unique_key

PUSH_TIMEOUT = 5.0  # the sender's: a receiver that has not said it has a version by then is dropped
GROUP_TIMEOUT = 60.0  # the stand-in's (NCCL's group timeout): far past the push's
SLACK = 10.0  # what a loaded machine may add to the push's timeout before the drop is seen
WAIT = 120.0  # every wait for another rank's signal


@pytest.fixture(scope="module")
def three():
    ranks = Ranks(3, pg_timeout=60.0)
    yield ranks
    ranks.close()


def _outcome(call):
    try:
        return "ok", call()
    except cudarecv.Error as error:
        return type(error).__name__, str(error)


def _wait(key: str) -> None:
    store().wait([key], timedelta(seconds=WAIT))


def _receive(pg, model, versions: int, done: str) -> list[bool]:
    """A receiver that pulls ``versions`` versions (0: it never pulls), then waits for the sender's ``done``."""
    with cudarecv.WeightReceiver(
        group=pg, group_src=0, expect=model, timeout=GROUP_TIMEOUT
    ) as receiver:
        held = []
        for _ in range(versions):
            version = receiver.pull()
            held.append(holds_version(receiver.td, version))
        _wait(done)
        return held


def one_group(rank, world, group, key):
    """Rank 0 pushes version 1 by the star to ranks 1 and 2 of one NCCL group; rank 2 never pulls."""
    model = policy()
    done = f"{key}/done"
    with stand_in_cuda("device"):
        pg = StrictNccl(
            store(), rank, world, timeout=GROUP_TIMEOUT, name=key, sends_done_at_posting=True
        )
        if rank != 0:
            return _receive(pg, model, 1 if rank == 1 else 0, done)
        try:
            sender = cudarecv.WeightSender(
                TensorDict.from_module(model),
                group=pg,
                group_dst=[1, 2],
                timeout=PUSH_TIMEOUT,
                fanout="star",
            )
            set_version(model, 1)
            started = time.monotonic()
            outcome = _outcome(sender.push)
            took = time.monotonic() - started
            facts = {
                "push": outcome,
                "took": took,
                "ranks": sender.ranks,
                "dropped": sender.dropped,
                "aborted": pg.aborted,
                "next push": _outcome(sender.push)[0],
            }
            sender.close()
            return facts
        finally:
            store().set(done, "1")


def test_a_star_push_over_nccl_waits_for_each_receiver_and_drops_one_that_never_pulls(three):
    """(Issue 47, defect 2.) Before the fix the push returned version 1 at once: every send's Work was done at
    posting, so nothing waited for rank 2, which never pulled, and its sends stayed posted for good. Now the push
    waits for each receiver's word, drops rank 2 within its timeout, and aborts the group (NCCL cannot cancel the
    sends posted to rank 2), which drops rank 1 too, once it has version 1."""
    sent, got1, got2 = three().run(one_group, args=(unique_key("fan1"),), timeout=WAIT + 60)
    kind, text = sent["push"]
    assert kind == "TransferTimeout" and "rank 2" in text, sent
    assert "reached ranks [1]" in text, sent  # rank 1 said it has version 1 before the drop
    assert sent["took"] < PUSH_TIMEOUT + SLACK, sent
    assert got1 == [True] and got2 == [], (got1, got2)
    # nothing is left posted that NCCL could not end: the group's communicators were aborted
    assert sent["aborted"] is True, sent
    assert sent["ranks"] == [], sent
    assert set(sent["dropped"]) == {1, 2}, sent
    assert "aborted" in sent["dropped"][1] and "rank 2" in sent["dropped"][1], sent
    assert sent["next push"] == "PeerError", sent


def pair_groups(rank, world, group, key):
    """Rank 0 pushes versions 1..3 to rank 1 and to rank 2, each on an NCCL group of its own (a sender each);
    rank 2 never pulls."""
    model = policy()
    done = f"{key}/done"
    with stand_in_cuda("device"):
        pairs = {
            peer: StrictNccl(
                store(),
                0 if rank == 0 else 1,
                2,
                timeout=GROUP_TIMEOUT,
                name=f"{key}/pair{peer}",
                sends_done_at_posting=True,
            )
            for peer in (1, 2)
            if rank in (0, peer)
        }
        if rank != 0:
            return _receive(pairs[rank], model, 3 if rank == 1 else 0, done)
        try:
            senders = {
                peer: cudarecv.WeightSender(
                    TensorDict.from_module(model),
                    group=pairs[peer],
                    group_dst=1,
                    timeout=PUSH_TIMEOUT,
                    fanout="star",
                )
                for peer in (1, 2)
            }
            pushes: dict[int, list[tuple[str, object]]] = {1: [], 2: []}
            took = 0.0
            for version in (1, 2, 3):
                set_version(model, version)
                pushes[1].append(_outcome(senders[1].push))
                if version == 1:
                    started = time.monotonic()
                    pushes[2].append(_outcome(senders[2].push))
                    took = time.monotonic() - started
            facts = {
                "pushes": pushes,
                "took": took,
                "aborted": {peer: pg.aborted for peer, pg in pairs.items()},
                "dropped": {peer: s.dropped for peer, s in senders.items()},
            }
            for sender in senders.values():
                sender.close()
            return facts
        finally:
            store().set(done, "1")


def test_a_receiver_on_a_group_of_its_own_fails_alone(three):
    """Each receiver on an NCCL group of its own: the one that never pulls is dropped within the push's timeout
    and its group aborted; the other gets every version."""
    sent, got1, got2 = three().run(pair_groups, args=(unique_key("fan2"),), timeout=WAIT + 60)
    assert sent["pushes"][1] == [("ok", 1), ("ok", 2), ("ok", 3)], sent
    [(kind, text)] = sent["pushes"][2]
    assert kind == "TransferTimeout" and "rank 1" in text, sent  # (rank 2 is rank 1 of its pair)
    assert sent["took"] < PUSH_TIMEOUT + SLACK, sent
    assert got1 == [True, True, True] and got2 == [], (got1, got2)
    assert sent["aborted"] == {1: False, 2: True}, sent
    assert sent["dropped"][1] == {} and set(sent["dropped"][2]) == {1}, sent


def test_the_stand_in_completes_a_send_at_posting_and_refuses_ops_once_aborted(cluster):
    """(The stand-in's model, shown: a send nobody receives is done at posting; after abort() an op fails.)"""
    out = cluster().run(_lazy_send, args=(unique_key("lazy"),), timeout=60)[0]
    assert out == {"done at posting": True, "after abort": "NcclRuleError"}, out


def _lazy_send(rank, world, group, key):
    with stand_in_cuda("device"):
        pg = StrictNccl(store(), rank, world, timeout=10.0, name=key, sends_done_at_posting=True)
        out = {}
        if rank == 0:
            work = pg.send([torch.ones(16)], 1)  # rank 1 never receives it
            out["done at posting"] = work.is_completed() and work.wait()
            pg.abort()
            out["after abort"] = _outcome(lambda: pg.send([torch.ones(16)], 1))[0]
        return out
