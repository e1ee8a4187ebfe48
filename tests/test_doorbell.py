"""The doorbell of same-host weight sync (:mod:`cudarecv.samehost.doorbell`): its page in one process, and pushes
between real processes that ring it (blocking or not, sync and latest mode), with the failures around it: a
receiver killed while the sender sleeps on its doorbell, a sender closing while a pull sleeps there, a garbled
header."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from churn import WAIT, fork_process, master_store, store_client
from cudarecv.core.errors import OutOfStepError
from cudarecv.core.transfer import Transfer
from cudarecv.samehost import doorbell
from cudarecv.samehost.doorbell import DOWN_SEQ, Bell, Mailbox
from cudarecv.samehost.shared_memory import MappingError
from cudarecv.testing.launch import Cluster
from cudarecv.weights.inbox import NAP, Rung
from cudarecv.weights.wire import BYE, GOT, PushHeader, ask_message, read_ask
from held import threads
from procs import stop_here, wait_stopped
from rawwire import store, unique_key

pytestmark = pytest.mark.skipif(
    doorbell.available() is not None, reason=f"no doorbell here: {doorbell.available()}"
)


def test_the_page_carries_one_header_and_one_word_each_way_and_wakes_its_sleeper():
    mailbox = Mailbox()
    bell = Bell(mailbox.offer())
    header = PushHeader(3, 100, 64, bytes(16), shared=True, segment=1, bell=True)
    assert not mailbox.rung() and bell.heard() is None
    bell.ring(header.pack())
    assert mailbox.rung()
    assert PushHeader.unpack(mailbox.take()[: len(header.pack())]) == header
    assert not mailbox.rung(), "a header is taken once"
    mailbox.answer(ask_message(GOT, 3))
    raw = bell.heard()
    assert raw is not None and read_ask(raw[:40]).version == 3
    assert bell.heard() is None, "a word is heard once"
    # a wake that comes between reading the wake word and going to sleep is not lost: the sleep returns at once
    for sleeper, waker in (
        (mailbox, mailbox.kick),
        (mailbox, lambda: bell.ring(header.pack())),
        (bell, bell.kick),
        (bell, lambda: mailbox.answer(ask_message(GOT, 4))),
    ):
        mark = sleeper.wakes()
        waker()
        thread = threading.Thread(target=sleeper.sleep, args=(mark, 60))
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), f"{waker} did not wake the sleeper"
    # and one asleep is woken
    mark = mailbox.wakes()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (mailbox.sleep(mark, 60), done.set()))
    thread.start()
    mailbox.kick()
    assert done.wait(30)
    thread.join()
    mailbox.close()


def test_a_latest_mode_ask_by_the_page_is_owned_by_exactly_one_end():
    """The receiver's ask stands while the sender has nothing newer, and the next publish takes it (once); asked
    when a newer version is out, it is withdrawn (the receiver asks on the link); a sharded floor past the version
    published stays for a later one; a second ask while one stands is out of step."""
    mailbox = Mailbox()
    bell = Bell(mailbox.offer())
    assert bell.published(4) is None, "nobody asked"
    assert mailbox.ask(4), "nothing newer than 4 is out: the ask stands"
    with pytest.raises(OutOfStepError):
        mailbox.ask(4)
    assert bell.published(5) == 4, "the publish of 5 takes the ask past 4"
    assert bell.published(6) is None, "an ask is taken once"
    assert not mailbox.ask(5), "6 is out: the ask past 5 is withdrawn, to go on the link"
    assert bell.published(7) is None, "a withdrawn ask is nobody's to take"
    assert mailbox.ask(9) and bell.published(8) is None, "an ask past 9 waits for a version past it"
    assert bell.published(10) == 9
    mailbox.close()


#: words of the race below, in a page shared by the two processes: the round to go, the sender's round done, what
#: it took in it (1 + the floor, or 0), and each side's "I am past my store" flag for the rounds that order it
_GO, _DONE, _TOOK, _PUBLISHED, _ASKED_FLAG = 0, 64, 128, 192, 256


def _spin_until(page: Any, word: int, value: int, deadline: float) -> None:
    from cudarecv.core.host_copy import observe

    while observe(page + word) != value:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other process never reached {value} (word {word})")


def test_an_ask_and_a_publish_at_once_are_owned_by_exactly_one_end():
    """A receiver's ask and a sender's publish, in two processes on the page, 3000 rounds: a third with the publish
    first (the ask is withdrawn), a third with the ask first (the publish takes it), a third started together and
    run free (random spins before each). In every round exactly one end owns the ask; both outcomes occur."""
    import mmap
    import random

    from cudarecv.core.host_copy import publish

    mailbox = Mailbox()
    bell = Bell(mailbox.offer())
    rounds = 3000
    shared = mmap.mmap(-1, 4096)  # (anonymous and shared: the forked sender sees the same words)
    page = ctypes.addressof(ctypes.c_char.from_buffer(shared))
    deadline = time.monotonic() + 120
    pid = os.fork()
    if pid == 0:  # the sender
        code = 1
        try:
            spins = random.Random(1)
            for i in range(rounds):
                _spin_until(page, _GO, i + 1, deadline)
                if i % 3 == 1:  # the ask first
                    _spin_until(page, _ASKED_FLAG, i + 1, deadline)
                elif i % 3 == 2:
                    for _ in range(spins.randrange(200)):
                        pass
                floor = bell.published(i + 1)  # version i + 1, while the receiver asks past i
                publish(page + _TOOK, 0 if floor is None else floor + 1)
                publish(page + _PUBLISHED, i + 1)
                publish(page + _DONE, i + 1)
            code = 0
        finally:
            os._exit(code)
    outcomes = {"taken": 0, "withdrawn": 0}
    try:
        from cudarecv.core.host_copy import observe

        spins = random.Random(2)
        for i in range(rounds):
            publish(page + _GO, i + 1)
            if i % 3 == 0:  # the publish first
                _spin_until(page, _PUBLISHED, i + 1, deadline)
            elif i % 3 == 2:
                for _ in range(spins.randrange(200)):
                    pass
            stood = mailbox.ask(i)
            publish(page + _ASKED_FLAG, i + 1)
            _spin_until(page, _DONE, i + 1, deadline)
            took = observe(page + _TOOK)
            assert stood == (took == i + 1), (
                f"round {i}: the ask stood {stood}, the publish took {took - 1 if took else None}"
            )
            outcomes["taken" if stood else "withdrawn"] += 1
    except BaseException:
        os.kill(pid, signal.SIGKILL)  # (it would spin until its deadline)
        raise
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the sender's process failed"
    assert outcomes["taken"] >= rounds // 3 and outcomes["withdrawn"] >= rounds // 3, outcomes
    mailbox.close()


class _Gate:
    """A work that completes once :meth:`open` is called."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def is_completed(self) -> bool:
        return self.opened.is_set()

    def wait(self, timeout: Any = None) -> bool:
        return self.opened.wait(30)


