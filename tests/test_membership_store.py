"""Elastic weight sync against its store (issue 42): a store that dies, a second live sender under the name, a
close from another thread while a pull waits for the next sender, and the store's records as untrusted input
(garbage in each key the senders and receivers read). Real processes forked from the zygote, real TCPStores;
every ordering is a store signal, every wait bounded."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from churn import WAIT, fork_process, master_store, store_client, weights
from cudarecv.core.shutdown import start_thread

TIMEOUT = 8.0  # the senders' timeout (a number taken and never written is skipped after it)


@pytest.fixture
def thread_errors():
    """Every exception that ended a thread of this process during the test (none may)."""
    seen: list[threading.ExceptHookArgs] = []
    before = threading.excepthook
    threading.excepthook = seen.append
    try:
        yield seen
    finally:
        threading.excepthook = before


def key(name: str, *parts: object) -> str:
    """A key of sender ``name`` in the store (for a test that writes garbage there)."""
    return "/".join([f"cudarecv/weights/{name}", *map(str, parts)])


def fill(td, version: int) -> None:
    td["w"].fill_(version)
    td["b"].fill_(-version)


def push_until(sender, td, done, what: str) -> None:
    """Push (each push's weights: its version) until ``done()``, within WAIT (the signal: ``done``)."""
    deadline = time.monotonic() + WAIT
    while not done():
        assert time.monotonic() < deadline, (
            f"{what} within {WAIT:g} s; receivers: {sender.receivers}"
        )
        fill(td, sender.version + 1)
        sender.push()


def puller(conn, weights_port: int, signals_port: int, name: str, tag: str, timeout: float) -> None:
    """An actor: join ``name`` in the weights store, then pull until told to stop; each version pulled, whole or
    not, in the signals store (``<tag>/seen``), and the error that ended it, if one did (``<tag>/error``). Whole:
    every element holds the pushed value (a push's value is the trainer's guess of its version, which another
    sender's numbers may overtake)."""
    conn.close()
    signals = store_client(signals_port)
    receiver = cudarecv.ElasticReceiver(
        store=store_client(weights_port), name=name, timeout=timeout
    )
    signals.set(f"{tag}/id", str(receiver.id))
    seen = []
    while not signals.check([f"{tag}/stop"]):
        try:
            version = receiver.pull(timeout=2.0)
        except cudarecv.WaitTimeout:
            continue
        except cudarecv.Error as error:
            signals.set(f"{tag}/error", f"{type(error).__name__}: {error}")
            break
        with receiver.reading() as td:
            value = float(td["w"][0])
            seen.append(
                [version, bool((td["w"] == value).all()) and bool((td["b"] == -value).all())]
            )
        signals.set(f"{tag}/seen", json.dumps(seen))
    receiver.close()


def seen(signals, tag: str) -> list[list]:
    return json.loads(signals.get(f"{tag}/seen")) if signals.check([f"{tag}/seen"]) else []


def store_server(conn, signals_port: int) -> None:
    """A TCPStore's server in a process of its own (the test SIGKILLs it): its port in the signals store."""
    conn.close()
    server = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=WAIT),
    )
    signals = store_client(signals_port)
    signals.set("server/port", str(server.port))
    signals.wait(["server/never"], datetime.timedelta(seconds=3 * WAIT))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "latest"])
def test_a_store_that_dies_never_makes_a_push_raise(mode, thread_errors):
    """The store's server is SIGKILLed while a trainer pushes to a joined receiver: no push raises (each store
    failure is logged), the receiver keeps getting every version whole from its pair, and the numbers go on."""
    with master_store() as signals:
        server = fork_process(store_server, (signals.port,))
        actor = None
        try:
            signals.wait(["server/port"], datetime.timedelta(seconds=WAIT))
            port = int(signals.get("server/port"))
            td = weights()
            sender = cudarecv.ElasticSender(
                td, store=store_client(port), name="dies", mode=mode, timeout=TIMEOUT
            )
            actor = fork_process(puller, (port, signals.port, "dies", "a", 60.0))
            push_until(sender, td, lambda: seen(signals, "a"), "the receiver pulled no version")
            os.kill(server.pid, signal.SIGKILL)
            server.join(WAIT)
            for _ in range(8):  # (the store failed from the fifth push on)
                fill(td, sender.version + 1)
                sender.push()
            last = sender.version
            push_until(
                sender,
                td,
                lambda: seen(signals, "a")[-1][0] >= last,
                "the receiver did not get the versions pushed after the store died",
            )
            signals.set("a/stop", "1")
            actor.join(WAIT)
            got = seen(signals, "a")
            sender.close()
        finally:
            server.kill()
            if actor is not None:
                actor.kill()
    assert actor.exitcode == 0 and not signals.check(["a/error"]), actor.exitcode
    versions = [v for v, _ in got]
    assert all(whole for _, whole in got) and versions == sorted(set(versions)), got
    if mode == "sync":  # (every version while served; latest mode takes the newest)
        assert versions == list(range(versions[0], versions[-1] + 1)), versions
    assert not thread_errors, thread_errors


