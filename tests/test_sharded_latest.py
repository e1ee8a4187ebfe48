"""Sharded weight sync in latest mode with a receiver slower than a trainer step (issue 42, item 6): each pull
returns within its timeout, with one version from every trainer rank or :class:`cudarecv.WaitTimeout`, and a
slow receiver still gets versions; and how a pull lines the ranks up (:mod:`cudarecv.weights.sharded.lineup`),
checked against a model of trainers and receivers of any speed.

Two trainer ranks (one row-sharded matrix, every element of version ``v`` equal to ``v``) push in step (an
``all_reduce`` each step, as FSDP2's collectives keep them) for as long as the receiver pulls. The receiver is
slower than a step by construction, whatever the machine's speed (:func:`slow_down`: store signals, no sleeps):
it asks each rank two trainer steps after the last, and on the wire lands each version two steps after it began
to arrive. Before the fix, its pulls re-pulled the rank behind for as long as the trainers pushed, and a pull that
ran out while a version was arriving waited for the whole of it: past its timeout, until the trainers stopped
(the ``wire`` case: its first pull took 9.6 s of its 3, ended only as the test stopped the trainers).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.testing.launch import Cluster
from cudarecv.weights.sharded.lineup import MAX_GAP, Lineup
from held import threads
from rawwire import store

ROWS, COLS = 256, 512  # float64: 1 MiB, half of it on each trainer rank
TIMEOUT = 3.0  # each pull's timeout (s)
SLACK = 1.5  # what a pull may take past it: waking the caller (a loaded machine)
WANTED = 3  # versions the receiver must get
ATTEMPTS = 30  # pulls it may try for them (a pull may time out: the next carries on with it)
PUSHING = 200.0  # the trainers' own bound on pushing (a safety net, not an ordering: the receiver says when)
OVERDUE = TIMEOUT + SLACK + 5.0  # a pull still running then has broken its bound: the trainers are stopped


def two_more_pushes(signals) -> None:
    """Wait until the trainers have pushed two versions more than they had now (store keys ``pushed/<v>``, set by
    trainer 0 once both pushed ``v``), or stopped pushing."""
    now = int(signals.get("latest"))
    signals.wait([f"pushed/{now + 2}"], timedelta(seconds=60))


def slow_down(signals) -> None:
    """Make this process's receiver slower than a trainer step: each pull of a sender rank's pieces asks (latest
    mode) only two trainer steps after it was started, and a version that has begun to arrive on the wire lands
    only two steps later: every rank it asks has moved on since it asked the one before, and most of the time a
    version is arriving. (A version from a shared snapshot is copied at once: a trainer's push may wait for that
    copy, for the snapshot it reads is held until then, so delaying it by pushes would stop both.)"""
    from cudarecv.weights import pulling

    start, recv_into = pulling.Puller.start, pulling.recv_into

    def slow_start(self, limit, *args, **kwargs):
        two_more_pushes(signals)
        return start(self, limit, *args, **kwargs)

    def slow_recv_into(*args, **kwargs):
        two_more_pushes(signals)
        return (yield from recv_into(*args, **kwargs))

    pulling.Puller.start, pulling.recv_into = slow_start, slow_recv_into


def trainer(rank: int, mesh, trainers, transport: str, signals) -> dict:
    """Push versions 1, 2, ... in step with the other trainer rank until the receiver says ``done``."""
    from torch.distributed.tensor import DTensor, Shard

    local = torch.zeros(ROWS // 2, COLS, dtype=torch.float64)
    td = TensorDict(
        {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(ROWS, COLS), stride=(COLS, 1))}, []
    )
    before = threads()
    with cudarecv.WeightSender(td, dst=[2], mode="latest", transport=transport, timeout=30) as sender:
        end, version = time.monotonic() + PUSHING, 0
        while True:
            version += 1
            local.fill_(version)
            sender.push()
            stop = torch.tensor([float(signals.check(["done"]) or time.monotonic() > end)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=trainers)  # (both ranks pushed `version`)
            if rank == 0:
                signals.set(f"pushed/{version}", "1")
                signals.set("latest", str(version))
            if stop.item():
                break
        if rank == 0:  # (a receiver's wait for two more pushes, begun before they stopped, goes on)
            for more in (1, 2):
                signals.set(f"pushed/{version + more}", "1")
            signals.set("stopped", "1")
        dist.barrier()  # (the receiver has closed)
    return {"pushed": version, "threads_left": threads() - before}


def receiver(transport: str, signals) -> dict:
    """Pull with a short timeout until ``WANTED`` versions came (at most ``ATTEMPTS`` pulls), timing each; check
    that each version is whole: both ranks' rows hold it."""
    before = threads()
    slow_down(signals)
    expect = TensorDict({"w": torch.zeros(ROWS, COLS, dtype=torch.float64)}, [])
    pulls: list[tuple] = []
    with cudarecv.WeightReceiver(src=[0, 1], expect=expect, timeout=30, transport=transport) as got:
        while sum(isinstance(p[0], int) for p in pulls) < WANTED and len(pulls) < ATTEMPTS:
            # a pull past its bound returns only once the trainers stop: stop them then (the test fails on it)
            overdue = threading.Timer(OVERDUE, signals.set, args=("done", "1"))
            overdue.start()
            start = time.monotonic()
            try:
                version = got.pull(timeout=TIMEOUT)
                w = got.td["w"]
                outcome: tuple = (version, bool(torch.equal(w, torch.full_like(w, float(version)))))
            except cudarecv.WaitTimeout as error:
                outcome = ("WaitTimeout", str(error))
            finally:
                overdue.cancel()
                overdue.join()
            elapsed = time.monotonic() - start
            pulls.append((*outcome, elapsed))
            if elapsed > TIMEOUT + SLACK:
                break  # (the bound broke: the trainers stop, the test fails on it)
        signals.set("done", "1")
        signals.wait(["stopped"], timedelta(seconds=60))  # (no push after this receiver closed)
    dist.barrier()
    return {"pulls": pulls, "threads_left": threads() - before}


