"""Weight sync for asynchronous RL: latest-wins mode, shutdown both ways, failures that reach
the other side.

Every case runs on real spawned ranks over gloo. No assertion is on speed: a trainer that
waited for a stopped actor would never finish its pushes, and the test would fail on its
bounded wait instead.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from policies import holds_version, policy, set_version
from procs import wait_gone
from rawwire import store, unique_key

PUSHES = 40


def latest_with_a_stopped_actor(rank, world, group, key):
    """Rank 2 takes one version and then stops until the trainer is done; rank 1 pulls on."""
    model = policy()
    signals = store()
    if rank == 0:
        with cudarecv.WeightSender(
            TensorDict.from_module(model), dst=[1, 2], mode="latest", bucket_bytes=512, timeout=30
        ) as sender:
            set_version(model, 1)
            sender.push()
            signals.wait(
                [f"{key}_stopped", f"{key}_first"]
            )  # both hold version 1; rank 2 pulls no more
            for version in range(2, PUSHES + 1):
                set_version(model, version)
                assert sender.push() == version  # never waits for rank 2: else this never ends
                time.sleep(0.002)  # a training step
            ranks = sender.ranks  # both still served
            signals.set(f"{key}_trained", "1")
            signals.wait([f"{key}_fast_done", f"{key}_slow_done"])
            return ranks, len(sender._pool.snapshots)
    with cudarecv.WeightReceiver(src=0, expect=model, timeout=30) as receiver:
        assert receiver.mode == "latest"
        seen = [(receiver.pull(), holds_version(receiver.td, receiver.version))]
        if rank == 2:
            signals.set(f"{key}_stopped", "1")
            signals.wait([f"{key}_trained"])  # stopped for the whole of the training
            seen.append((receiver.pull(), holds_version(receiver.td, receiver.version)))
            signals.set(f"{key}_slow_done", "1")
            return seen
        signals.set(f"{key}_first", "1")
        while receiver.version < PUSHES:
            version = receiver.pull()
            seen.append((version, holds_version(receiver.td, version)))
        signals.set(f"{key}_fast_done", "1")
        signals.wait([f"{key}_trained"])  # not closed before the trainer looked at who it serves
        return seen


@pytest.fixture(scope="module")
def three():
    from cudarecv.testing.launch import Ranks

    ranks = Ranks(3, pg_timeout=30.0)
    yield ranks
    ranks.close()


def test_latest_mode_a_stopped_actor_never_holds_up_the_trainer_and_gets_the_newest(three):
    (ranks, buffers), fast, slow = three().run(
        latest_with_a_stopped_actor, args=(unique_key("lifecycle_latest"),), timeout=120
    )
    assert ranks == [1, 2] and buffers == 4  # receivers + 2: fixed, never one per push
    assert slow == [(1, True), (PUSHES, True)], (
        f"the stopped actor got {slow}: not the newest, or a mix"
    )
    versions = [v for v, _ in fast]
    assert all(ok for _, ok in fast), "the fast actor saw a mix of two versions"
    assert versions == sorted(set(versions)) and versions[0] == 1 and versions[-1] == PUSHES, (
        versions
    )


def latest_pull_waits_for_newer(rank, world, group, key):
    model = policy()
    signals = store()
    if rank == 0:
        with cudarecv.WeightSender(
            TensorDict.from_module(model), dst=1, mode="latest", timeout=30
        ) as sender:
            set_version(model, 1)
            sender.push()
            signals.wait([f"{key}_waited"])
            set_version(model, 2)
            sender.push()
            set_version(model, 3)
            sender.push()
            signals.wait([f"{key}_done"])
        return None
    with cudarecv.WeightReceiver(src=0, timeout=30) as receiver:
        out = [receiver.pull()]
        for call in ("wait", "future"):  # it holds the newest: each waits, and the pull goes on
            started = time.monotonic()
            try:
                if call == "wait":
                    receiver.pull(timeout=0.3)
                else:
                    receiver.pull(wait=False).wait(0.3)
                out.append("returned")
            except cudarecv.WaitTimeout as error:
                out.append((str(error), time.monotonic() - started))
        signals.set(f"{key}_waited", "1")
        got = (
            receiver.pull()
        )  # carries on with the pull under way: version 2 or 3, whichever was newest
        out.append((got, holds_version(receiver.td, got)))
        if got < 3:
            out.append((receiver.pull(), holds_version(receiver.td, 3)))
        signals.set(f"{key}_done", "1")
        return out


def test_latest_pull_waits_only_until_a_newer_version_exists(cluster):
    out = cluster().run(
        latest_pull_waits_for_newer, args=(unique_key("lifecycle_newer"),), timeout=90
    )[1]
    assert out[0] == 1
    for message, took in out[1:3]:
        assert took >= 0.3 and "rank 0" in message and "newer than 1" in message, message
        assert "pull goes on" in message or "goes on" in message
    assert out[-1][1] and out[-1][0] == 3, out


def sender_closes(rank, world, group, key, mode):
    """The sender pushes 2 versions and closes; rank 1 has a pull under way, rank 2 is between pulls."""
    model = policy()
    signals = store()
    if rank == 0:
        sender = cudarecv.WeightSender(
            TensorDict.from_module(model), dst=[1, 2], mode=mode, timeout=60
        )
        for version in (1, 2):
            set_version(model, version)
            sender.push()
        signals.wait([f"{key}_ready_1", f"{key}_ready_2"])
        started = time.monotonic()
        sender.close()
        took = time.monotonic() - started
        signals.set(f"{key}_closed", "1")
        return took
    receiver = cudarecv.WeightReceiver(src=0, expect=model, timeout=60)
    while receiver.version < 2:
        receiver.pull()
    pending = receiver.pull(wait=False) if rank == 1 else None
    signals.set(f"{key}_ready_{rank}", "1")
    started = time.monotonic()
    try:
        if pending is not None:
            pending.wait(60)
        else:
            signals.wait([f"{key}_closed"])
            time.sleep(0.5)  # the sender's process may be gone by now: the close was heard anyway
            receiver.pull()
        outcome = "no error"
    except cudarecv.SenderClosed as error:
        outcome = str(error)
    took = time.monotonic() - started
    try:
        receiver.pull()
        again = "no error"
    except cudarecv.SenderClosed as error:
        again = type(error).__name__
    receiver.close()
    return outcome, took, again, receiver.version, holds_version(receiver.td, 2)


@pytest.mark.parametrize("mode", ["sync", "latest"])
def test_sender_close_reaches_every_receiver_at_once(three, mode):
    close_took, pending, later = three().run(
        sender_closes, args=(unique_key(f"lifecycle_close_{mode}"), mode), timeout=120
    )
    assert close_took < 30, (
        f"close took {close_took:.1f} s of its 60 s"
    )  # the receivers answered, no timeout
    for outcome, took, again, version, intact in (pending, later):
        assert "closed" in outcome and "rank 0" in outcome and "version 2" in outcome, outcome
        assert took < 30, f"told after {took:.1f} s: that is the 60 s timeout, not the close"
        assert again == "SenderClosed"
        assert version == 2 and intact, "the last version is no longer readable"


def receiver_leaves(rank, world, group, key, mode):
    """Rank 2 takes a version or two and closes; the sender pushes on to rank 1, who gets what it asks for."""
    model = policy()
    signals = store()
    steps = 8
    if rank == 0:
        with cudarecv.WeightSender(
            TensorDict.from_module(model), dst=[1, 2], mode=mode, timeout=60
        ) as sender:
            errors = []
            for version in range(1, steps + 1):
                set_version(model, version)
                try:
                    sender.push()
                except cudarecv.Error as error:
                    errors.append(f"{type(error).__name__}: {error}")
                if version == 3:
                    signals.wait(
                        [f"{key}_left"]
                    )  # rank 2 closed: the next pushes go to rank 1 only
            deadline = time.monotonic() + 30
            while 2 in sender.ranks and time.monotonic() < deadline:
                time.sleep(0.01)
            ranks, dropped = sender.ranks, sender.dropped
            signals.set(f"{key}_read", "1")  # rank 1 may close now: it is no longer counted
            signals.wait([f"{key}_fast_done"])
        return errors, ranks, dropped
    with cudarecv.WeightReceiver(src=0, expect=model, timeout=60) as receiver:
        if rank == 2:
            for _ in range(
                2 if mode == "sync" else 1
            ):  # latest: a second pull would wait for version 4
                receiver.pull()
            receiver.close()  # the sender may have version 3 in flight to it: taken, then told
            signals.set(f"{key}_left", "1")
            try:
                receiver.pull()
                after = "no error"
            except cudarecv.UsageError as error:
                after = str(error)
            return after, receiver.version, holds_version(receiver.td, receiver.version)
        seen = []
        while receiver.version < steps:
            version = receiver.pull()
            seen.append((version, holds_version(receiver.td, version)))
        signals.set(f"{key}_fast_done", "1")
        signals.wait([f"{key}_read"])  # stay served until the sender has looked
        return seen


@pytest.mark.parametrize("mode", ["sync", "latest"])
def test_receiver_close_reaches_the_sender_which_goes_on_with_the_others(three, mode):
    (errors, ranks, dropped), seen, (after, version, intact) = three().run(
        receiver_leaves, args=(unique_key(f"lifecycle_leave_{mode}"), mode), timeout=120
    )
    assert errors == [], errors  # a push in flight to the closing receiver ended cleanly
    assert ranks == [1] and dropped == {2: "closed by its receiver"}, (ranks, dropped)
    assert all(ok for _, ok in seen)
    versions = [v for v, _ in seen]
    if mode == "sync":
        assert versions == list(range(1, 9)), versions
    else:
        assert versions == sorted(set(versions)) and versions[-1] == 8, versions
    assert (
        "closed" in after
        and version == (2 if mode == "sync" else version)
        and 1 <= version <= 3
        and intact
    )


def receiver_cannot_start(rank, world, group, why):
    model = policy()
    if rank == 0:
        started = time.monotonic()
        try:
            cudarecv.WeightSender(TensorDict.from_module(model), dst=1, timeout=60)
            return "no error"
        except cudarecv.Error as error:
            return type(error).__name__, str(error), time.monotonic() - started
    kwargs = {
        "cuda": {"device": "cuda:0"},
        "timeout": {"timeout": -1},
        "device": {"device": "no-such"},
        "pin_memory": {"device": "meta", "pin_memory": True},
    }[why]
    try:
        cudarecv.WeightReceiver(src=0, **kwargs)
        return "no error"
    except cudarecv.Error as error:
        return type(error).__name__, str(error)


@pytest.mark.parametrize("why", ["cuda", "timeout", "device", "pin_memory"])
def test_a_receiver_that_cannot_start_tells_the_sender_at_once(cluster, why):
    if why == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: device='cuda:0' works here")
    (kind, message, took), (receiver_kind, receiver_message) = cluster().run(
        receiver_cannot_start, args=(why,), timeout=90
    )
    assert kind == "ReceiverFailed" and "rank 1" in message, (kind, message)
    assert receiver_message in message or receiver_message[:60] in message, (
        message,
        receiver_message,
    )
    assert receiver_kind in ("UsageError", "ArgumentError")
    assert took < 30, f"the sender learnt it after {took:.1f} s: its 60 s timeout, not the answer"


def test_latest_mode_arguments():
    with pytest.raises(ValueError, match="`mode` must be one of"):
        cudarecv.WeightSender(TensorDict(a=torch.zeros(1)), dst=1, mode="newest")
    with pytest.raises(ValueError, match="`buffers` is for mode='latest'"):
        cudarecv.WeightSender(TensorDict(a=torch.zeros(1)), dst=1, buffers=3)
    with pytest.raises(ValueError, match="`buffers` is for mode='latest', an int >= 2"):
        cudarecv.WeightSender(TensorDict(a=torch.zeros(1)), dst=1, mode="latest", buffers=1)


def _cudarecv_threads() -> set[str]:
    """cudarecv's threads alive now, but the process-wide one that keeps transfers' deadlines."""
    return {
        t.name
        for t in threading.enumerate()
        if t.name.startswith("cudarecv-") and t.name != "cudarecv-deadlines"
    }


def close_and_collect(rank, world, group, key, mode, fanout):
    """Three versions (the last left in flight, sync), then rank 2 closes, the sender closes (once rank 1 holds
    version 3 too: in latest mode nothing else waits for it) and rank 1 closes after it; each rank then destroys
    the group and keeps its closed sender or receiver."""
    signals = store()
    before = _cudarecv_threads()
    group = dist.new_group(list(range(world)))
    model = policy()
    td = TensorDict.from_module(model) if rank == 0 else TensorDict.from_module(policy()).clone()
    if rank == 0:
        end = cudarecv.WeightSender(
            td, group=group, group_dst=[1, 2], mode=mode, fanout=fanout, timeout=10
        )
        for version in (1, 2):
            set_version(model, version)
            end.push()
        set_version(model, 3)
        end.push(wait=False)
        signals.wait([f"{key}_left", f"{key}_held"])
        end.close()
        signals.set(f"{key}_closed", "1")
        outcome = end.version
    else:
        end = cudarecv.WeightReceiver(group=group, group_src=0, expect=td, timeout=10)
        while end.version < 3:
            end.pull()
        if rank == 2:
            end.close()
            signals.set(f"{key}_left", "1")
        else:
            signals.set(f"{key}_held", "1")
            signals.wait([f"{key}_closed"])
            end.close()
        outcome = holds_version(end.td, 3)  # readable after close
    threads = _cudarecv_threads() - before
    refs = [weakref.ref(td), weakref.ref(group)]
    dist.destroy_process_group(group)
    del td, group, model
    gc.collect()
    alive = [name for name, ref in zip(("td", "group"), refs) if ref() is not None]
    del end
    return outcome, sorted(threads), alive


@pytest.mark.parametrize("mode, fanout", [("sync", "star"), ("latest", "star"), ("sync", "relay")])
def test_close_stops_every_thread_and_lets_go_of_the_weights_and_the_group(three, mode, fanout):
    results = three().run(
        close_and_collect,
        args=(unique_key(f"lifecycle_collect_{mode}_{fanout}"), mode, fanout),
        timeout=120,
    )
    assert [outcome for outcome, _, _ in results] == [3, True, True], results
    for rank, (_, threads, alive) in enumerate(results):
        assert threads == [], f"rank {rank}: threads still running after close(): {threads}"
        assert alive == [], (
            f"rank {rank}: still held after close(), destroy_process_group() and gc: {alive}"
        )


def receiver_outlives_its_sender(rank, world, group, key, transport):
    """Rank 0 pushes one version and is killed; rank 1 got it, then closes once rank 0 is gone (no pull failed):
    what close() did, how long it took, the version intact, and the threads of cudarecv's it left (besides those
    of earlier tests' links on the session's ranks, which live with their groups)."""
    before = _cudarecv_threads()
    model = policy()
    signals = store()
    if rank == 0:
        signals.set(f"{key}_sender_pid", str(os.getpid()))
        sender = cudarecv.WeightSender(
            TensorDict.from_module(model), dst=1, timeout=20, transport=transport
        )
        set_version(model, 1)
        sender.push()
        signals.wait([f"{key}_pulled"])
        os.kill(os.getpid(), signal.SIGKILL)
    receiver = cudarecv.WeightReceiver(src=0, expect=model, timeout=20, transport=transport)
    receiver.pull()
    signals.set(f"{key}_pulled", "1")
    wait_gone(int(signals.get(f"{key}_sender_pid")))
    start = time.monotonic()
    try:
        receiver.close()
        outcome = "closed"
    except Exception as error:  # noqa: BLE001 - what the test is about
        outcome = f"{type(error).__name__}: {error}"
    return (
        outcome,
        time.monotonic() - start,
        holds_version(receiver.td, 1),
        sorted(_cudarecv_threads() - before),
    )


@pytest.mark.parametrize("transport", ["auto", "wire"])
def test_a_receiver_closes_quietly_after_its_sender_died(cluster, transport):
    """(Found with vLLM: a worker's engine shut down after its trainer was killed between two pushes raised gloo's
    raw "Connection closed by peer" from close(), telling the sender it leaves.) close() says it in the log and
    goes on: no error, its version readable, no thread left."""
    try:
        code, (outcome, took, intact, threads) = cluster().run(
            receiver_outlives_its_sender,
            args=(unique_key(f"outlived-{transport}"), transport),
            may_die={0},
            timeout=120,
        )
    finally:
        cluster().close()  # rank 0 is gone: the next test needs new ranks
    assert code == -signal.SIGKILL
    assert outcome == "closed", outcome
    assert took < 20.0 + 10.0, took  # within its timeout, not beyond
    assert intact and threads == [], (intact, threads)