@pytest.mark.timeout(300)
def test_a_second_live_sender_fences_the_first_and_receivers_never_go_back(thread_errors):
    """Sender A serves a receiver; sender B takes the name while A still runs: A's next push closes A and raises
    SenderFenced (and so does every later one); the receiver moves to B and its versions only increase, whole."""
    with master_store() as store:
        td_a, td_b = weights(), weights()
        a = cudarecv.ElasticSender(td_a, store=store, name="two", mode="sync", timeout=TIMEOUT)
        actor = fork_process(puller, (store.port, store.port, "two", "f", 60.0))
        b = None
        try:
            push_until(
                a, td_a, lambda: len(seen(store, "f")) >= 3, "the receiver did not pull from A"
            )
            b = cudarecv.ElasticSender(td_b, store=store, name="two", mode="sync", timeout=TIMEOUT)
            assert b.generation == a.generation + 1 and b.version >= a.version, (
                a.version,
                b.version,
            )
            with pytest.raises(cudarecv.SenderFenced, match="generation 2 took the name"):
                fill(td_a, a.version + 1)
                a.push()
            with pytest.raises(cudarecv.SenderFenced):
                a.push()
            last_of_a = seen(store, "f")[-1][0]
            push_until(
                b,
                td_b,
                lambda: seen(store, "f")[-1][0] > last_of_a + 2,
                "the receiver did not move to B",
            )
            store.set("f/stop", "1")
            actor.join(WAIT)
        finally:
            a.close()
            if b is not None:
                b.close()
            actor.kill()
        got = seen(store, "f")
    versions = [v for v, _ in got]
    assert all(whole for _, whole in got) and versions == sorted(set(versions)), got
    assert actor.exitcode == 0, actor.exitcode
    assert not thread_errors, thread_errors


def peeking_puller(conn, port: int, name: str) -> None:
    """An actor whose pulls run on a thread of their own while its main thread answers ``peek/<n>`` with what the
    receiver publishes (version, whole): a receiver must never publish an older version than it held."""
    conn.close()
    signals = store_client(port)
    receiver = cudarecv.ElasticReceiver(store=store_client(port), name=name, timeout=60.0)
    stop = threading.Event()
    pulls = store_client(port)

    def pull() -> None:
        got = []
        while not stop.is_set():
            try:
                got.append(receiver.pull(timeout=1.0))
            except cudarecv.WaitTimeout:
                continue
            pulls.set("peek/pulled", json.dumps(got))

    thread = start_thread(pull, "puller")  # (its own client: this thread's waits hold `signals`)
    n = 0
    while not signals.check(["peek/stop"]):
        n += 1
        signals.wait([f"peek/{n}"], datetime.timedelta(seconds=WAIT))
        with receiver.reading() as td:
            version = int(td["w"][0])
            whole = bool((td["w"] == version).all()) and bool((td["b"] == -version).all())
        signals.set(f"peek/{n}/answer", json.dumps([receiver.version, version, whole]))
    stop.set()
    thread.join(WAIT)
    receiver.close()