def test_a_pull_asleep_on_the_doorbell_wakes_as_the_standing_receive_ends_not_a_nap_later():
    """The standing receive's done-callback kicks the doorbell before the transfer is settled: a sleeper woken by
    that kick must see the receive ended then (it used to look at ``settled``, went back to sleep, and woke only
    at its next NAP: a receiver's close() took 0.2 s one time in two)."""
    mailbox = Mailbox()
    gate = _Gate()

    def protocol() -> Any:
        yield [gate]
        return "header"

    standing = Transfer(protocol(), None)
    kicked, looked = threading.Event(), threading.Event()
    standing.add_done_callback(lambda _: (mailbox.kick(), kicked.set()))
    standing.add_done_callback(
        lambda _: looked.wait(30)
    )  # holds the window between the kick and settled open
    rung = Rung(SimpleNamespace(mailbox=mailbox, standing=standing))  # type: ignore[arg-type]
    ending = threading.Thread(target=lambda: (gate.opened.set(), standing.wait(30)))
    ending.start()
    try:
        assert kicked.wait(30)
        started = time.monotonic()
        woke = rung.wait_for(5.0)  # the kick has come: it sees the receive ended at once
        took = time.monotonic() - started
    finally:
        looked.set()
        ending.join(30)
    assert woke and took < NAP, f"the sleeper saw the standing receive end after {took:.3f} s"
    assert standing.settled and standing.wait(1) == "header"
    mailbox.close()


def test_a_malformed_offer_or_header_is_refused():
    with pytest.raises(MappingError, match="malformed"):
        Bell("bell 1 2")
    with pytest.raises(MappingError):
        Bell(
            f"bell 1 {2**20} {bytes(16).hex()}"
        )  # no such descriptor (pid 1's is not ours to open)
    header = PushHeader(3, 100, 64, bytes(16), bell=True)  # a doorbell without a shared push
    with pytest.raises(OutOfStepError):
        PushHeader.unpack(header.pack())


def _model() -> TensorDict:
    return TensorDict(w=torch.zeros(50_000), b=TensorDict(c=torch.zeros(7, dtype=torch.int64)))


def _fill(td: TensorDict, version: int) -> None:
    td["w"].fill_(version)
    td["b", "c"].fill_(version)


def _holds(td: TensorDict, version: int) -> bool:
    return bool((td["w"] == version).all() and (td["b", "c"] == version).all())


