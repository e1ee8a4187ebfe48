"""A weight-sync handshake that times out because the other end was never built says what that end must do:
build a ``WeightReceiver`` naming this sender (``src=``), or a ``WeightSender`` sending to this receiver
(``dst=``), within the timeout (cudarecv/weights/handshake.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.testing.launch import Cluster
from rawwire import store

TIMEOUT = 0.5  # the handshake's own time: nobody answers anyway, so it runs out whatever the machine's load
DONE = "handshake_hints/done"


def lone_end(rank: int, world: int, group: object, side: str) -> list[tuple[str, str]] | None:
    """Rank 0 builds ``side`` ("sender": a WeightSender to rank 1, "receiver": a WeightReceiver of rank 1's
    sender), on the default group and then on the standalone ``group`` (ranks named in the group:
    ``group_dst``/``group_src``; another group, so the first timeout's messages left posted do not meet it);
    nothing is built on rank 1, which waits for rank 0's outcomes (a store key): its silence is the cause."""
    signals = store()
    if rank == 1:
        signals.wait([DONE], timedelta(seconds=120))
        return None
    outcomes = []
    try:
        for peer in (dict(), dict(group=group)):
            try:
                if side == "sender":
                    dst = dict(group_dst=[1]) if peer else dict(dst=[1])
                    cudarecv.WeightSender(
                        TensorDict(w=torch.ones(4)), timeout=TIMEOUT, **peer, **dst
                    )
                else:
                    cudarecv.WeightReceiver(
                        timeout=TIMEOUT, **peer, **(dict(group_src=1) if peer else dict(src=1))
                    )
                outcomes.append(("no error", ""))
            except cudarecv.Error as error:
                outcomes.append((type(error).__name__, str(error)))
    finally:
        signals.set(DONE, "1")
    return outcomes


@pytest.mark.parametrize(
    "side, hint",
    [
        (
            "sender",
            "it must build a `WeightReceiver` with `{src}=0` (this rank){where} within that time",
        ),
        (
            "receiver",
            "it must build a `WeightSender` with `{dst}` including 0 (this rank){where} within that time",
        ),
    ],
    ids=["sender", "receiver"],
)
def test_a_handshake_timeout_says_what_the_other_end_must_build(side: str, hint: str) -> None:
    # a cluster of its own: gloo cannot take back the timed-out handshake's posted messages, which a later
    # handshake on these groups would take
    with Cluster(2, pg_timeout=60.0) as cluster:
        outcomes = cluster.run(lone_end, args=(side,), standalone=True, timeout=120)[0]
    for (kind, message), standalone in zip(outcomes, (False, True)):
        assert kind == "TransferTimeout", message
        assert message.startswith("weight-sync handshake: rank 1 of the group "), message
        silent = "took no schema" if side == "sender" else "sent nothing"
        assert f"{silent} within {TIMEOUT:g} s" in message, message
        names = dict(src="group_src", dst="group_dst") if standalone else dict(src="src", dst="dst")
        assert hint.format(**names, where=" on this group" if standalone else "") in message, (
            message
        )


def test_the_hint_names_global_ranks_on_a_registered_subgroup() -> None:
    """On a group made with ``dist.new_group``, ``src=`` is a global rank: global rank 2, the subgroup's rank 1,
    is named as 2."""
    with Cluster(3, pg_timeout=60.0) as cluster:
        kind, message = cluster.run(subgroup_sender, timeout=120)[2]
    assert kind == "TransferTimeout", message
    assert message.startswith("weight-sync handshake: rank 0 of the group took no schema"), message
    assert (
        "it must build a `WeightReceiver` with `src=2` (this rank) within that time" in message
    ), message


def subgroup_sender(rank: int, world: int, group: object) -> tuple[str, str] | None:
    """Global rank 2 builds a sender to global rank 0 on the subgroup [0, 2]; rank 0 builds nothing."""
    sub = dist.new_group([0, 2])  # (every rank takes part in making it)
    signals = store()
    if rank != 2:
        if rank == 0:
            signals.wait([DONE], timedelta(seconds=120))
        return None
    try:
        cudarecv.WeightSender(TensorDict(w=torch.ones(4)), dst=[0], group=sub, timeout=TIMEOUT)
        return ("no error", "")
    except cudarecv.Error as error:
        return (type(error).__name__, str(error))
    finally:
        signals.set(DONE, "1")
