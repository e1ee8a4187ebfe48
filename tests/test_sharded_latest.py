"""Sharded weight sync in latest mode with a receiver slower than a trainer step (issue 42, item 6): each pull
returns within its timeout, with one version from every trainer rank or :class:`cudarecv.WaitTimeout`; a slow
receiver still gets versions, and the trainers' last one once they stop; and how a pull lines the ranks up
(:mod:`cudarecv.weights.sharded.lineup`), checked against a model of trainers and receivers of any speed.

Two trainer ranks (one row-sharded matrix, every element of version ``v`` equal to ``v``) push in step (an
``all_reduce`` each step, as FSDP2's collectives keep them) for as long as the receiver pulls. The receiver is
slower than a step by construction, whatever the machine's speed (:func:`slow_down`: store signals, no sleeps):
on the wire it lands each version three trainer steps after it began to arrive, and in the harshest case it also
asks each rank only once the trainers pushed again, so that the asks of a round mostly straddle a push. Before the fix, its
pulls re-pulled the rank behind for as long as the trainers pushed, and a pull that ran out while a version was
arriving waited for the whole of it: past its timeout, until the trainers stopped (the first pull of
``test_each_pull_returns_in_time_while_the_trainers_outrun_the_receiver[wire]`` took 9.6 s of its 3, and ended
only as the test stopped the trainers).
"""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.testing.launch import Cluster
from cudarecv.weights.sharded.lineup import Lineup
from held import threads
from rawwire import store

ROWS, COLS = 256, 512  # float64: 1 MiB, half of it on each trainer rank
TIMEOUT = 3.0  # each pull's timeout (s)
SLACK = 1.5  # what a pull may take past it: waking the caller (a loaded machine)
WANTED = 3  # versions the receiver must get while the trainers push
ATTEMPTS = 30  # pulls it may try for them (a pull may time out: the next carries on with it)
OUTRUN = 6  # pulls while the trainers outrun a receiver whose asks straddle their pushes
PUSHING = 200.0  # the trainers' own bound on pushing (a safety net, not an ordering: the receiver says when)
OVERDUE = (
    TIMEOUT + SLACK + 5.0
)  # a pull still running then has broken its bound: the trainers are stopped


def more_pushes(signals, count: int) -> None:
    """Wait until the trainers have pushed ``count`` versions more than they had now (store keys ``pushed/<v>``,
    set by trainer 0 once both pushed ``v``), or stopped pushing."""
    now = int(signals.get("latest"))
    signals.wait([f"pushed/{now + count}"], timedelta(seconds=60))


def slow_down(signals, asks: bool) -> None:
    """Make this process's receiver slower than a trainer step: a version that has begun to arrive on the wire
    lands only three trainer steps later, so the trainers move on during each round (a version from a shared
    snapshot is copied at once: a trainer's push may wait for that copy, which holds the snapshot it reads, so
    delaying it by pushes would stop both). ``asks``: also ask each rank only once the trainers pushed again, so
    that the asks of a round mostly straddle a push."""
    from cudarecv.weights import pulling

    start, recv_into = pulling.Puller.start, pulling.recv_into

    def slow_start(self, limit, *args, **kwargs):
        more_pushes(signals, 1)
        return start(self, limit, *args, **kwargs)

    def slow_recv_into(*args, **kwargs):
        more_pushes(signals, 3)
        return (yield from recv_into(*args, **kwargs))

    pulling.recv_into = slow_recv_into
    if asks:
        pulling.Puller.start = slow_start