def slow_receiver(rank: int, world: int, group, transport: str):
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [0, 1])  # (collective over the world: every rank creates it)
    trainers = dist.new_group([0, 1])
    signals = store()
    if rank < 2:
        return trainer(rank, mesh, trainers, transport, signals)
    return receiver(transport, signals)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", ["wire", "auto"])
def test_a_receiver_slower_than_a_trainer_step_gets_whole_versions_within_each_pulls_timeout(transport):
    with Cluster(3, pg_timeout=60.0) as ranks:
        results = ranks.run(slow_receiver, args=(transport,), timeout=300)
    pulls = results[2]["pulls"]
    assert all(elapsed <= TIMEOUT + SLACK for *_, elapsed in pulls), (
        f"a pull took longer than its timeout ({TIMEOUT:g} s) + {SLACK:g} s: {pulls}"
    )
    versions = [p for p in pulls if isinstance(p[0], int)]
    assert len(versions) >= WANTED, f"the receiver got {len(versions)} versions in {len(pulls)} pulls: {pulls}"
    assert all(whole for _, whole, _ in versions), f"a version mixed two trainer steps: {pulls}"
    numbers = [v for v, _, _ in versions]
    assert numbers == sorted(set(numbers)), pulls
    for rank in (0, 1):
        assert results[rank]["pushed"] > numbers[-1], results[rank]  # (pushing all along)
    for rank in range(3):
        assert not results[rank]["threads_left"], f"rank {rank}: threads left: {results[rank]['threads_left']}"