@pytest.mark.timeout(300)
def test_a_receiver_never_publishes_an_older_version_than_it_held():
    """The store's version counter is reset (tampered with) between two senders of the name: the new one numbers
    its versions from 1 again. The receiver keeps the last sender's newest version published (td and version never
    go back) until the new sender's versions pass it; every pull returns a newer version."""
    with master_store() as store:
        td = weights()
        a = cudarecv.ElasticSender(td, store=store, name="back", mode="sync", timeout=TIMEOUT)
        actor = fork_process(peeking_puller, (store.port, "back"))
        b = None
        asked = 0

        def peek() -> list:
            nonlocal asked
            asked += 1
            store.set(f"peek/{asked}", "1")
            store.wait([f"peek/{asked}/answer"], datetime.timedelta(seconds=WAIT))
            return json.loads(store.get(f"peek/{asked}/answer"))

        try:

            def pulled() -> list:
                return json.loads(store.get("peek/pulled")) if store.check(["peek/pulled"]) else []

            push_until(a, td, lambda: len(pulled()) >= 5, "the receiver did not pull from A")
            held = a.version  # (sync mode: the receiver has it; its pull records it a moment later)
            deadline = time.monotonic() + WAIT
            while pulled()[-1] < held:
                assert time.monotonic() < deadline, ("the receiver did not record A's newest", held)
            a.close()
            store.set(key("back", "version"), "0")  # (the next sender numbers from 1 again)
            b = cudarecv.ElasticSender(td, store=store, name="back", mode="sync", timeout=TIMEOUT)
            answers = []
            deadline = time.monotonic() + WAIT
            while (
                b.version < held
            ):  # (B's versions up to A's newest: the receiver takes them, publishes none)
                assert time.monotonic() < deadline, b.receivers
                fill(td, b.version + 1)
                b.push()
                answers.append(peek())
            push_until(
                b, td, lambda: pulled()[-1] > held, "the receiver did not take B's newer versions"
            )
            answers.append(peek())
            store.set("peek/stop", "1")
            store.set(f"peek/{asked + 1}", "1")
            actor.join(WAIT)
        finally:
            a.close()
            if b is not None:
                b.close()
            actor.kill()
        got = pulled()
    assert got == sorted(set(got)) and got[-1] > held, (got, held)
    for version, value, whole in answers[:-1]:  # (before B passed A: A's newest stays published)
        assert version == value == held and whole, (answers, held)
    assert answers[-1][0] == answers[-1][1] > held and answers[-1][2], answers
    assert actor.exitcode == 0, actor.exitcode


def closing_puller(conn, port: int, name: str) -> None:
    """An actor whose pull (on a thread of its own) waits for the name's next sender once the first closed; its
    main thread closes the receiver then; what the pull ended with (and when) in the store."""
    conn.close()
    signals = store_client(port)
    receiver = cudarecv.ElasticReceiver(store=store_client(port), name=name, timeout=60.0)
    outcome: list = []
    pulls = store_client(port)  # (the pull thread's own client: this thread's waits hold `signals`)

    def pull() -> None:
        try:
            while True:
                outcome.append(["version", receiver.pull(timeout=60.0)])
                pulls.set("close/pulled", "1")
        except cudarecv.Error as error:
            outcome.append([type(error).__name__, str(error), time.monotonic()])

    thread = start_thread(pull, "puller")
    signals.wait(["close/now"], datetime.timedelta(seconds=WAIT))  # (the first sender closed)
    deadline = time.monotonic() + WAIT
    while not any(
        t.name == f"cudarecv-rejoin-{name}" for t in threading.enumerate()
    ):  # (the pull waits for the next)
        assert time.monotonic() < deadline, "the pull never looked for the next sender"
        time.sleep(0.01)
    closed = time.monotonic()
    receiver.close()
    thread.join(WAIT)
    signals.set("close/outcome", json.dumps(outcome[-1][:2] + [outcome[-1][-1] - closed]))
    # (alive while the next sender pushes and counts its receivers)
    signals.wait(["close/exit"], datetime.timedelta(seconds=WAIT))


