"""Elastic weight sync: receivers join a named sender through a store, with no process group shared by all, and
leave, die, stop and come back while the trainer pushes (issue 30). Real processes forked from the zygote, a
real TCPStore; every ordering is a store signal (tests/churn.py)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import cudarecv
import cudarecv.testing.hosts as sim
from churn import (
    WAIT,
    Fleet,
    Pusher,
    fork_process,
    master_store,
    resources,
    store_client,
    trainer,
    weights,
)
from procs import wait_stopped

HERE = Path(__file__).resolve().parent
MEMBER_THREADS = (
    "cudarecv-push-",
    "cudarecv-listen-",
    "cudarecv-join-",
)  # a receiver's threads on the sender
TIMEOUT = 8.0  # the sender's and receivers' timeout: a SIGSTOPped receiver is dropped after it (sync mode)


def _settled(sender, td, pusher: Pusher | None = None) -> dict:
    """Push until no thread serves a receiver any more (each push lets go of those that left), within WAIT:
    this process's resources then. With ``pusher`` running, its pushes: never one of this thread beside them
    (each fills the weights with its version: two at once would push one version's weights as another's)."""

    def push() -> None:
        if pusher is not None:
            pusher.next_push()
            return
        td["w"].fill_(sender.version + 1)
        td["b"].fill_(-(sender.version + 1))
        sender.push()

    deadline = time.monotonic() + WAIT
    while any(t.name.startswith(MEMBER_THREADS) for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        push()
    push()  # (the last of them let go of)
    return resources()


@pytest.mark.long
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode, events, seed", [("latest", 100, 11), ("sync", 60, 12)])
def test_receivers_come_and_go_while_the_trainer_pushes(mode, events, seed):
    """Actors start, close, are SIGKILLed, SIGSTOPped and continued at random: every version any pulled is whole
    and newer than its last, sync actors get every version while served, no push raises, the sender names who
    left and how, and its threads, descriptors and memory are flat after the events."""
    name = f"churn-{mode}"
    with master_store() as store:
        td = weights()
        sender = cudarecv.ElasticSender(td, store=store, name=name, mode=mode, timeout=TIMEOUT)
        fleet = Fleet(store, store.port, name, TIMEOUT, seed)
        try:
            td["w"].fill_(1)
            td["b"].fill_(-1)
            sender.push()  # (nobody joined yet: no error; a latest receiver's first pull gets it)
            pusher = Pusher(sender, td)
            try:
                fleet.start()  # warm: one receiver joined and left, its pair let go of
                fleet.close(1)
                baseline = _settled(sender, td, pusher)
                for _ in range(events):
                    fleet.event()
                fleet.end()
            finally:
                pusher.stop()
            assert not pusher.errors, f"a push raised: {pusher.errors[0]!r}"
            after = _settled(sender, td)
            receivers = sender.receivers
        finally:
            sender.close()
            fleet.end()
    stats = fleet.stats()
    assert set(stats) == set(range(1, fleet.count + 1)), "an actor never pulled"
    for index, s in stats.items():
        assert s["torn"] == 0, f"actor {index} pulled a version that was not whole: {s}"
        assert s["not_newer"] == 0, f"actor {index} pulled a version not newer than its last: {s}"
        assert s["gaps"] == 0, f"actor {index} missed a version while served (sync): {s}"
    assert all(fleet.events[kind] for kind in fleet.events), fleet.events
    states = {r["id"]: r["state"] for r in receivers}
    assert all(state != "served" for state in states.values()), states
    closed = []
    for index, _, how in fleet.ended:
        state = states[stats[index]["id"]]
        if (
            how == "closed"
        ):  # (or, under load, dropped as too slow just before its close: never served)
            assert state == "closed by its receiver" or "dropped" in state, (index, state)
            closed.append(state == "closed by its receiver")
        else:
            assert "dropped" in state, (index, state)
    assert any(closed), "no actor's close reached the sender as a BYE"
    assert after["threads"] <= baseline["threads"], (baseline, after)
    assert after["fds"] <= baseline["fds"], (baseline, after)
    assert after["resident"] - baseline["resident"] < 64 << 20, (baseline, after)
    print(
        f"\n{mode}: {sum(fleet.events.values())} events {fleet.events}, {fleet.count} actors, "
        f"{sum(s['pulled'] for s in stats.values())} pulls, {sum(s['rejoins'] for s in stats.values())} rejoins, "
        f"version {sender.version}; trainer {baseline} -> {after}"
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("end", ["killed", "closed"])
def test_a_trainer_that_restarts_is_found_again(end):
    """Trainer A pushes to two actors, then dies (SIGKILL) or closes; the actors keep A's last version readable
    and whole, then find trainer B (same store and name) and go on with versions above A's, never an older one."""
    name = f"restart-{end}"
    with master_store() as store:
        fleet = Fleet(store, store.port, name, TIMEOUT, seed=3)
        first = fork_process(trainer, ("127.0.0.1", store.port, name, "latest", TIMEOUT))
        trainers = [first]
        try:
            fleet.start()
            fleet.start()
            store.wait([f"{name}/trainer/1/version"], datetime.timedelta(seconds=WAIT))
            if end == "killed":
                os.kill(first.pid, signal.SIGKILL)
            else:
                store.set(f"{name}/trainer/1/close", "1")
            first.join(WAIT)
            assert first.exitcode == (-signal.SIGKILL if end == "killed" else 0), first.exitcode
            last_of_first = int(store.get(f"{name}/trainer/1/version"))
            second = fork_process(trainer, ("127.0.0.1", store.port, name, "latest", TIMEOUT))
            trainers.append(second)
            for index in (1, 2):  # (a pull may first bring the last reply the first trainer sent)
                fleet.pulled_beyond(index, last_of_first)
            store.set(f"{name}/trainer/2/close", "1")
            second.join(WAIT)
            assert second.exitcode == 0, second.exitcode
        finally:
            fleet.end()
            for process in trainers:
                process.kill()
    for index, s in fleet.stats().items():
        assert s["torn"] == 0 and s["not_newer"] == 0, (index, s)
        assert s["last"] > last_of_first and s["rejoins"] >= 1, (index, s, last_of_first)