def trainer(rank: int, mesh, trainers, transport: str, signals) -> dict:
    """Push versions 1, 2, ... in step with the other trainer rank until the receiver says ``done``."""
    from torch.distributed.tensor import DTensor, Shard

    local = torch.zeros(ROWS // 2, COLS, dtype=torch.float64)
    td = TensorDict(
        {
            "w": DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=(ROWS, COLS), stride=(COLS, 1)
            )
        },
        [],
    )
    before = threads()
    with cudarecv.ShardedSender(
        td, dst=[2], mode="latest", transport=transport, timeout=30
    ) as sender:
        end, version = time.monotonic() + PUSHING, 0
        while True:
            version += 1
            local.fill_(version)
            sender.push()
            stop = torch.tensor([float(signals.check(["done"]) or time.monotonic() > end)])
            dist.all_reduce(
                stop, op=dist.ReduceOp.MAX, group=trainers
            )  # (both ranks pushed `version`)
            if rank == 0:
                signals.set(f"pushed/{version}", "1")
                signals.set("latest", str(version))
            if stop.item():
                break
        if rank == 0:  # (a receiver's wait for more pushes, begun before they stopped, goes on)
            for more in (1, 2, 3):
                signals.set(f"pushed/{version + more}", "1")
            signals.set("stopped", "1")
        dist.barrier()  # (the receiver has closed)
    return {"pushed": version, "threads_left": threads() - before}


def timed_pull(got, signals) -> tuple:
    """One ``pull(timeout=TIMEOUT)``: (the version, whether both ranks' rows hold it, seconds) or ("WaitTimeout",
    its message, seconds). A pull past its bound returns only once the trainers stop: they are stopped then (the
    test fails on its time)."""
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
    return (*outcome, time.monotonic() - start)


def receiver(transport: str, outrun: bool, signals) -> dict:
    """``outrun``: up to ``OUTRUN`` pulls while the trainers push (a receiver whose asks straddle their pushes),
    then pulls once they stopped, until it has their last version. Else: pulls while they push, until ``WANTED``
    versions came (at most ``ATTEMPTS`` pulls). Every pull timed, every version checked whole."""
    before = threads()
    slow_down(signals, asks=outrun)
    expect = TensorDict({"w": torch.zeros(ROWS, COLS, dtype=torch.float64)}, [])
    pulls: list[tuple] = []
    after: list[tuple] = []  # (outrun: the pulls once the trainers stopped)
    with cudarecv.ShardedReceiver(
        src=[0, 1], expect=expect, timeout=30, transport=transport
    ) as got:
        while (
            len(pulls) < (OUTRUN if outrun else ATTEMPTS)
            and sum(isinstance(p[0], int) for p in pulls) < WANTED
        ):
            pulls.append(timed_pull(got, signals))
            if pulls[-1][-1] > TIMEOUT + SLACK:
                break  # (the bound broke: the trainers were stopped, the test fails on it)
        signals.set("done", "1")
        signals.wait(["stopped"], timedelta(seconds=60))  # (no push after this receiver closed)
        last = int(signals.get("latest"))
        while outrun and got.version < last and len(after) < 3:
            after.append(timed_pull(got, signals))
        final = (
            got.version,
            bool(
                torch.equal(got.td["w"], torch.full((ROWS, COLS), float(last), dtype=torch.float64))
            ),
        )
    dist.barrier()
    return {
        "pulls": pulls,
        "after": after,
        "last": last,
        "final": final,
        "threads_left": threads() - before,
    }


def slow_receiver(rank: int, world: int, group, transport: str, outrun: bool):
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [0, 1])  # (collective over the world: every rank creates it)
    trainers = dist.new_group([0, 1])
    signals = store()
    if rank < 2:
        return trainer(rank, mesh, trainers, transport, signals)
    return receiver(transport, outrun, signals)


def check_pulls(results: list, pulls: list) -> list[int]:
    """Every pull ended within its timeout + ``SLACK``; every version it returned was whole and newer than the
    last; the versions."""
    assert all(elapsed <= TIMEOUT + SLACK for *_, elapsed in pulls), (
        f"a pull took longer than its timeout ({TIMEOUT:g} s) + {SLACK:g} s: {pulls}"
    )
    versions = [p for p in pulls if isinstance(p[0], int)]
    assert all(whole for _, whole, _ in versions), f"a version mixed two trainer steps: {pulls}"
    numbers = [v for v, _, _ in versions]
    assert numbers == sorted(set(numbers)), pulls
    for rank in range(3):
        assert not results[rank]["threads_left"], (
            f"rank {rank}: threads left: {results[rank]['threads_left']}"
        )
    return numbers