@pytest.mark.timeout(300)
def test_close_from_another_thread_ends_a_pull_that_waits_for_the_next_sender():
    """A pull waits for the name's next sender (the first closed); close() from another thread ends it at once
    with UsageError, and it never joins the next sender (which then serves nobody)."""
    with master_store() as store:
        td = weights()
        first = cudarecv.ElasticSender(
            td, store=store, name="closing", mode="sync", timeout=TIMEOUT
        )
        actor = fork_process(closing_puller, (store.port, "closing"))
        second = None
        try:
            push_until(
                first, td, lambda: store.check(["close/pulled"]), "the receiver pulled nothing"
            )
            first.close()
            store.set("close/now", "1")
            # the next sender comes once the receiver closed (one made meanwhile may be joined and left at once,
            # which is right too); the actor lives on until the sender has pushed and counted its receivers
            store.wait(["close/outcome"], datetime.timedelta(seconds=WAIT))
            outcome = json.loads(store.get("close/outcome"))
            second = cudarecv.ElasticSender(
                td, store=store, name="closing", mode="sync", timeout=TIMEOUT
            )
            for _ in range(3):
                fill(td, second.version + 1)
                second.push()
            receivers = second.receivers
            store.set("close/exit", "1")
            actor.join(WAIT)
        finally:
            first.close()
            if second is not None:
                second.close()
            actor.kill()
    kind, message, seconds = outcome
    assert kind == "UsageError" and "closed" in message, outcome
    assert seconds < 30, outcome  # (at once: not the pull's 60 s, nor the receiver's)
    assert receivers == [], receivers
    assert actor.exitcode == 0, actor.exitcode


# -- the store's records as untrusted input ----------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_garbage_join_requests_are_skipped_and_honest_receivers_still_join(thread_errors):
    """Join requests that are not JSON, a JSON list, wrong fields, a forged closing record, and a number taken but
    never written: each is logged and skipped, the admission thread lives on, and an honest receiver joins."""
    name = "joins"
    with master_store() as store:
        td = weights()
        sender = cudarecv.ElasticSender(td, store=store, name=name, mode="latest", timeout=TIMEOUT)
        actor = None
        try:
            for garbage in (
                b"not json",
                b"[1, 2]",
                b'{"host": 5, "pid": "x"}',
                b'{"closing": "forged"}',
                None,
            ):
                k = store.add(key(name, "g1", "joins"), 1)
                if (
                    garbage is not None
                ):  # (None: the number taken, never written: a receiver that died between)
                    store.set(key(name, "g1", "join", k), garbage)
            fill(td, 1)
            sender.push()
            actor = fork_process(puller, (store.port, store.port, name, "j", 60.0))
            push_until(sender, td, lambda: seen(store, "j"), "the honest receiver never pulled")
            assert any(t.name == f"cudarecv-admit-{name}" for t in threading.enumerate())
            store.set("j/stop", "1")
            actor.join(WAIT)
            receivers = sender.receivers
        finally:
            sender.close()
            if actor is not None:
                actor.kill()
        assert int(store.get("j/id")) == 6, store.get("j/id")
        got = seen(store, "j")
    assert all(whole for _, whole in got) and [r["id"] for r in receivers] == [6], (got, receivers)
    assert actor.exitcode == 0, actor.exitcode
    assert not thread_errors, thread_errors


RECORD = {"host": "h", "pid": 1, "mode": "sync", "timeout": 5.0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "garbage, problem",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "a JSON list"),
        (json.dumps({**RECORD, "timeout": -1}).encode(), "its timeout is -1"),
        (json.dumps({**RECORD, "timeout": 1e300}).encode(), "its timeout is 1e+300"),
        (b'{"host": "h", "pid": 1, "mode": "sync", "timeout": NaN}', "its timeout is nan"),
        (json.dumps({**RECORD, "mode": "x"}).encode(), "its mode is 'x'"),
        (json.dumps({**RECORD, "pid": "abc"}).encode(), "its pid is 'abc'"),
        (json.dumps({"pid": 1, "mode": "sync", "timeout": 5}).encode(), "its host is 'None'"),
        (json.dumps({**RECORD, "host": "h" * 5000}).encode(), "bytes, more than 4096"),
    ],
)
def test_a_senders_record_that_cudarecv_did_not_write_is_refused_naming_the_key(
    garbage, problem, thread_errors
):
    """A receiver finds the name's newest sender record tampered with: StoreRecordError naming the key and the
    fix (before it joins: no pair waits for a sender); no thread of it dies, none is left."""
    name = f"record-{abs(hash(garbage)) % 10**8}"
    with master_store() as store:
        generation = store.add(key(name, "generation"), 1)
        store.set(key(name, f"g{generation}", "sender"), garbage)
        store.set(key(name, "current"), str(generation))
        with pytest.raises(cudarecv.StoreRecordError, match=re.escape(problem)) as caught:
            cudarecv.ElasticReceiver(store=store, name=name, timeout=5.0)
    assert caught.value.key == key(name, "g1", "sender") and "another `name`" in str(
        caught.value
    ), caught.value
    assert not any(t.name.startswith("cudarecv-heartbeat") for t in threading.enumerate())
    assert not thread_errors, thread_errors