def test_a_sender_with_a_store_pushes_with_nobody_joined_and_refuses_what_needs_a_group():
    with master_store() as store:
        td = weights()
        with pytest.raises(TypeError, match="'dst'"):  # (receivers join through the store)
            cudarecv.ElasticSender(td, dst=1, store=store, name="p")
        with pytest.raises(cudarecv.ArgumentError, match="fanout='relay' is for mode='sync'"):
            cudarecv.ElasticSender(td, store=store, name="p", fanout="relay", mode="latest")
        with pytest.raises(
            cudarecv.ArgumentError, match="`name` must be a non-empty string without '/'"
        ):
            cudarecv.ElasticSender(td, store=store, name="a/b")
        with pytest.raises(
            cudarecv.ArgumentError, match="`store` must be a torch.distributed.Store"
        ):
            cudarecv.ElasticSender(td, store=object(), name="p")
        with pytest.raises(TypeError, match="'src'"):
            cudarecv.ElasticReceiver(store, "p", src=0)
        with pytest.raises(TypeError, match="'want'"):
            cudarecv.ElasticReceiver(store=store, name="p", want={"w": (slice(0, 2),)})
        with pytest.raises(
            cudarecv.WaitTimeout, match="no weight sender named 'nobody' came within"
        ):
            cudarecv.ElasticReceiver(store=store, name="nobody", timeout=0.5)
        for mode in ("sync", "latest"):
            with cudarecv.ElasticSender(
                td, store=store, name=f"alone-{mode}", mode=mode, timeout=5
            ) as sender:
                assert [sender.push() for _ in range(3)] == [1, 2, 3] and sender.receivers == []
                threads = {t.name for t in threading.enumerate()}
                assert f"cudarecv-admit-alone-{mode}" in threads
        assert not any(t.name.startswith("cudarecv-admit") for t in threading.enumerate())
        again = cudarecv.ElasticSender(
            td, store=store, name="alone-sync", timeout=5
        )  # the next generation
        assert (
            again.generation == 2 and again.push() == 4
        )  # (the next number of the name's counter, after 3)
        again.close()


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.skipif(sim.unavailable() is not None, reason=f"simulated hosts: {sim.unavailable()}")
@pytest.mark.parametrize("mode, events, seed", [("latest", 40, 21), ("sync", 30, 22)])
def test_receivers_come_and_go_on_other_hosts(mode, events, seed):
    """The trainer on host 0 (and the store), actors started, closed, SIGKILLed, SIGSTOPped and continued on
    hosts 1 and 2 (1 Gbit/s links): every version pulled whole and newer than the last, no push raised, each
    actor that left named as it left; in sync mode the versions go through a relay chain across the hosts (an
    elastic sender's ``auto``), healed around each actor that fails."""
    with sim.SimulatedHosts(3, rate="1gbit") as hosts:
        namespaces = ",".join(hosts.hosts[1:])
        proc = hosts.popen(
            0,
            [
                sys.executable,
                str(HERE / "churn_hosts.py"),
                namespaces,
                sim.address(0),
                str(events),
                str(seed),
                str(TIMEOUT),
                mode,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(HERE), os.environ.get("PYTHONPATH")])
                )
            },
        )
        out, _ = proc.communicate(timeout=800)
        assert proc.returncode == 0, out
    line = next(x for x in out.splitlines() if x.startswith("CHURN "))
    result = json.loads(line[len("CHURN ") :])
    assert not result["errors"], result["errors"]
    totals = {k: sum(e[k] for e in result["events"]) for k in result["events"][0]}
    assert sum(totals.values()) == events and all(totals.values()), totals
    stats = result["stats"]
    assert stats and all(s["torn"] == 0 and s["not_newer"] == 0 for s in stats.values()), stats
    states = {r["id"]: r["state"] for r in result["receivers"]}
    for index, how in result["ended"]:
        state = states[stats[str(index)]["id"]]
        assert "dropped" in state or (how == "closed" and state == "closed by its receiver"), (
            index,
            how,
            state,
        )
    assert ("relay" in result["transports"]) == (mode == "sync"), result["transports"]
    print(
        f"\nhosts, {mode}: {totals}, {len(stats)} actors, {sum(s['pulled'] for s in stats.values())} pulls, "
        f"transports {result['transports']}"
    )