@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", ["wire", "auto"])
def test_each_pull_returns_in_time_while_the_trainers_outrun_the_receiver(transport):
    """A receiver whose asks of a round mostly straddle a push (each waits for the trainers' next one): each pull
    returns within its timeout, a version whole from both ranks or ``WaitTimeout`` (saying what its round waits
    for); once the trainers stop, its next pulls get their last version, whole."""
    with Cluster(3, pg_timeout=60.0) as ranks:
        results = ranks.run(slow_receiver, args=(transport, True), timeout=300)
    out = results[2]
    check_pulls(results, out["pulls"] + out["after"])
    assert all(p[0] == "WaitTimeout" or p[1] for p in out["pulls"]), out["pulls"]
    assert out["last"] == results[0]["pushed"] and out["final"] == (out["last"], True), out


@pytest.mark.timeout(400)
def test_a_receiver_slower_than_a_trainer_step_gets_whole_versions_within_each_pulls_timeout():
    """A receiver that lands each version three trainer steps after it began to arrive: each pull returns in time,
    and ``WANTED`` of them get a version whole from both ranks while the trainers push (asked at one moment, the
    ranks agree unless a push fell between their answers)."""
    with Cluster(3, pg_timeout=60.0) as ranks:
        results = ranks.run(slow_receiver, args=("wire", False), timeout=300)
    numbers = check_pulls(results, results[2]["pulls"])
    assert len(numbers) >= WANTED, (
        f"{len(numbers)} versions in {len(results[2]['pulls'])} pulls: {results[2]}"
    )
    for rank in (0, 1):
        assert results[rank]["pushed"] > numbers[-1], results[rank]  # (pushing all along)


