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

import threading
import time
from datetime import timedelta

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from cudarecv.testing.launch import Ranks
from cudarecv.testing.strict_nccl import StrictNccl, stand_in_cuda
from cudarecv.wire import staging
from policies import holds_version, policy, set_version
from rawwire import store, unique_key

PUSH_TIMEOUT = 5.0  # the sender's: a receiver that has not said it has a version by then is dropped
GROUP_TIMEOUT = 60.0  # the stand-in's (NCCL's group timeout): far past the push's
SLACK = 10.0  # what a loaded machine may add to the push's timeout before the drop is seen
WAIT = 120.0  # every wait for another rank's signal
SLOW_ABORT = 30.0  # how long the slow abort waits for the pushes after the drop to return


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


def _live_abort_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("cudarecv-abort-")]


def one_group(rank, world, group, key):
    """Rank 0 pushes versions 1..3 by the star to ranks 1 and 2 of one registered NCCL group (the default group
    a trainer's collectives use, say); rank 2 never pulls. The abort of rank 2's pair group is slow: it waits
    until the push of version 3 has returned. Then rank 2 closes, and a new sender and receiver on the same
    (group, peer) push and pull a version."""
    model = policy()
    done, closed2 = f"{key}/done", f"{key}/closed2"
    with stand_in_cuda("device"):
        pg = StrictNccl(
            store(),
            rank,
            world,
            timeout=GROUP_TIMEOUT,
            name=key,
            sends_done_at_posting=True,
            registered=True,
        )
        if rank == 1:
            return {"held": _receive(pg, model, 3, done), "pairs left": staging.pairs_held()}
        if rank == 2:
            held = _receive(pg, model, 0, done)
            out = {"held": held, "pairs after close": staging.pairs_held()}
            store().set(closed2, "1")
            with cudarecv.WeightReceiver(
                group=pg, group_src=0, expect=model, timeout=GROUP_TIMEOUT
            ) as again:
                version = again.pull()
                out["again"] = (version, holds_version(again.td, version))
            out["pairs left"] = staging.pairs_held()
            return out
        aborts: list[tuple[str, bool]] = []
        pushed = threading.Event()

        def slow_abort():  # (on the thread that aborts rank 2's pair group)
            aborts.append((threading.current_thread().name, pushed.wait(SLOW_ABORT)))

        pg.on_abort = slow_abort
        facts: dict[str, object] = {}
        try:
            sender = cudarecv.WeightSender(
                TensorDict.from_module(model),
                group=pg,
                group_dst=[1, 2],
                timeout=PUSH_TIMEOUT,
                fanout="star",
            )
            pushes = []
            for version in (1, 2, 3):
                set_version(model, version)
                started = time.monotonic()
                pushes.append(_outcome(sender.push))
                if version == 1:
                    facts["took"] = time.monotonic() - started
            pushed.set()
            facts.update(
                pushes=pushes,
                ranks=sender.ranks,
                dropped=sender.dropped,
                aborted=pg.aborted,
            )
            sender.close()
            facts["after close"] = {
                "abort threads": _live_abort_threads(),
                "aborts": list(aborts),
                "pairs": staging.pairs_held(),
                "pairs aborted": [p.aborted for p in pg.pairs],
                "shut": [p.shut for p in pg.pairs],
            }
        finally:
            store().set(done, "1")
        # a new receiver on the same (group, peer), once the dropped one closed: a fresh pair group
        store().wait([closed2], timedelta(seconds=WAIT))
        formed = len(pg.pairs)
        with cudarecv.WeightSender(
            TensorDict.from_module(model),
            group=pg,
            group_dst=2,
            timeout=PUSH_TIMEOUT,
            fanout="star",
        ) as again:
            set_version(model, 1)  # (a new sender's first version)
            facts["again"] = _outcome(again.push)
        facts["new pairs"] = len(pg.pairs) - formed
        facts["pairs left"] = staging.pairs_held()
        facts["aborted at the end"] = pg.aborted
        return facts


