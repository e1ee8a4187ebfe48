"""Many receivers on two cores (issue 31.7): a trainer and seven actors, eight processes on a 2-core
machine, in sync mode through shared memory and in latest mode over the wire. Every version any actor holds is
whole; sync actors get every version; latest actors' versions strictly increase and end at the last one;
no push fails for a receiver that is only slow to be scheduled."""

from __future__ import annotations

import pytest
from tensordict import TensorDict

import cudarecv
from cudarecv.testing.launch import Cluster
from policies import holds_version, policy, set_version
from rawwire import store, unique_key

WORLD = 8
VERSIONS = 12
HIDDEN = 256  # ~10 kB per version


def many(rank, world, group, mode, transport, key):
    model = policy(HIDDEN)
    if rank == 0:
        with cudarecv.WeightSender(
            TensorDict.from_module(model),
            dst=list(range(1, world)),
            mode=mode,
            transport=transport,
            timeout=120.0,
        ) as sender:
            for version in range(1, VERSIONS + 1):
                set_version(model, version)
                assert sender.push() == version
            if mode == "latest":  # every actor takes the last version before the sender closes
                store().wait([f"{key}_{r}" for r in range(1, world)])
            return sender.ranks, dict(sender.dropped)
    seen = []
    with cudarecv.WeightReceiver(
        src=0, expect=model, transport=transport, timeout=120.0
    ) as receiver:
        while not seen or seen[-1][0] < VERSIONS:
            version = receiver.pull()
            with receiver.reading() as td:
                seen.append((version, holds_version(td, version, HIDDEN)))
    store().set(f"{key}_{rank}", "1")
    return seen


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("mode", "transport"), [("sync", "auto"), ("latest", "wire")]
)  # each mode, each transport
def test_seven_receivers_on_two_cores_get_whole_versions(mode, transport):
    with Cluster(WORLD, pg_timeout=120.0) as ranks:
        (served, dropped), *actors = ranks.run(
            many, args=(mode, transport, unique_key(f"many_{mode}")), timeout=600
        )
    failed = {
        r: why for r, why in dropped.items() if why != "closed by its receiver"
    }  # (a done actor closes)
    assert not failed and set(served) | set(dropped) == set(range(1, WORLD)), (served, dropped)
    for rank, seen in enumerate(actors, start=1):
        versions = [v for v, _ in seen]
        assert all(whole for _, whole in seen), (
            f"actor {rank} held a mixed or wrong version: {seen}"
        )
        if mode == "sync":
            assert versions == list(range(1, VERSIONS + 1)), f"actor {rank}: {versions}"
        else:
            assert versions == sorted(set(versions)) and versions[-1] == VERSIONS, (
                f"actor {rank}: {versions}"
            )
