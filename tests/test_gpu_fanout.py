"""A weight sender's star push over real NCCL, with a receiver that never pulls (issue 47, defect 2).

One sender (rank 0) and two receivers on NCCL ranks (:func:`cudarecv.testing.gpu.nccl_ranks`: one GPU is
enough); rank 2 builds its receiver and never pulls. The push must drop it within the push's timeout, and the
trainer's process must outlive the group's (short) timeout: what was posted to rank 2 would otherwise stay
posted, and torch's NCCL watchdog would take the process down then. Only rank 2's pair group (cudarecv's own)
is aborted: rank 1 gets every version and the user's group still runs collectives (docs/weight-sync.md, "NCCL
failure semantics"). The same on the CPU, through the strict NCCL stand-in: ``tests/test_nccl_fanout.py``.

Run on a GPU machine: ``pytest --gpus 1 tests/test_gpu_fanout.py``.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from rawwire import store, unique_key

HAS_CUDA = torch.cuda.is_available()
PG_TIMEOUT = 15.0  # the sender's groups' (NCCL's watchdog acts on an op pending this long): short, so the test outlives it
PUSH_TIMEOUT = 5.0  # the sender's
PAST_WATCHDOG = (
    PG_TIMEOUT + 10.0
)  # how long the trainer lives on after the failed push (the watchdog polls)
SLACK = 10.0  # what a loaded machine may add to the push's timeout before the drop is seen
DONE_WAIT = (
    PAST_WATCHDOG + PUSH_TIMEOUT + SLACK + 10.0
)  # the longest a receiver waits for the trainer's `done`
# the receivers' groups time out after their wait for `done`: an op a receiver has posted on a group it shares
# with the trainer (a receive that rank 2 never completes, say) is not ended by its own watchdog while it waits
RECEIVER_PG_TIMEOUT = DONE_WAIT + 30.0
RUN_TIMEOUT = DONE_WAIT + 30.0
START = 60.0  # what starting three NCCL ranks may take (each test starts its own)

pytestmark = [
    pytest.mark.gpus(1),
    pytest.mark.nccl,
    pytest.mark.timeout(RUN_TIMEOUT + START),
    pytest.mark.skipif(
        not HAS_CUDA,
        reason="torch.cuda.is_available() is False: needs a CUDA build of torch and a visible GPU",
    ),
]


@pytest.fixture
def three():
    """Three NCCL ranks of their own (a test's groups are aborted: no later test may use these ranks)."""
    from cudarecv.testing.gpu import nccl_ranks, nccl_ranks_problem

    problem = nccl_ranks_problem(3)
    if problem:
        pytest.skip(problem)
    ranks = nccl_ranks(3, pg_timeout=RECEIVER_PG_TIMEOUT)  # (the tests' groups set their own)
    yield ranks
    ranks.close()


def _weights(fill: float) -> TensorDict:
    device = torch.device("cuda", torch.cuda.current_device())
    return TensorDict(
        w=torch.full((1 << 16,), fill, device=device), b=torch.full((100,), fill, device=device)
    )


def _outcome(call):
    try:
        return "ok", call()
    except cudarecv.Error as error:
        return type(error).__name__, str(error)


def _abort(group) -> None:
    """This rank is done with ``group`` (a receiver process going away): nothing of it outlives the test."""
    group._get_backend(torch.device("cuda")).abort()


def _receiver(group, pulls: int, done: str) -> list[bool]:
    """Pull ``pulls`` versions (0: never pull), check each, then wait for the trainer's ``done``."""
    device = torch.device("cuda", torch.cuda.current_device())
    receiver = cudarecv.WeightReceiver(group=group, group_src=0, device=device, timeout=DONE_WAIT)
    held = []
    for _ in range(pulls):
        version = receiver.pull()
        with receiver.reading() as td:
            held.append(
                bool((td["w"] == float(version)).all() and (td["b"] == float(version)).all())
            )
    store().wait([done], timedelta(seconds=DONE_WAIT))
    receiver.close()
    return held


def _group_timeout(rank: int) -> timedelta:
    """The trainer's groups time out soon (what the test outlives); the receivers' only after their wait."""
    return timedelta(seconds=PG_TIMEOUT if rank == 0 else RECEIVER_PG_TIMEOUT)


def _outlive_the_watchdog(started: float) -> bool:
    """Live on past the groups' timeout (the watchdog would have acted by then), the GPU still usable."""
    time.sleep(
        max(started + PAST_WATCHDOG - time.monotonic(), 0.0)
    )  # (the time itself is what is tested)
    x = torch.ones(1024, device="cuda")
    ok = bool((x * 2).sum().item() == 2048)
    torch.cuda.synchronize()
    return ok


def _collective(group) -> float:
    """An all-reduce on ``group`` (the user's; every rank of it calls this): what the trainer's collectives do."""
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    return float(x.item())


def one_group(rank, world, group, key):
    """Rank 0 pushes versions 1..3 by the star to ranks 1 and 2 of one registered NCCL group (as the default
    group a trainer's collectives use); rank 2 never pulls. Then every rank runs a collective on that group."""
    done = f"{key}/done"
    shared = dist.new_group([0, 1, 2], timeout=_group_timeout(rank))
    if rank != 0:
        held = _receiver(shared, 3 if rank == 1 else 0, done)
        store().set(
            f"{key}/closed/{rank}", "1"
        )  # (the trainer waits for it in the store, not in NCCL)
        summed = _collective(shared)  # (the user's group was never aborted)
        _abort(shared)
        return held, summed
    try:
        weights = _weights(0.0)
        sender = cudarecv.WeightSender(
            weights, group=shared, group_dst=[1, 2], timeout=PUSH_TIMEOUT, fanout="star"
        )
        pushes, took = [], 0.0
        started = time.monotonic()
        for version in (1, 2, 3):
            weights.apply_(lambda t, v=version: t.fill_(float(v)))
            begun = time.monotonic()
            pushes.append(_outcome(sender.push))
            if version == 1:
                started, took = begun, time.monotonic() - begun
        facts = {
            "pushes": pushes,
            "took": took,
            "ranks": sender.ranks,
            "dropped": sorted(sender.dropped),
        }
        facts["alive"] = _outlive_the_watchdog(started)
        sender.close()
    finally:
        store().set(done, "1")
    store().wait([f"{key}/closed/{r}" for r in (1, 2)], timedelta(seconds=DONE_WAIT))
    facts["collective"] = _collective(shared)
    return facts


def test_a_receiver_that_never_pulls_costs_only_itself_and_the_trainer_lives_on(three):
    sent, (got1, sum1), (got2, sum2) = three().run(
        one_group, args=(unique_key("gfan1"),), timeout=RUN_TIMEOUT
    )
    kind, text = sent["pushes"][0]
    assert kind == "TransferTimeout" and "rank 2" in text, sent
    assert "reached ranks [1]" in text and "pair group" in text, sent
    assert sent["took"] < PUSH_TIMEOUT + SLACK, sent
    assert sent["pushes"][1:] == [("ok", 2), ("ok", 3)], sent  # rank 1 keeps getting every version
    assert sent["ranks"] == [1] and sent["dropped"] == [2], sent  # (rank 2's pair group alone went)
    assert sent["alive"] is True, sent  # past the group's timeout: the watchdog never took it down
    assert got1 == [True, True, True] and got2 == [], (got1, got2)
    # the user's group was never aborted: its collectives still run on every rank
    assert sent["collective"] == sum1 == sum2 == 3.0, (sent, sum1, sum2)


def pair_groups(rank, world, group, key):
    """Rank 0 pushes versions 1..3 to rank 1 and to rank 2, each on a two-rank NCCL group (a sender each;
    cudarecv's pair group on each, as on any registered group); rank 2 never pulls."""
    done = f"{key}/done"
    pairs = {
        peer: dist.new_group([0, peer], timeout=_group_timeout(rank)) for peer in (1, 2)
    }  # (every rank makes both, in order)
    if rank != 0:
        held = _receiver(pairs[rank], 3 if rank == 1 else 0, done)
        _abort(pairs[rank])
        return held
    try:
        weights = _weights(0.0)
        senders = {
            peer: cudarecv.WeightSender(
                weights, group=pairs[peer], group_dst=1, timeout=PUSH_TIMEOUT, fanout="star"
            )
            for peer in (1, 2)
        }
        pushes: dict[int, list] = {1: [], 2: []}
        started, took = time.monotonic(), 0.0
        for version in (1, 2, 3):
            weights.apply_(lambda t, v=version: t.fill_(float(v)))
            pushes[1].append(_outcome(senders[1].push))
            if version == 1:
                started = time.monotonic()
                pushes[2].append(_outcome(senders[2].push))
                took = time.monotonic() - started
        facts = {
            "pushes": pushes,
            "took": took,
            "dropped": {p: sorted(s.dropped) for p, s in senders.items()},
        }
        facts["alive"] = _outlive_the_watchdog(started)
        for sender in senders.values():
            sender.close()
        return facts
    finally:
        store().set(done, "1")


def test_a_receiver_on_a_group_of_its_own_fails_alone(three):
    sent, got1, got2 = three().run(pair_groups, args=(unique_key("gfan2"),), timeout=RUN_TIMEOUT)
    assert sent["pushes"][1] == [("ok", 1), ("ok", 2), ("ok", 3)], sent
    [(kind, _)] = sent["pushes"][2]
    assert kind == "TransferTimeout", sent
    assert sent["took"] < PUSH_TIMEOUT + SLACK, sent
    assert sent["dropped"] == {1: [], 2: [1]}, sent
    assert sent["alive"] is True, sent
    assert got1 == [True, True, True] and got2 == [], (got1, got2)