def test_a_receiver_that_never_pulls_on_a_registered_group_costs_only_itself(three):
    """(Issue 47, defect 2, and the review's defects 1, 2 and 4.) Before the first fix the push returned version 1
    at once (a send's Work is done at posting). Then a receiver that never pulled had its group aborted: the
    user's own (here the one group of all three, as the default group a trainer's collectives use), which dropped
    every other receiver and would have ended the trainer's training. Now each receiver has a pair group of
    cudarecv's own: rank 2 is dropped within the push's timeout, its pair group alone is aborted (on a thread of
    its own, which the push never waits for: the abort here waits until version 3 was pushed), rank 1 gets every
    version, the user's group is never aborted, close() leaves no pair group or abort thread, and a new receiver
    on rank 2 forms a fresh pair group and gets the next version."""
    sent, got1, got2 = three().run(one_group, args=(unique_key("fan1"),), timeout=WAIT + 120)
    kind, text = sent["pushes"][0][0], sent["pushes"][0][1]
    assert kind == "TransferTimeout" and "rank 2" in text, sent
    assert "reached ranks [1]" in text, sent  # rank 1 said it has version 1 before the drop
    assert "pair group" in text, sent
    assert sent["took"] < PUSH_TIMEOUT + SLACK, sent
    assert sent["pushes"][1:] == [("ok", 2), ("ok", 3)], sent
    assert got1["held"] == [True, True, True] and got2["held"] == [], (got1, got2)
    # the user's group is never aborted: rank 2's pair group is, on a thread of its own, while pushes went on
    assert sent["aborted"] is False and sent["aborted at the end"] is False, sent
    assert sent["ranks"] == [1] and set(sent["dropped"]) == {2}, sent
    [(thread, came)] = sent["after close"]["aborts"]
    assert thread.startswith("cudarecv-abort-") and came, sent
    # close() leaves no abort thread, and no pair group (each shut down, or aborted)
    assert sent["after close"]["abort threads"] == [] and sent["after close"]["pairs"] == 0, sent
    assert sent["after close"]["pairs aborted"] == [False, True], sent
    assert sent["after close"]["shut"] == [True, False], sent  # (rank 1's shut; rank 2's aborted)
    assert got2["pairs after close"] == 0 and got1["pairs left"] == 0, (got1, got2)
    # the same (group, peer) again: a new pair group, and the version lands
    assert sent["again"] == ("ok", 1) and sent["new pairs"] == 1, sent
    assert got2["again"] == (1, True), got2
    assert sent["pairs left"] == 0 and got2["pairs left"] == 0, (sent, got2)


def pair_groups(rank, world, group, key):
    """Rank 0 pushes versions 1..3 to rank 1 and to rank 2, each on a standalone NCCL group of its own (a sender
    each; not registered with torch.distributed: no store to form a pair group on); rank 2 never pulls."""
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
                "formed pairs": sum(len(pg.pairs) for pg in pairs.values()),
                "dropped": {peer: s.dropped for peer, s in senders.items()},
            }
            for sender in senders.values():
                sender.close()
            return facts
        finally:
            store().set(done, "1")


def test_a_receiver_on_a_standalone_group_is_dropped_and_its_group_left_alone(three):
    """On a standalone NCCL group (the user's, not registered: no store to form a pair group on) the receiver
    that never pulls is dropped within the push's timeout, and the user's group is not aborted: the error says
    that torch's watchdog then takes the process down and to pass a registered group. The other receiver, on a
    group of its own, gets every version."""
    sent, got1, got2 = three().run(pair_groups, args=(unique_key("fan2"),), timeout=WAIT + 60)
    assert sent["pushes"][1] == [("ok", 1), ("ok", 2), ("ok", 3)], sent
    [(kind, text)] = sent["pushes"][2]
    assert kind == "TransferTimeout" and "rank 1" in text, sent  # (rank 2 is rank 1 of its pair)
    assert "standalone" in text and "watchdog" in text and "registered" in text, sent
    assert sent["took"] < PUSH_TIMEOUT + SLACK, sent
    assert got1 == [True, True, True] and got2 == [], (got1, got2)
    assert sent["aborted"] == {1: False, 2: False} and sent["formed pairs"] == 0, sent
    assert sent["dropped"][1] == {} and set(sent["dropped"][2]) == {1}, sent


class _NeverFires:
    """A CUDA event whose work never ends (the word's receive on a group whose abort failed)."""

    def __init__(self) -> None:
        self.synchronized = threading.Event()

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:  # (a real one blocks for good; bounded here so the test ends)
        self.synchronized.set()
        threading.Event().wait(60.0)


def test_the_wait_for_a_receivers_word_ends_by_its_deadline_when_the_word_never_comes():
    """(The review's defect 3.) The wait for a receiver's word on NCCL blocked in ``event.synchronize()``: if its
    pair group's abort failed, the driver thread stayed blocked for good and the sender's close could not join
    it. Now it looks at the event until the push's deadline (or the timeout given) and raises TransferTimeout."""
    from cudarecv.weights.fanout import _Word

    word = object.__new__(_Word)
    word.lane, word.who = None, "rank 2"
    word._arrived = event = _NeverFires()
    for bound, timeout in ((0.5, None), (60.0, timedelta(seconds=0.5))):
        outcome: list[tuple[str, object]] = []
        word.deadline = time.monotonic() + bound
        started = time.monotonic()
        thread = threading.Thread(
            target=lambda out=outcome, t=timeout: out.append(_outcome(lambda: word.wait(t))),
            daemon=True,
        )
        thread.start()
        thread.join(10.0)
        assert not thread.is_alive() and not event.synchronized.is_set(), outcome
        assert outcome and outcome[0][0] == "TransferTimeout" and "rank 2" in outcome[0][1], outcome
        assert time.monotonic() - started < 5.0


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