def carried_on(rank: int, world: int, group):
    """The trainers push version 1, then version 2 only once the receiver's pull of something newer than 1 ran out
    (``WaitTimeout``); the pull goes on, publishes 2, and the next ``pull()`` returns it at once."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh, signals = DeviceMesh("cpu", [0, 1]), store()
    if rank < 2:
        local = torch.zeros(ROWS // 2, COLS, dtype=torch.float64)
        w = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(ROWS, COLS), stride=(COLS, 1)
        )
        with cudarecv.ShardedSender(
            TensorDict({"w": w}, []), dst=[2], mode="latest", timeout=30
        ) as sender:
            for version in (1, 2):
                if version == 2:
                    signals.wait(["timed_out"], timedelta(seconds=60))
                local.fill_(version)
                sender.push()
            dist.barrier()  # (the receiver has checked and closed)
        return None
    expect = TensorDict({"w": torch.zeros(ROWS, COLS, dtype=torch.float64)}, [])
    with cudarecv.ShardedReceiver(src=[0, 1], expect=expect, timeout=30) as got:
        first = got.pull(timeout=30)
        start = time.monotonic()
        try:
            got.pull(timeout=0.5)
            late: tuple = ("pulled",)
        except cudarecv.WaitTimeout as error:
            late = ("WaitTimeout", str(error), time.monotonic() - start)
        signals.set("timed_out", "1")
        deadline = (
            time.monotonic() + 60
        )  # the pull that went on publishes version 2 (its own threads' doing)
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
    assert (
        late[0] == "WaitTimeout" and "from rank(s) [0, 1] no version newer than 1 began" in late[1]
    ), late
    assert late[2] <= 0.5 + SLACK, late
    assert second == 2 and whole and elapsed < 1.0, results[
        2
    ]  # (published already: returned at once)


# -- the rounds of a pull, against a model of the trainers -------------------------------------------------


def simulate(
    seed: int,
    spread: float,
    round_time: float,
    ranks: int = 2,
    last: int | None = None,
    published: int = 0,
    rounds: int = 200,
) -> tuple[int, int]:
    """A sharded pull in latest mode against a model: trainer ranks publish version ``n`` at ``n + phase`` (a step
    of 1; each rank's phase in ``[0, spread)``, drawn with ``seed``), none past ``last``; a receiver whose asks reach
    the ranks within 0.01 steps of each other, and whose round takes ``round_time`` steps (+-20 %) once they are
    answered. A rank asked past ``floor`` answers its newest at once if past it, else when it publishes one (a
    version past ``last`` never comes: the model fails then). Returns (the version published, the rounds)."""
    draw = random.Random(seed)
    phases = [draw.uniform(0, spread) for _ in range(ranks)]

    def newest(rank: int, t: float) -> int:
        n = int(t - phases[rank])
        return n if last is None else min(n, last)

    held = [published] * ranks
    lineup, now = Lineup(published, latest=True, retake=range(ranks)), 10.0 + draw.random()
    asks = lineup.first(held)
    while asks:
        answered = now
        for rank, floor in asks.items():
            asked = now + draw.uniform(0, 0.01)
            if newest(rank, asked) > floor:
                held[rank] = newest(rank, asked)
            else:  # it answers as it publishes floor + 1
                assert last is None or floor + 1 <= last, (
                    f"rank {rank} asked for {floor + 1}, past the last {last}"
                )
                held[rank] = floor + 1
                answered = max(answered, floor + 1 + phases[rank])
        now = answered + round_time * draw.uniform(0.8, 1.2)
        asks = lineup.next(held)
        assert lineup.rounds <= rounds, (held, lineup.floors)
    assert len(set(held)) == 1 and held[0] > published
    return held[0], lineup.rounds


@pytest.mark.parametrize("round_time", [0.01, 0.3, 0.99, 1.0, 1.5, 3.7, 10.0, 100.0, 1000.0])
@pytest.mark.parametrize("spread,most", [(0.0, 1), (0.01, 2), (0.1, 4), (0.5, 10)])
def test_the_rounds_line_up_whatever_the_receivers_speed(round_time, spread, most):
    """Ranks that push within ``spread`` of a step of each other, a receiver taking from 0.01 to 1000 steps a
    round: they agree on one version in at most ``most`` rounds (for 50 draws of phases and jitter). The pull this
    replaces re-pulled the rank behind for ever once a round took longer than a step."""
    for seed in range(50):
        version, rounds = simulate(seed, spread, round_time)
        assert rounds <= most, (seed, version, rounds)


@pytest.mark.parametrize("round_time", [0.01, 1.5, 100.0])
def test_trainers_that_stop_leave_no_pull_waiting_for_a_version_past_their_last(round_time):
    """Whatever the receiver's speed, the ranks stopping at version ``last`` (before the pull: 8; during it: 11 to
    20) never leave the pull waiting: it never asks for a version no rank was seen to hold, and publishes ``last``
    if they stopped before it began."""
    for seed in range(50):
        for last in (8, 11, 12, 14, 20):
            version, _ = simulate(seed, 0.5, round_time, ranks=3, last=last)
            assert version == last if last < 10 else version <= last, (seed, last, version)


def test_a_receiver_faster_than_a_step_catches_up_and_a_slow_one_asks_every_rank_afresh():
    lineup = Lineup(4, latest=True, retake={0, 1})
    assert lineup.first([4, 4]) == {0: 4, 1: 4}
    assert (
        lineup.next([6, 7]) == {0: 6} and lineup.phase == "catch up"
    )  # rank 0 is asked for 7 or newer
    assert lineup.next([7, 7]) == {}
    lineup = Lineup(4, latest=True, retake={0, 1})
    lineup.first([4, 4])
    assert lineup.next([7, 8]) == {0: 7}
    assert (
        lineup.next([11, 8]) == {0: 10, 1: 10} and lineup.phase == "fresh"
    )  # rank 0 too: 11 again, or newer
    assert lineup.next([15, 16]) == {
        0: 15,
        1: 15,
    }  # a push fell between their answers: afresh again
    assert lineup.next([17, 17]) == {}
    zero_copy = Lineup(
        4, latest=True, retake={1}
    )  # (rank 0 cannot take the version it holds again)
    zero_copy.first([4, 4])
    zero_copy.next([7, 8])
    assert zero_copy.next([11, 8]) == {1: 10}
    sync = Lineup(4, latest=False, retake={0, 1})
    sync.first([4, 4])
    assert sync.next([5, 6]) == {0: 5} and sync.next([6, 7]) == {0: 6} and sync.next([7, 7]) == {}
