"""Each spawned rank's environment: the parent's, then ``env`` (every rank), then ``rank_env(rank)``.

Real gloo ranks (:class:`cudarecv.testing.launch.Cluster`) report what ``os.environ`` holds in
them, so a value meant for one rank that reached another, or the parent's value winning over a
rank's own, fails here.
"""

from __future__ import annotations

import os

import pytest

from cudarecv.testing.gpu import nccl_ranks
from cudarecv.testing.launch import Cluster, Ranks

NAMES = ("CUDARECV_TEST_SHARED", "CUDARECV_TEST_OWN", "NCCL_HOSTID", "NCCL_SOCKET_IFNAME")


def environ_of(rank: int, world: int, group, names: tuple[str, ...]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def test_each_rank_sees_its_own_value(monkeypatch):
    monkeypatch.setenv("CUDARECV_TEST_OWN", "parent")  # the rank's own value must win over it
    monkeypatch.setenv("CUDARECV_TEST_SHARED", "parent")  # and env's over it
    ranks = Ranks(
        3,
        pg_timeout=30.0,
        env={"CUDARECV_TEST_SHARED": "all"},
        rank_env=lambda rank: {"CUDARECV_TEST_OWN": f"rank-{rank}"},
    )
    try:
        seen = ranks().run(environ_of, args=(NAMES[:2],), timeout=60.0)
    finally:
        ranks.close()
    assert seen == [
        {"CUDARECV_TEST_SHARED": "all", "CUDARECV_TEST_OWN": f"rank-{r}"} for r in range(3)
    ]


def test_nccl_ranks_in_hostid_mode_give_each_rank_its_own_host():
    """The per-rank environment ``nccl_ranks`` builds, applied to real (gloo) ranks: a distinct
    NCCL_HOSTID each (NCCL then takes them for separate nodes), loopback sockets for all."""
    ranks = nccl_ranks(2, mode="hostid", pg_timeout=30.0)
    assert ranks.mode == "hostid" and ranks.cluster_kwargs["backend"] == "nccl"
    with Cluster(2, pg_timeout=30.0, rank_env=ranks.cluster_kwargs["rank_env"]) as cluster:
        seen = cluster.run(environ_of, args=(NAMES[2:],), timeout=60.0)
    assert [s["NCCL_SOCKET_IFNAME"] for s in seen] == ["lo", "lo"]
    hosts = [s["NCCL_HOSTID"] for s in seen]
    assert None not in hosts and len(set(hosts)) == 2, hosts


@pytest.mark.parametrize(
    ("env", "rank_env", "what"),
    [
        ({"A": 1}, None, "env"),
        (None, lambda rank: {"A": "x"} if rank == 0 else {"A": None}, r"rank_env\(1\)"),
        (None, lambda rank: ["A"], r"rank_env\(0\)"),
    ],
)
def test_a_bad_environment_is_refused_before_any_rank_starts(env, rank_env, what):
    with pytest.raises(TypeError, match=what):
        Cluster(2, env=env, rank_env=rank_env, start_timeout=5.0)