@pytest.mark.timeout(300)
def test_garbage_in_current_and_the_version_counter_neither_blocks_nor_fences(thread_errors):
    """``current`` set to garbage or to a generation with no record, the version counter to garbage: the sender
    is not fenced and its versions go on increasing; receivers joining meanwhile find the sender within their
    timeout (not the store client's) and pull whole versions."""
    name = "current"
    with master_store() as store:
        td = weights()
        sender = cudarecv.ElasticSender(td, store=store, name=name, mode="latest", timeout=TIMEOUT)
        actors = []
        versions = []
        try:
            for tag, tamper in (
                ("c1", ("current", b"xyz")),
                ("c2", ("current", b"999")),
                ("c3", ("version", b"-5")),
                ("c4", ("version", b"abc")),
            ):
                store.set(key(name, tamper[0]), tamper[1])
                fill(td, sender.version + 1)
                versions.append(sender.push())
                began = time.monotonic()
                actors.append(fork_process(puller, (store.port, store.port, name, tag, 20.0)))
                push_until(
                    sender, td, lambda tag=tag: seen(store, tag), f"receiver {tag} never pulled"
                )
                versions.append(sender.version)
                assert time.monotonic() - began < 60, tag  # (not the store client's 120 s)
            for tag in ("c1", "c2", "c3", "c4"):
                store.set(f"{tag}/stop", "1")
            for actor in actors:
                actor.join(WAIT)
        finally:
            sender.close()
            for actor in actors:
                actor.kill()
        got = {tag: seen(store, tag) for tag in ("c1", "c2", "c3", "c4")}
    assert versions == sorted(versions) and len(set(versions)) == len(versions), versions
    for tag, pulled in got.items():
        assert pulled and all(whole for _, whole in pulled), (tag, pulled)
    assert [actor.exitcode for actor in actors] == [0] * 4
    assert not thread_errors, thread_errors


def beat_counter(conn, port: int, name: str) -> None:
    """An actor that joins and then only beats (it pulls once): its id in the store, then it waits to be told."""
    conn.close()
    signals = store_client(port)
    receiver = cudarecv.ElasticReceiver(store=store_client(port), name=name, timeout=60.0)
    receiver.pull(timeout=WAIT)
    signals.set("beat/id", str(receiver.id))
    signals.wait(["beat/stop"], datetime.timedelta(seconds=WAIT))
    receiver.close()


@pytest.mark.timeout(300)
def test_a_tiny_timeout_in_the_senders_record_does_not_make_the_heartbeat_spin():
    """The sender's record says its timeout is 1e-9 s (tampered with): the receiver beats at most every 50 ms."""
    name = "spin"
    with master_store() as store:
        td = weights()
        sender = cudarecv.ElasticSender(td, store=store, name=name, mode="latest", timeout=TIMEOUT)
        store.set(
            key(name, "g1", "sender"), json.dumps({**RECORD, "mode": "latest", "timeout": 1e-9})
        )
        actor = fork_process(beat_counter, (store.port, name))
        try:
            fill(td, 1)
            sender.push()
            store.wait(["beat/id"], datetime.timedelta(seconds=WAIT))
            alive = key(name, "g1", "alive", store.get("beat/id").decode())
            began, first = time.monotonic(), store.add(alive, 0)
            time.sleep(1.0)  # (a window to count beats in: load only lowers their rate)
            beats, window = store.add(alive, 0) - first, time.monotonic() - began
            store.set("beat/stop", "1")
            actor.join(WAIT)
        finally:
            sender.close()
            actor.kill()
    assert beats <= window / 0.05 + 2, (beats, window)
    assert actor.exitcode == 0, actor.exitcode