def rings(rank, world, group, mode, wait, zero_copy, key):
    """Versions 1..12, each exact: the first header on the link (it says the doorbell rings), the rest rung."""
    td = _model()
    if rank == 0:
        sender = cudarecv.WeightSender(td, dst=1, mode=mode, timeout=60)
        for version in range(1, 13):
            _fill(td, version)
            if wait:
                sender.push()
            else:
                pushed = sender.push(wait=False)
                if mode == "sync":
                    for transfer in pushed:
                        transfer.wait(60)
            if mode == "latest":  # the receiver takes every version before the next
                store().wait([f"{key}_{version}"])
        [member] = sender._s.members
        rung = member.rings
        sender.close()
        return rung
    receiver = cudarecv.WeightReceiver(src=0, timeout=60, zero_copy=zero_copy)
    ok = []
    for version in range(1, 13):
        got = receiver.pull() if wait else receiver.pull(wait=False).wait(60)
        ok.append(got == version and _holds(receiver.td, version))
        if mode == "latest":
            store().set(f"{key}_{version}", "1")
    inbox = receiver._inbox
    assert inbox.mailbox is not None
    count = doorbell._Page(inbox.mailbox._segment).load(DOWN_SEQ)
    receiver.close()
    return ok, inbox.ringing, count


@pytest.mark.parametrize(
    "mode, wait, zero_copy",
    [
        ("sync", True, False),
        ("sync", False, False),
        ("sync", True, True),
        ("latest", True, False),
        ("latest", False, True),
    ],
    ids=[
        "sync-blocking",
        "sync-background",
        "sync-zero_copy",
        "latest-blocking",
        "latest-zero_copy",
    ],
)
def test_pushes_after_the_first_ring_the_doorbell(cluster, mode, wait, zero_copy):
    rung, (ok, ringing, count) = cluster().run(
        rings, args=(mode, wait, zero_copy, unique_key("bell")), timeout=120
    )
    assert all(ok), ok
    assert rung and ringing
    assert count == 11, f"{count} of 11 headers after the first came by the doorbell"


def killed_unanswered(rank, world, group, key):
    """The receiver dies having taken a rung header, without a word: the sender's push, asleep on the doorbell,
    is woken by its listener (the link died) and raises, naming it; it does not wait out its timeout."""
    td = _model()
    if rank == 0:
        sender = cudarecv.WeightSender(td, dst=1, timeout=600)
        sender.push()
        sender.push()
        with pytest.raises(cudarecv.PeerError) as error:
            sender.push()
        sender.close()
        return str(error.value)
    receiver = cudarecv.WeightReceiver(src=0, timeout=600)
    receiver.pull()
    receiver.pull()  # (rung)
    receiver._inbox.mailbox.answer = lambda raw: stop_here(signal.SIGKILL)
    receiver.pull()


def joined_puller(conn, port: int, name: str) -> None:
    """An actor: join ``name`` through the store, pull 12 versions; in the store whether each came whole, and
    whether the doorbell rang (and how many headers came by it)."""
    conn.close()
    names = store_client(port)
    receiver = cudarecv.ElasticReceiver(store=store_client(port), name=name, timeout=60)
    seen = []
    for _ in range(12):
        version = receiver.pull(timeout=60)
        with receiver.reading() as td:
            seen.append([version, _holds(td, version)])
    inbox = receiver._joined._inbox
    count = (
        doorbell._Page(inbox.mailbox._segment).load(DOWN_SEQ) if inbox.mailbox is not None else 0
    )
    names.set(f"{name}/result", json.dumps([seen, inbox.ringing, count]))
    receiver.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "latest"])
def test_a_receiver_that_joined_through_a_store_has_its_doorbell_rung(mode):
    """An ElasticSender's same-host receiver: after the first push it serves, the headers come by the doorbell;
    every version whole, each newer than the last (sync: every one pushed)."""
    name = f"bell-{mode}"
    with master_store() as names:
        td = _model()
        sender = cudarecv.ElasticSender(td, store=names, name=name, mode=mode, timeout=60)
        actor = fork_process(joined_puller, (names.port, name))
        try:
            deadline = time.monotonic() + WAIT
            while not names.check([f"{name}/result"]):  # (pushes until it has 12)
                assert time.monotonic() < deadline, f"no 12 versions taken: {sender.receivers}"
                _fill(td, sender.version + 1)
                sender.push()
            seen, ringing, count = json.loads(names.get(f"{name}/result"))
            actor.join(WAIT)
        finally:
            sender.close()
            actor.kill()
    versions = [v for v, _ in seen]
    assert all(whole for _, whole in seen), seen
    assert versions == sorted(set(versions)), versions
    if mode == "sync":
        assert versions == list(range(versions[0], versions[0] + 12)), versions
    assert ringing and count >= 11, (ringing, count)
    assert actor.exitcode == 0, actor.exitcode


def test_a_receiver_killed_while_the_sender_sleeps_on_its_doorbell_fails_the_push():
    with Cluster(2, pg_timeout=20.0) as ranks:
        text, _ = ranks.run(killed_unanswered, args=(unique_key("k"),), may_die={1}, timeout=120)
    assert "rank 1" in text and "dropped" in text, text