def carried_on(rank: int, world: int, group):
    """The trainers push version 1, then version 2 only once the receiver's pull of something newer than 1 ran out
    (``WaitTimeout``); the pull goes on, publishes 2, and the next ``pull()`` returns it at once."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh, signals = DeviceMesh("cpu", [0, 1]), store()
    if rank < 2:
        local = torch.zeros(ROWS // 2, COLS, dtype=torch.float64)
        w = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(ROWS, COLS), stride=(COLS, 1))
        with cudarecv.WeightSender(TensorDict({"w": w}, []), dst=[2], mode="latest", timeout=30) as sender:
            for version in (1, 2):
                if version == 2:
                    signals.wait(["timed_out"], timedelta(seconds=60))
                local.fill_(version)
                sender.push()
            dist.barrier()  # (the receiver has checked and closed)
        return None
    expect = TensorDict({"w": torch.zeros(ROWS, COLS, dtype=torch.float64)}, [])
    with cudarecv.WeightReceiver(src=[0, 1], expect=expect, timeout=30) as got:
        first = got.pull(timeout=30)
        start = time.monotonic()
        try:
            got.pull(timeout=0.5)
            late: tuple = ("pulled",)
        except cudarecv.WaitTimeout as error:
            late = ("WaitTimeout", str(error), time.monotonic() - start)
        signals.set("timed_out", "1")
        deadline = time.monotonic() + 60  # the pull that went on publishes version 2 (its own threads' doing)
        while got.version < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        second = got.pull(timeout=TIMEOUT)
        elapsed = time.monotonic() - start
        whole = bool(torch.equal(got.td["w"], torch.full((ROWS, COLS), 2.0, dtype=torch.float64)))
    dist.barrier()
    return first, late, second, elapsed, whole


def test_a_pull_that_ran_out_goes_on_and_the_next_pull_returns_its_version():
    with Cluster(3, pg_timeout=60.0) as ranks:
        results = ranks.run(carried_on, timeout=200)
    first, late, second, elapsed, whole = results[2]
    assert first == 1, results[2]
    assert late[0] == "WaitTimeout" and "from rank(s) [0, 1] no version newer than 1 began" in late[1], late
    assert late[2] <= 0.5 + SLACK, late
    assert second == 2 and whole and elapsed < 1.0, results[2]  # (published already: returned at once)


# -- the rounds of a pull, against a model of the trainers -------------------------------------------------


def simulate(
    step: float, phases: list[float], round_time: float, published: int = 0, rounds: int = 60
) -> tuple[int, int]:
    """A sharded pull in latest mode against trainer ranks that publish version ``n`` at ``n * step + phase``
    (one phase per rank) and a receiver whose round takes ``round_time`` once its asks are answered: each rank
    asked for a version newer than ``floor`` answers with its newest at once if that is past ``floor``, else with
    ``floor + 1`` when it publishes it. Returns (the version published, the rounds it took); raises if the
    rounds did not line up within ``rounds``."""

    def newest(rank: int, t: float) -> int:
        return int((t - phases[rank]) // step)

    held = [published] * len(phases)
    lineup, now = Lineup(published, ahead=True), 10 * step
    asks = lineup.first(held)
    while asks:
        answered = now
        for rank, floor in asks.items():
            have = newest(rank, now)
            if have > floor:
                held[rank] = have
            else:  # it answers as it publishes floor + 1
                held[rank] = floor + 1
                answered = max(answered, (floor + 1) * step + phases[rank])
        now = answered + round_time
        asks = lineup.next(held)
        assert lineup.rounds <= rounds, (held, lineup.floors)
    assert len(set(held)) == 1 and held[0] > published
    return held[0], lineup.rounds


@pytest.mark.parametrize("ratio", [0.01, 0.3, 0.99, 1.0, 1.5, 3.7, 10.0, 100.0, 1000.0])
@pytest.mark.parametrize("phases", [[0.0, 0.0], [0.0, 0.001], [0.0, 0.5], [0.3, 0.0, 0.7, 0.999], [0.0, 0.999]])
def test_the_rounds_line_up_whatever_the_receivers_speed(ratio, phases):
    """Trainers in step or apart by up to a step, a receiver up to 1000 steps per round: the ranks agree on one
    version in a few rounds (the pull this replaces re-pulled the rank behind for ever once a round took longer
    than a step)."""
    version, rounds = simulate(step=1.0, phases=phases, round_time=ratio)
    assert version > 0 and rounds <= 4, (version, rounds)


def test_a_receiver_faster_than_a_step_catches_up_without_waiting_ahead():
    lineup = Lineup(4, ahead=True)
    assert lineup.first([4, 4]) == {0: 4, 1: 4}
    assert lineup.next([6, 7]) == {0: 6} and lineup.phase == "catch up"  # rank 0 is asked for 7 or newer
    assert lineup.next([7, 7]) == {}


def test_a_slow_receiver_waits_ahead_and_sync_mode_only_catches_up():
    lineup = Lineup(4, ahead=True)
    lineup.first([4, 4])
    assert lineup.next([7, 8]) == {0: 7}
    assert lineup.next([11, 8]) == {0: 14, 1: 14} and lineup.phase == "ahead"  # 3 versions a round: wait past 14
    assert lineup.next([15, 19]) == {0: 27, 1: 27}  # rank 1 was past 14 already: the advance (8) + 1, or twice the gap
    assert lineup.next([28, 28]) == {}
    sync = Lineup(4, ahead=False)
    sync.first([4, 4])
    assert sync.next([5, 6]) == {0: 5} and sync.next([6, 6]) == {}
    assert MAX_GAP >= 1 << 10