def dying_puller(conn, port: int, name: str) -> None:
    """An actor on the wire that pulls one version, then SIGKILLs itself in the next pull as soon as it has posted
    the receives of the payload and the first message landed (mid-pull: 20 MiB in 64 KiB messages, on their
    way)."""
    from cudarecv.weights import pulling

    conn.close()
    signals = store_client(port)
    receiver = cudarecv.ElasticReceiver(
        store=store_client(port), name=name, timeout=60.0, transport="wire"
    )
    receiver.pull(timeout=WAIT)
    real = pulling.recv_into

    def die_mid_payload(*args, **kwargs):
        receiving = real(*args, **kwargs)
        works = next(receiving)  # (the receives posted: the sender's sends go)
        works[0].wait()  # (the first message landed, the others on their way)
        os.kill(os.getpid(), signal.SIGKILL)
        yield works

    pulling.recv_into = die_mid_payload
    signals.set("dying/pid", str(os.getpid()))
    receiver.pull(timeout=WAIT)


@pytest.mark.timeout(300)
def test_a_receiver_killed_mid_pull_is_dropped_when_its_link_fails_not_after_the_timeout():
    """Sync mode: a joined receiver SIGKILLed mid-pull (the header taken, the payload's sends waiting): the push
    returns as soon as its link fails, well inside the sender's timeout, and the receiver is dropped for that
    failure, not as one that "did not take" the version (gloo may leave a send to a dead peer waiting: the
    listener that finds the link dead fails the push's transfer at once)."""
    name = "killed"
    with master_store() as store:
        td = TensorDict(w=torch.zeros(1 << 22), b=torch.zeros(1 << 20))
        timeout = 20.0
        sender = cudarecv.ElasticSender(
            td,
            store=store,
            name=name,
            mode="sync",
            timeout=timeout,
            transport="wire",
            bucket_bytes=64 << 10,
            fanout="star",
        )
        actor = fork_process(dying_puller, (store.port, name))
        try:
            push_until(sender, td, lambda: store.check(["dying/pid"]), "the receiver never pulled")
            began = time.monotonic()
            fill(td, sender.version + 1)
            sender.push()  # (elastic: never raises for a receiver that failed)
            took = time.monotonic() - began
            actor.join(WAIT)
            push_until(sender, td, lambda: 1 in sender.dropped, "the dead receiver was not dropped")
            dropped = sender.dropped
            # (its threads end, its pair let go of: the send gloo left waiting ends a little past its deadline)
            push_until(
                sender,
                td,
                lambda: (
                    not any(
                        t.name.startswith(("cudarecv-push-1", "cudarecv-listen-1"))
                        for t in threading.enumerate()
                    )
                ),
                f"the dead receiver's threads ran on: {[t.name for t in threading.enumerate()]}",
            )
        finally:
            sender.close()
            actor.kill()
    assert actor.exitcode == -signal.SIGKILL, actor.exitcode
    assert took < timeout / 2, took
    assert (
        list(dropped) == [1] and "failed after" in dropped[1] and "did not take" not in dropped[1]
    ), dropped


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "latest"])
def test_a_receiver_whose_join_the_sender_gave_up_on_joins_again(mode, monkeypatch):
    """The sender gives up on a join whose handshake the receiver ended (on a loaded machine its answer came past
    the sender's timeout; here the sender's side raises once the answer came): the sender says in the store that
    it dropped it, so the receiver, which would otherwise wait for versions nobody sends it, joins again and
    pulls whole versions."""
    from cudarecv.weights import handshake

    real, given_up = handshake.offer, []

    def late(*args, **kwargs):
        answers = real(*args, **kwargs)
        if not given_up:
            given_up.append(answers)
            raise cudarecv.TransferTimeout("its answer came too late (the test's)")
        return answers

    monkeypatch.setattr(handshake, "offer", late)
    name = f"late-{mode}"
    with master_store() as store:
        td = weights()
        sender = cudarecv.ElasticSender(td, store=store, name=name, mode=mode, timeout=TIMEOUT)
        actor = fork_process(puller, (store.port, store.port, name, name, 60.0))
        try:
            push_until(
                sender,
                td,
                lambda: any(whole for _, whole in seen(store, name)),
                "the receiver given up on did not join again and pull",
            )
            got, receivers = seen(store, name), sender.receivers
            store.set(f"{name}/stop", "1")
            actor.join(WAIT)
        finally:
            sender.close()
            actor.kill()
    assert given_up and actor.exitcode == 0, (given_up, actor.exitcode)
    assert all(whole for _, whole in got), got
    # its first join (1) never served; its second (2) served
    assert [r["id"] for r in receivers] == [2] and receivers[0]["state"] == "served", receivers