def _ringing(rank: int, td: TensorDict, timeout: float) -> Any:
    """Rank 0: a sender that pushed versions 1 and 2; else a receiver that pulled them: its doorbell rings now."""
    if rank == 0:
        sender = cudarecv.WeightSender(td, dst=1, timeout=timeout)
        for version in (1, 2):
            _fill(td, version)
            sender.push()
        return sender
    receiver = cudarecv.WeightReceiver(src=0, timeout=60)
    receiver.pull()
    receiver.pull()
    assert receiver._inbox.ringing
    return receiver


def closed_while_asleep(rank, world, group, key):
    """A blocking pull asleep on the doorbell raises SenderClosed when the sender closes (on the link)."""
    end = _ringing(rank, _model(), 60)
    if rank == 0:
        store().wait([f"{key}_pulling"])
        end.close()
        return None
    receiver = end
    store().set(f"{key}_pulling", "1")
    with pytest.raises(cudarecv.SenderClosed):
        receiver.pull(timeout=600)
    version = receiver.version
    receiver.close()
    return version


def test_a_sender_closing_wakes_a_pull_asleep_on_the_doorbell(cluster):
    _, version = cluster().run(closed_while_asleep, args=(unique_key("c"),), timeout=120)
    assert version == 2


def _asleep_on_the_doorbell(thread: threading.Thread) -> bool:
    """Whether ``thread`` is in the doorbell's wait (its stack, read from here)."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == "wait_for" and frame.f_code.co_filename.endswith("inbox.py"):
            return True
        frame = frame.f_back
    return False


def receiver_closed_while_asleep(rank, world, group, key):
    """A blocking pull asleep on the doorbell (on another thread) raises UsageError as soon as the receiver
    closes, while the sender is stopped (SIGSTOP): not once the sender's answer to the receiver's BYE woke it
    (that close waits for the answer until the sender goes on); version 2 stays readable."""
    end = _ringing(rank, _model(), 60)
    if rank == 0:
        store().set(f"{key}_pid", str(os.getpid()))
        store().wait([f"{key}_done"])
        end.close()
        return None
    receiver, ended = end, []

    def pull() -> None:
        try:
            receiver.pull(timeout=600)
        except BaseException as error:  # noqa: BLE001 - the test looks at it
            ended.append(error)

    thread = threading.Thread(target=pull)
    thread.start()
    deadline = time.monotonic() + 60
    while not _asleep_on_the_doorbell(thread):  # (a poll of its stack: yield the GIL between looks)
        assert thread.is_alive() and time.monotonic() < deadline, ended
        time.sleep(0.001)
    sender = int(store().get(f"{key}_pid"))
    os.kill(sender, signal.SIGSTOP)
    closer = threading.Thread(target=receiver.close)
    try:
        wait_stopped(sender)
        closer.start()
        thread.join(30)
        woken = not thread.is_alive()
        answered = not closer.is_alive()  # (it cannot be: the sender is stopped)
    finally:
        os.kill(sender, signal.SIGCONT)
    closer.join(90)
    store().set(f"{key}_done", "1")
    assert woken, "the pull slept on after close(), until the sender answered"
    assert not answered, "close() returned while the sender was stopped: the test proved nothing"
    assert len(ended) == 1 and isinstance(ended[0], cudarecv.UsageError), ended
    with receiver.reading() as td:
        return receiver.version, _holds(td, 2)


def test_closing_a_receiver_wakes_a_pull_asleep_on_the_doorbell(cluster):
    _, (version, whole) = cluster().run(
        receiver_closed_while_asleep, args=(unique_key("r"),), timeout=120
    )
    assert version == 2 and whole


def closed_between_close_and_bye(rank, world, group, key):
    """The receiver's close() comes between its standing receive's move to CLOSED (on the doorbell's listener
    thread: the sender closed) and that receive's BYE: the BYE still goes, so the sender's close() ends its
    listener at once (before the fix, close() let go of the link first and the BYE was never posted: the sender
    waited for it its whole timeout, and its listener thread was left running)."""
    if rank == 0:
        before = threads()
        sender = _ringing(rank, _model(), 20.0)
        store().wait([f"{key}_ready"])
        start = time.monotonic()
        sender.close()
        return time.monotonic() - start, sorted(threads() - before)
    receiver = _ringing(rank, _model(), 20.0)
    inbox = receiver._inbox
    in_window, forgetting, forgot = threading.Event(), threading.Event(), threading.Event()
    seen: list[str] = []
    post, forget = inbox.asks.post, inbox.forget

    def held_post(data: bytes) -> int:
        if data == ask_message(BYE) and threading.current_thread() is not threading.main_thread():
            seen.append(threading.current_thread().name)
            in_window.set()  # moved to CLOSED, BYE not posted yet: close() now
            forgetting.wait(60)
            forgot.wait(
                2
            )  # (fixed: forget waits for this BYE, so this wait runs out; unfixed: it let go first)
        return post(data)

    def watched_forget(timeout: float) -> None:
        forgetting.set()
        forget(timeout)
        forgot.set()

    inbox.asks.post, inbox.forget = held_post, watched_forget
    store().set(f"{key}_ready", "1")
    assert in_window.wait(60), "the sender's CLOSED never reached the standing receive"
    assert receiver._inbox.sender_closed
    receiver.close()
    return seen


def test_a_receiver_closing_as_its_listener_answers_closed_still_says_bye(cluster):
    (took, left), seen = cluster().run(
        closed_between_close_and_bye, args=(unique_key("b"),), timeout=120
    )
    assert len(seen) == 1, seen  # the BYE was held on the standing receive's thread, not close()'s
    assert not left, f"threads left after the sender's close(): {left} (close took {took:.1f} s)"
    assert took < 15.0, f"the sender's close() waited {took:.1f} s for a BYE"


def garbled(rank, world, group, key):
    """A header rung garbled: the receiver's pull refuses it (out of step), and says why."""
    end = _ringing(rank, _model(), 10)
    if rank == 0:
        [member] = end._s.members
        member.bell.ring(b"\x07" * 112)
        store().wait([f"{key}_refused"])
        end.close()
        return None
    receiver = end
    with pytest.raises(OutOfStepError) as error:
        receiver.pull()
    store().set(f"{key}_refused", "1")
    with pytest.raises(cudarecv.BrokenError):
        receiver.pull()
    receiver.close()
    return str(error.value), _holds(receiver.td, 2)