def relay_actor(conn, port: int, name: str, index: int) -> None:
    """A receiver in a relay chain of joined receivers: pull until the version ``relay/final`` names, each version's
    wholeness in the store; actor 2 dies (SIGKILL) once chunk 1 of version ``relay/die_at`` has landed in it (it
    forwards: never the tail)."""
    from cudarecv.weights import relay

    conn.close()
    store = store_client(port)
    receiver = cudarecv.ElasticReceiver(store=store, name=name, timeout=TIMEOUT)
    store.set(f"relay/{index}/id", str(receiver.id))
    if index == 2:
        landed = relay.Relay.landed

        def landed_then_die(self, i: int) -> None:
            landed(self, i)
            if (
                i == 1
                and store.check(["relay/die_at"])
                and self.version >= int(store.get("relay/die_at"))
            ):
                os.kill(os.getpid(), signal.SIGKILL)

        relay.Relay.landed = landed_then_die
    seen = []
    while not (
        store.check(["relay/final"]) and seen and seen[-1][0] >= int(store.get("relay/final"))
    ):
        version = receiver.pull(timeout=WAIT)
        with receiver.reading() as td:
            seen.append(
                [version, bool((td["w"] == version).all()) and bool((td["b"] == -version).all())]
            )
        store.set(f"relay/{index}/seen", json.dumps(seen))
    receiver.close()


@pytest.mark.timeout(600)
def test_a_relay_chain_of_joined_receivers_heals_in_place_and_takes_newcomers():
    """``fanout="relay"`` with receivers that joined through the store: the chain 1 -> 2 -> 3 forms pairs of its
    own; receiver 2 dies mid-push: no push raises, 3 loses that one version and gets the next through 1 -> 3,
    nothing rebuilt; a newcomer joins the chain's tail. Every version pulled is whole."""
    name = "relay"
    with master_store() as store:
        td = weights()
        sender = cudarecv.ElasticSender(
            td,
            store=store,
            name=name,
            mode="sync",
            fanout="relay",
            timeout=TIMEOUT,
            bucket_bytes=64 << 10,
        )  # (5 chunks a version: one dies mid-push)
        actors = {}

        def push() -> int:
            td["w"].fill_(sender.version + 1)
            td["b"].fill_(-(sender.version + 1))
            return sender.push()  # (elastic: never raises for a receiver that failed)

        def join(
            index: int,
        ) -> None:  # one at a time: the ids follow the indices, and so does the chain
            actors[index] = fork_process(relay_actor, (store.port, name, index))
            store.wait([f"relay/{index}/id"], datetime.timedelta(seconds=WAIT))
            assert int(store.get(f"relay/{index}/id")) == index
            while not store.check(
                [f"relay/{index}/seen"]
            ):  # (pushes until it has pulled one: it is served)
                push()

        try:
            for index in (1, 2, 3):
                join(index)
            first = push()
            assert [r["transport"] for r in sender.receivers] == ["relay"] * 3, sender.receivers
            store.set("relay/die_at", str(first + 2))
            for _ in range(4):
                push()
            actors[2].join(WAIT)
            assert actors[2].exitcode == -signal.SIGKILL, actors[2].exitcode
            join(4)
            store.set("relay/final", str(sender.version + 2))
            for _ in range(2):
                last = push()
            receivers = {r["id"]: r for r in sender.receivers}
            for index in (1, 3, 4):
                actors[index].join(WAIT)
                assert actors[index].exitcode == 0, (index, actors[index].exitcode)
        finally:
            sender.close()
            for process in actors.values():
                process.kill()
        seen = {i: json.loads(store.get(f"relay/{i}/seen")) for i in (1, 3, 4)}
    assert "dropped" in receivers[2]["state"], receivers
    assert [receivers[i]["transport"] for i in (1, 3, 4)] == ["relay"] * 3, receivers
    for index, got in seen.items():
        versions = [v for v, _ in got]
        assert all(whole for _, whole in got), (
            f"actor {index} pulled a version that was not whole: {got}"
        )
        assert versions == sorted(set(versions)) and versions[-1] == last, (index, versions)
    assert set(range(first, last + 1)) <= {v for v, _ in seen[1]}, seen[
        1
    ]  # upstream of the dead one: every one
    lost = set(range(first, last + 1)) - {v for v, _ in seen[3]}
    assert lost == {first + 2}, (
        lost,
        seen[3],
    )  # the one version it was relaying when receiver 2 died


