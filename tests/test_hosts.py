"""Across simulated hosts: a cross-section of the suite between ranks on different hosts.

Five hosts (network namespaces on a bridge, 127.100.0.x, 200 Mbit/s links each way; see
:mod:`cudarecv.testing.hosts`); every job is launched with torchrun and c10d rendezvous on each
host, as on real nodes, running ``hosts_job.py``. Skipped where namespaces cannot be created.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cudarecv.testing import hosts as sim

REASON = sim.unavailable()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"simulated hosts: {REASON}"),
    pytest.mark.timeout(400),
]
JOB = os.path.join(os.path.dirname(__file__), "hosts_job.py")
TIMEOUT = 20.0  # hosts_job.TIMEOUT: every weight-sync wait


@pytest.fixture(scope="module")
def cluster():
    with sim.SimulatedHosts(5, rate="200mbit") as hosts:
        yield hosts


def _launch(hosts, tmp_path, scenario, count):
    procs = hosts.torchrun(
        JOB,
        args=[str(tmp_path), scenario],
        hosts=count,
        log_dir=str(tmp_path),
        env={
            "PYTHONPATH": os.pathsep.join(
                filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")])
            )
        },
    )
    hosts.wait(procs, timeout=300, log_dir=str(tmp_path))
    results = []
    for rank in range(count):
        with open(tmp_path / f"rank{rank}.json") as f:
            results.append(json.load(f))
    assert len({r["host"] for r in results}) == count, "two ranks ran on one host"
    return results


@pytest.fixture(scope="module")
def cross_section(cluster, tmp_path_factory):
    return _launch(cluster, tmp_path_factory.mktemp("cross"), "cross_section", 4)


def test_interop_with_a_stock_peer_on_another_host(cross_section):
    received = cross_section[1]["interop"]
    assert len(received) == 6
    for case, structures in received.items():
        for structure, (ok, _) in structures.items():
            assert ok, f"{case} {structure}: wrong values across hosts"


def test_fast_wire_mismatch_across_hosts_is_drained_and_the_link_survives(cross_section):
    message, untouched, next_ok = cross_section[1]["mismatch"]
    assert message is not None and "drained" in message
    assert untouched and next_ok


@pytest.mark.parametrize("fanout", ["star", "relay"])
def test_weight_sync_fan_out_across_hosts(cross_section, fanout):
    for rank in (1, 2, 3):
        seen, loaded = cross_section[rank][f"weights_{fanout}"]
        assert [v for v, _ in seen] == [1, 2, 3, 4]
        assert all(ok for _, ok in seen) and loaded, f"rank {rank} saw a mixed version"


def test_a_sharded_trainer_relays_each_ranks_pieces_across_hosts(cross_section):
    for trainer in (0, 1):
        fanout, transports = cross_section[trainer]["sharded"]
        assert fanout == "relay" and transports == {"2": "wire", "3": "wire"}, cross_section[
            trainer
        ]["sharded"]
    for rank in (2, 3):
        assert cross_section[rank]["sharded"] == [[1, True], [2, True], [3, True]], cross_section[
            rank
        ]["sharded"]


@pytest.mark.long
def test_a_receiver_killed_mid_push_in_a_relay_chain(cluster, tmp_path):
    """Chain 1 -> 2 -> 3 -> 4, rank 2 killed mid-push: the push names it within timeout + 10 s; rank 1 keeps
    every version; ranks 3 and 4 lose that one version (named, their last one kept whole) and get the next ones
    through the chain 1 -> 3 -> 4, healed in place on the same group."""
    trainer, up, victim, down, last = _launch(cluster, tmp_path, "kill", 5)
    killed, failed = victim["killed_at"], trainer["failed_version"]
    assert "rank 2" in trainer["error"] and trainer["ranks_left"] == [1, 3, 4], trainer
    assert trainer["failed_at"] - killed < TIMEOUT + 10
    after = trainer["after"]
    assert after == [failed + 1, failed + 2] and trainer["ranks_after"] == [1, 3, 4], trainer
    assert all(ok for _, ok in up["seen"]) and [v for v, _ in up["seen"]] == list(
        range(1, failed + 3)
    ), up
    assert up["lost"] == []
    for rank, result in ((3, down), (4, last)):
        assert len(result["lost"]) == 1, f"rank {rank}: {result['lost']}"
        error, at, kept, whole = result["lost"][0]
        assert error.startswith("RelayLost") and "rank 2" in error, f"rank {rank}: {error}"
        assert at - killed < TIMEOUT + 10 and kept == failed - 1 and whole, result["lost"]
        assert [v for v, _ in result["seen"]] == [*range(1, failed), *after], (
            f"rank {rank}: {result['seen']}"
        )
        assert all(ok for _, ok in result["seen"]), f"rank {rank} saw a mixed version"
    assert (
        "in the relay chain" in last["lost"][0][0]
    )  # heard in band from rank 3, whose link to 2 failed


def _namespaces(prefix: str = "") -> set[str]:
    """The network namespaces whose names start with ``prefix`` (all of them by default)."""
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True
    ).stdout
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    return {name for name in names if name.startswith(prefix)}


def _ours() -> set[str]:
    """This process's namespaces: pytest -n 2 builds hosts in the other worker at the same time."""
    return _namespaces(f"{sim.PREFIX}{os.getpid()}x")


def test_hosts_are_shaped_and_always_torn_down():
    before = _ours()
    try:
        delayed = sim.SimulatedHosts(2, rate="100mbit", delay="1ms")
    except (
        sim.HostsError
    ) as error:  # this machine's kernel has no netem: said so, nothing left behind
        assert "sch_netem" in str(error) and _ours() == before, str(error)
    else:
        with delayed:
            uplink = subprocess.run(
                ["ip", "netns", "exec", delayed.hosts[0], "tc", "qdisc", "show", "dev", sim.NIC],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "netem" in uplink and "delay 1ms" in uplink, uplink
    with sim.SimulatedHosts(2, rate="100mbit") as hosts:
        assert set(hosts.hosts) | {hosts.switch} <= _namespaces()
        for ns, dev in ((hosts.hosts[0], sim.NIC), (hosts.switch, "p0")):  # uplink and downlink
            shaped = subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "tbf" in shaped and "rate 100Mbit" in shaped, shaped
        addr = subprocess.run(
            ["ip", "-n", hosts.hosts[1], "addr", "show", sim.NIC],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert f"inet {sim.address(1)}/24" in addr, addr
        names = set(hosts.hosts) | {hosts.switch}
    assert not names & _namespaces(), "namespaces left after close()"


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_namespaces_of_a_killed_run_are_swept_at_the_next_start():
    """A run killed with SIGKILL cannot clean up: the next SimulatedHosts deletes what it left, and
    kills what still ran on its hosts."""
    code = (
        "import os, signal, subprocess; from cudarecv.testing.hosts import SimulatedHosts; "
        "h = SimulatedHosts(2, rate=None); "
        "job = h.popen(1, ['sleep', '120'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print(' '.join(h.hosts + [h.switch]), job.pid, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    *names, job = done.stdout.split()
    left = set(names)
    assert len(left) == 3 and left <= _namespaces() and _running(int(job)), (
        done.stdout,
        done.stderr,
    )
    with sim.SimulatedHosts(1, rate=None):
        assert not left & _namespaces()
        assert not _running(int(job)), "a process of the killed run's hosts still runs"
    with pytest.raises(sim.HostsError, match="`rate` must be a tc rate"):
        sim.SimulatedHosts(2, rate="fast")