def test_a_garbled_doorbell_header_is_refused(cluster):
    _, (text, kept) = cluster().run(garbled, args=(unique_key("g"),), timeout=120)
    assert "weight-push header" in text or "doorbell" in text, text
    assert kept, "the published version changed"


def test_two_threads_moving_a_wake_word_at_once_both_count():
    """A ring and a kick may move the same wake word at once; each adds to it atomically, so no move is lost (a
    load-then-store lost one, and a sleeper that had read the word between them slept a NAP)."""
    mailbox = Mailbox()
    bell = Bell(mailbox.offer())
    start, each = mailbox.wakes(), 20_000
    barrier = threading.Barrier(2, timeout=30)

    def kicks(kick: Any) -> None:
        barrier.wait()
        for _ in range(each):
            kick()

    raw = PushHeader(3, 100, 64, bytes(16), shared=True, segment=1, bell=True).pack()
    movers = [
        threading.Thread(target=kicks, args=(k,)) for k in (mailbox.kick, lambda: bell.ring(raw))
    ]
    for mover in movers:
        mover.start()
    for mover in movers:
        mover.join(60)
    assert mailbox.wakes() == start + 2 * each
    mailbox.close()


def _switches(prefix: str) -> int:
    """Voluntary context switches so far of this process's threads named ``prefix``... (each a wake-up)."""
    total = 0
    for thread in threading.enumerate():
        if thread.name.startswith(prefix) and thread.native_id is not None:
            with open(f"/proc/self/task/{thread.native_id}/status") as status:
                text = status.read()
            total += int(text.split("\nvoluntary_ctxt_switches:")[1].split()[0])
    return total


def lazy_pushes(rank, world, group, key):
    """Background pushes by the doorbell: each waits for the receiver's signal that it has the version before the
    next (a trainer computing meanwhile)."""
    td = _model()
    pushes = 40
    if rank == 0:
        sender = cudarecv.WeightSender(td, dst=1, mode="sync", timeout=60)
        _fill(td, 1)
        sender.push()  # the first says on the link that the next ones ring the doorbell
        store().wait([f"{key}_1"])
        before = _switches("cudarecv-push")
        for version in range(2, pushes + 2):
            _fill(td, version)
            sender.push(wait=False)  # (the next push takes the previous one's word)
            store().wait([f"{key}_{version}"])
        woken = _switches("cudarecv-push") - before
        # a push the receiver answered that nobody waits for ends at its deadline, and keeps the receiver
        _fill(td, pushes + 2)
        [late] = sender.push(wait=False, timeout=3.0)
        store().wait([f"{key}_{pushes + 2}"])
        deadline = time.monotonic() + 30
        while not late.settled and time.monotonic() < deadline:
            time.sleep(0.01)
        late_settled, late_failed = late.settled, late.failed
        # a done-callback runs as the push ends, with nobody waiting for it (its deadline is a minute away)
        _fill(td, pushes + 3)
        [called] = sender.push(wait=False)
        ran = threading.Event()
        called.add_done_callback(lambda _: ran.set())
        by_itself = ran.wait(30)
        _fill(td, pushes + 4)
        sender.push()  # (and the receiver is still served)
        dropped = sender.dropped
        store().set(
            f"{key}_looked", "1"
        )  # (the receiver closes only then: a closed one is not served)
        sender.close()
        return dict(
            woken=woken,
            late_settled=late_settled,
            late_failed=late_failed,
            by_itself=by_itself,
            dropped=dropped,
        )
    receiver = cudarecv.WeightReceiver(src=0, timeout=60, zero_copy=True)
    held = []
    for version in range(1, pushes + 5):
        receiver.pull(timeout=60)
        held.append(_holds(receiver.td, version))
        store().set(f"{key}_{version}", "1")
    store().wait([f"{key}_looked"])
    receiver.close()
    return held