def idle_actor(conn, port: int, name: str) -> None:
    """A latest-mode receiver that pulls once, says its pid and id, then asks for nothing (it is stopped there);
    once continued and told, it pulls again: from a new join, the newest version."""
    conn.close()
    store = store_client(port)
    receiver = cudarecv.ElasticReceiver(store=store, name=name, timeout=TIMEOUT)
    version = receiver.pull(timeout=WAIT)
    store.set("idle/first", json.dumps([os.getpid(), receiver.id, version]))
    store.wait(["idle/pull"], datetime.timedelta(seconds=WAIT))  # (stopped while it waits here)
    version = receiver.pull(timeout=WAIT)
    with receiver.reading() as td:
        whole = bool((td["w"] == version).all()) and bool((td["b"] == -version).all())
    store.set("idle/second", json.dumps([receiver.id, version, whole]))
    receiver.close()


@pytest.mark.timeout(600)
def test_a_stopped_receiver_that_asks_for_nothing_is_dropped_and_joins_again():
    """Latest mode: a receiver stopped (SIGSTOP) while it asks for nothing stops beating; the sender drops it
    within its timeout (pushes go on, none raises) and says so in the store; continued, its next pull joins
    again and gets the newest version."""
    name = "idle"
    with master_store() as store:
        td = weights()
        sender = cudarecv.ElasticSender(td, store=store, name=name, mode="latest", timeout=TIMEOUT)
        actor = None
        try:
            td["w"].fill_(1)
            td["b"].fill_(-1)
            sender.push()
            actor = fork_process(idle_actor, (store.port, name))
            store.wait(["idle/first"], datetime.timedelta(seconds=WAIT))
            pid, first_id, first_version = json.loads(store.get("idle/first"))
            assert first_version == 1
            # its word on version 1 reaches the sender a moment after its pull returned (a gloo send, and the
            # sender's listener): stopped before that, it would be dropped by the reply's timeout instead
            deadline = time.monotonic() + WAIT
            while any(m.sending is not None and not m.sending.settled for m in sender._s.members):
                assert time.monotonic() < deadline, "the reply of version 1 never ended"
                time.sleep(0.01)
            os.kill(pid, signal.SIGSTOP)
            wait_stopped(pid)
            stopped = time.monotonic()
            while first_id not in sender.dropped:  # (each push looks at the beats; none raises)
                assert time.monotonic() - stopped < WAIT, sender.receivers
                td["w"].fill_(sender.version + 1)
                td["b"].fill_(-(sender.version + 1))
                sender.push()
            why = sender.dropped[first_id]
            os.kill(pid, signal.SIGCONT)
            store.set("idle/pull", "1")
            store.wait(["idle/second"], datetime.timedelta(seconds=WAIT))
            second_id, version, whole = json.loads(store.get("idle/second"))
            actor.join(WAIT)
            assert actor.exitcode == 0, actor.exitcode
        finally:
            sender.close()
            if actor is not None:
                actor.kill()
    assert "heartbeat" in why and "dropped" in why, why
    assert second_id > first_id and version == sender.version and whole, (
        second_id,
        first_id,
        version,
    )