def test_a_background_push_by_doorbell_wakes_no_sender_thread_and_ends_by_wait_callback_or_deadline(
    cluster,
):
    """A background push to a receiver with a doorbell wakes no thread of the sender while the caller computes:
    the next push takes the receiver's word on the caller's thread (the driver thread of each receiver woke at
    least twice a push before: once handed the push, once by the word). A push nobody waits for still ends when
    it should: by its deadline (the word came: it succeeds, the receiver stays served), or as the word comes
    once a done-callback waits for it."""
    sender, held = cluster().run(lazy_pushes, args=(unique_key("lazy"),), timeout=240)
    assert all(held), f"a version was torn or stale: {held}"
    assert sender["woken"] < 20, f"the sender's threads woke {sender['woken']} times in 40 pushes"
    assert sender["late_settled"] and not sender["late_failed"], sender
    assert sender["by_itself"], "the done-callback did not run until something waited"
    assert sender["dropped"] == {}, sender["dropped"]


def closes_before_its_word_is_taken(rank, world, group, key):
    """A zero-copy receiver takes the last version of a blocking push and closes at once; the sender's caller takes
    that version's word (said by the doorbell before the BYE) only after the BYE's RELEASED retired what the
    receiver held (ordered here: its take waits for the retire)."""
    from cudarecv.weights import fanout, snapshots

    td = _model()
    if rank == 0:
        retired = threading.Event()
        retire, take = snapshots.SnapshotPool.retire, fanout.Heard._take

        def retiring(self, member):
            retire(self, member)
            retired.set()

        def late_take(self):
            if self.version == 3:
                retired.wait(30)
            take(self)

        snapshots.SnapshotPool.retire = retiring
        fanout.Heard._take = late_take
        sender = cudarecv.WeightSender(td, dst=1, mode="sync", timeout=60)
        for version in (1, 2, 3):  # the first on the link, the next two by the doorbell
            _fill(td, version)
            try:
                sender.push()
                error = None
            except Exception as failure:  # noqa: BLE001 - returned to the test
                error = repr(failure)
        came = retired.is_set()
        sender.close()
        return error, came
    receiver = cudarecv.WeightReceiver(src=0, timeout=60, zero_copy=True)
    held = []
    for version in (1, 2, 3):
        receiver.pull(timeout=60)
        held.append(_holds(receiver.td, version))
    receiver.close()
    return held


def test_a_receiver_closing_before_its_last_word_is_taken_fails_no_push(cluster):
    """The BYE comes on the link and the word by the page: the push that takes the word after the receiver's
    RELEASED retired its snapshots succeeds (it was out of step: "let go of version 2, which it does not hold")."""
    (error, came), held = cluster().run(
        closes_before_its_word_is_taken, args=(unique_key("closing"),), timeout=240
    )
    assert came, "the retire never came before the last word was taken"
    assert error is None, error
    assert all(held), held


def closes_after_its_last_pull(rank, world, group, key):
    """A zero-copy receiver takes the last version of a background push and closes at once; the sender waits for
    that push only after the receiver's close has ended (its BYE answered)."""
    td = _model()
    if rank == 0:
        sender = cudarecv.WeightSender(td, dst=1, mode="sync", timeout=60)
        _fill(td, 1)
        sender.push()  # (the next ones ring the doorbell)
        _fill(td, 2)
        sender.push()
        _fill(td, 3)
        [last] = sender.push(wait=False)
        store().wait([f"{key}_closed"])
        # and until the sender's answer to its BYE has let go of every snapshot the receiver held (sent before that)
        [member] = sender._s.members
        deadline = time.monotonic() + 30
        while member.holding and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            last.wait(60)
            error = None
        except Exception as failure:  # noqa: BLE001 - returned to the test
            error = repr(failure)
        dropped = sender.dropped
        sender.close()
        return error, dropped
    receiver = cudarecv.WeightReceiver(src=0, timeout=60, zero_copy=True)
    for version in (1, 2, 3):
        receiver.pull(timeout=60)
        assert _holds(receiver.td, version)
    receiver.close()  # (it lets go of version 2 with its word on 3, then of 3 on the link, and says BYE)
    store().set(f"{key}_closed", "1")
    return None


def test_a_receiver_closing_right_after_a_background_push_leaves_that_push_whole(cluster):
    """The sender's answer to a receiver's BYE (RELEASED, which lets go of every snapshot the receiver held) comes
    after the push in flight to it has taken the receiver's word: a background push nothing drove yet took the
    word only once asked, after that, found the snapshot its word let go of already let go of, and failed the
    push (out of step) and dropped the receiver."""
    (error, dropped), _ = cluster().run(
        closes_after_its_last_pull, args=(unique_key("closes"),), timeout=120
    )
    assert error is None, error
    assert dropped == {1: "closed by its receiver"}, dropped


def latest_rung(rank, world, group, key):
    """Latest mode, a zero-copy receiver asking before each push: each ask stands on the doorbell and the push that
    publishes the next version answers it, on the pushing thread. Then an ask made once a newer version is out
    goes on the link and is answered at once, with no push after it; and one made while the reply to the last ask
    has not been ended yet (its word came after the next push) is answered too: the listener ends that reply."""
    td = _model()
    pushes = 40
    if rank == 0:
        sender = cudarecv.WeightSender(td, dst=1, mode="latest", timeout=60)
        _fill(td, 1)
        sender.push()  # (the first reply goes on the link and says the doorbell rings)
        store().wait([f"{key}_got_1"])
        store().wait([f"{key}_asked_1"])
        before = _switches("cudarecv-")
        for version in range(2, pushes + 2):
            _fill(td, version)
            sender.push()
            store().wait([f"{key}_asked_{version}"])  # it took the version and asked again
        woken = _switches("cudarecv-") - before
        # the receiver's standing ask is answered by this push; it then waits for the sender before it asks again
        _fill(td, pushes + 2)
        sender.push()
        store().set(f"{key}_pushed_{pushes + 2}", "1")
        store().wait([f"{key}_got_{pushes + 2}"])
        # the reply to its standing ask is rung, then the next version is pushed before its word comes
        _fill(td, pushes + 3)
        sender.push()
        _fill(td, pushes + 4)
        sender.push()
        store().set(f"{key}_pushed_{pushes + 4}", "1")
        store().wait([f"{key}_got_{pushes + 4}"])
        dropped = sender.dropped
        store().set(f"{key}_checked", "1")  # (the receiver closes after this)
        sender.close()
        return dict(woken=woken, dropped=dropped)
    receiver = cudarecv.WeightReceiver(src=0, timeout=60, zero_copy=True)
    held = []
    receiver.pull(timeout=60)
    held.append(_holds(receiver.td, 1))
    store().set(f"{key}_got_1", "1")
    for version in range(2, pushes + 2):
        pending = receiver.pull(wait=False)  # (its ask is made before this returns)
        store().set(f"{key}_asked_{version - 1}", "1")
        assert pending.wait(60) == version
        held.append(_holds(receiver.td, version))
    pending = receiver.pull(wait=False)  # stands: answered by the push of pushes + 2
    store().set(f"{key}_asked_{pushes + 1}", "1")
    assert pending.wait(60) == pushes + 2
    held.append(_holds(receiver.td, pushes + 2))
    store().wait([f"{key}_pushed_{pushes + 2}"])
    # its word on the next version waits until the sender has pushed the one after it
    answer = doorbell.Mailbox.answer

    def late_answer(self: Any, raw: bytes) -> None:
        store().wait([f"{key}_pushed_{pushes + 4}"])
        answer(self, raw)

    doorbell.Mailbox.answer = late_answer  # type: ignore[method-assign]
    try:
        pending = receiver.pull(
            wait=False
        )  # (none newer is out: the ask stands, answered by the next push)
        store().set(f"{key}_got_{pushes + 2}", "1")
        held.append(pending.wait(60) == pushes + 3 and _holds(receiver.td, pushes + 3))
    finally:
        doorbell.Mailbox.answer = answer  # type: ignore[method-assign]
    # a newer version is out: asked on the link, the listener ends the reply above first (its word came), then
    # answers; nothing is pushed after (a reply left to its deadline, 60 s, would time this pull out)
    held.append(receiver.pull(timeout=20) == pushes + 4 and _holds(receiver.td, pushes + 4))
    store().set(f"{key}_got_{pushes + 4}", "1")
    store().wait([f"{key}_checked"])
    receiver.close()
    return held


def test_a_latest_mode_ask_by_the_doorbell_is_answered_by_the_push_and_wakes_no_sender_thread(
    cluster,
):
    """Latest mode with a doorbell: a receiver's ask stands on the page and the push that publishes a newer version
    answers it on the pushing thread; no thread of the sender wakes for it (its listener woke for every ask on the
    link, its driver for every reply and word). An ask made once a newer version is out goes on the link and is
    answered at once; one made while the reply to the last is still in flight is answered after it ends."""
    sender, held = cluster().run(latest_rung, args=(unique_key("latest_rung"),), timeout=240)
    assert all(held), f"a version was torn, stale or late: {held}"
    assert sender["woken"] < 20, f"the sender's threads woke {sender['woken']} times in 40 pushes"
    assert sender["dropped"] == {}, sender["dropped"]


def latest_late_words(rank, world, group, key):
    """Two races of a rung reply whose word comes late (each ordered by store keys, through a patched step):

    1. the receiver's word on version 2 comes after push 3 has looked for words, and its next ask is on the page
       before push 3 publishes: push 3 takes the ask while the reply to the last is still in flight; the ask is
       answered once that reply ends, which push 3 ends itself (nothing else would before its deadline);
    2. with two snapshot buffers, push 6 finds none free (5 is the latest, and the reply of 4, its word late, reads
       the other): the words of replies in flight are taken as they come (on the receivers' drivers), so the push
       waits for that word, not for its timeout."""
    from cudarecv.weights import pushes, snapshots

    td = _model()
    if rank == 0:
        sender = cudarecv.WeightSender(td, dst=1, mode="latest", timeout=60, buffers=2)
        _fill(td, 1)
        sender.push()
        store().wait([f"{key}_asked_1"])
        _fill(td, 2)
        sender.push()  # (the reply rung to its standing ask; its word comes late)
        before_push = pushes.LatestPushes.before_push

        def then_wait(self: Any) -> None:
            before_push(self)
            store().set(f"{key}_looked_3", "1")
            store().wait([f"{key}_asked_2"])

        pushes.LatestPushes.before_push = then_wait  # type: ignore[method-assign]
        try:
            _fill(td, 3)
            sender.push()
        finally:
            pushes.LatestPushes.before_push = before_push  # type: ignore[method-assign]
        store().wait([f"{key}_asked_3"])
        _fill(td, 4)
        sender.push()  # (its reply's word comes once push 6 waits for a snapshot)
        _fill(td, 5)
        sender.push()
        latest_target = snapshots.SnapshotPool.latest_target

        def said(self: Any, timeout: float) -> Any:
            store().set(f"{key}_waiting_6", "1")
            return latest_target(self, timeout)

        snapshots.SnapshotPool.latest_target = said  # type: ignore[method-assign]
        try:
            _fill(td, 6)
            sender.push(timeout=20)  # (left to its reply's deadline, the word is taken in 60 s)
            sixth = "ok"
        except Exception as error:  # noqa: BLE001 - returned to the test
            sixth = repr(error)
        finally:
            snapshots.SnapshotPool.latest_target = latest_target  # type: ignore[method-assign]
        store().set(f"{key}_pushed_6", "1")
        store().wait([f"{key}_got_6"])
        dropped = sender.dropped
        store().set(f"{key}_checked", "1")
        sender.close()
        return dict(sixth=sixth, dropped=dropped)
    receiver = cudarecv.WeightReceiver(src=0, timeout=60)
    held = []
    receiver.pull(timeout=60)
    answer = doorbell.Mailbox.answer

    def late_answer(after: str) -> Any:
        def late(self: Any, raw: bytes) -> None:
            store().wait([after])
            answer(self, raw)

        return late

    doorbell.Mailbox.answer = late_answer(f"{key}_looked_3")  # type: ignore[method-assign]
    try:
        pending = receiver.pull(wait=False)  # (stands on the page: answered by push 2)
        store().set(f"{key}_asked_1", "1")
        held.append(pending.wait(60) == 2 and _holds(receiver.td, 2))
    finally:
        doorbell.Mailbox.answer = answer  # type: ignore[method-assign]
    pending = receiver.pull(
        wait=False
    )  # (stands on the page, taken by push 3 while the reply to 2 is in flight)
    store().set(f"{key}_asked_2", "1")
    held.append(pending.wait(20) == 3 and _holds(receiver.td, 3))
    doorbell.Mailbox.answer = late_answer(f"{key}_waiting_6")  # type: ignore[method-assign]
    try:
        pending = receiver.pull(wait=False)
        store().set(f"{key}_asked_3", "1")
        held.append(pending.wait(60) == 4 and _holds(receiver.td, 4))
    finally:
        doorbell.Mailbox.answer = answer  # type: ignore[method-assign]
    store().wait(
        [f"{key}_pushed_6"]
    )  # (no ask meanwhile: its listener would take the word on the way)
    held.append(receiver.pull(timeout=60) == 6 and _holds(receiver.td, 6))
    store().set(f"{key}_got_6", "1")
    store().wait([f"{key}_checked"])
    receiver.close()
    return held


def test_a_latest_mode_reply_whose_word_comes_late_delays_neither_the_next_ask_nor_a_push(cluster):
    """A reply rung by a push whose receiver's word comes after the next push looked for words: the receiver's next
    ask, taken by that push, is answered at once (not when the reply's deadline ends it), and a push that finds no
    snapshot free waits for that word, not for its own timeout."""
    sender, held = cluster().run(latest_late_words, args=(unique_key("late_words"),), timeout=240)
    assert all(held), f"a version was torn, stale or late: {held}"
    assert sender["sixth"] == "ok", sender["sixth"]
    assert sender["dropped"] == {}, sender["dropped"]
