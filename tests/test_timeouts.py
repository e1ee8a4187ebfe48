"""Nothing waits unbounded: ``timeout=`` on every call, the process group's timeout by default,
and errors that name the peer, what was waited for and the likely cause.

Each case pairs two real ranks over gloo that disagree (a stock sender facing a
fast-wire receiver, another ``init_tag``, a receiver that never receives), then
shows the link still serves other tensordicts while the one that timed out is
refused on it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.p2p.stock import Stock
from rawwire import store, unique_key
from tdfactory import make, same


def _attempt(call, *args, **kwargs):
    started = time.monotonic()
    try:
        call(*args, **kwargs)
        return "returned", time.monotonic() - started
    except cudarecv.Error as error:
        return (type(error).__name__, str(error), error.link_usable), time.monotonic() - started


def mismatched_peers(rank, world, group, case):
    """Rank 0 sends on the stock wire; rank 1 waits for something else, with timeout=1.5."""
    signals = store()
    td = make("nested", 3.0 if rank == 0 else 0.0)
    if rank == 0:
        works = Stock.isend(td, 1, return_early=True)  # stock: one message per leaf, tags 0..4
        signals.wait([f"{case}_done"])
        for work in works:
            work.wait()
        return None
    if case == "fast_wire_receiver":
        outcome = _attempt(cudarecv.recv, td, 0, bucket_bytes=1 << 20, timeout=1.5)
    else:  # another init_tag
        outcome = _attempt(cudarecv.recv, td, 0, init_tag=5, timeout=1.5)
    again = _attempt(
        cudarecv.recv, td, 0, timeout=1.5
    )  # the same tensordict on that link: refused at once
    other = make("nested", 0.0)
    cudarecv.recv(
        other, 0, timeout=20
    )  # the link itself still works: this takes the stock messages
    signals.set(f"{case}_done", "1")
    return outcome, again, same(other, make("nested", 3.0))


@pytest.mark.parametrize("case", ["fast_wire_receiver", "other_init_tag"])
def test_a_mismatched_peer_times_out_naming_it_and_the_cause(cluster, case):
    try:
        _, ((outcome, took), (again, _), other_ok) = cluster().run(mismatched_peers, args=(case,))
    finally:
        cluster().close()  # the abandoned receive stays posted on this link
    kind, message, usable = outcome
    assert kind == "TransferTimeout" and not usable, outcome
    assert "rank 0" in message and "1.5 s" in message and took >= 1.5, outcome
    if case == "fast_wire_receiver":
        assert "fast-wire header" in message and "bucket_bytes on both ends" in message
    else:
        assert "tags 5..9" in message and "init_tag=5" in message
    assert again[0] == "LinkError" and "rank 0" in again[1] and "new process groups" in again[1], (
        again
    )
    assert other_ok, "another tensordict on the same link did not get the stock sender's values"


def unanswered_send(rank, world, group):
    signals = store()
    td = make("flat", 4.0 if rank == 0 else 0.0)
    if rank == 0:
        outcome = _attempt(cudarecv.send, td, 1, bucket_bytes=64, timeout=1.0)
        signals.set("unanswered_send", "1")
        return outcome
    signals.wait(["unanswered_send"])
    late = make("flat", 0.0)
    cudarecv.recv(
        late, 0, bucket_bytes=64, timeout=20
    )  # the send still in flight lands here, whole
    return same(late, make("flat", 4.0))


def test_a_send_nobody_receives_times_out(cluster):
    try:
        (outcome, took), late_ok = cluster().run(unanswered_send)
    finally:
        cluster().close()
    kind, message, _ = outcome
    assert (
        kind == "TransferTimeout"
        and "send of the fast-wire header" in message
        and "rank 1" in message
    )
    assert took >= 1.0
    assert late_ok


def unwaited_receive(rank, world, group, key):
    """A fast-wire receive with timeout=1 that nobody waits for fails on time, and the peer's later
    fast-wire sends (another tensordict and init_tag, one with transport="wire") are received."""
    signals = store()
    if rank == 0:
        signals.wait([key])  # the unwaited receive has ended
        cudarecv.send(make("nested", 2.0), 1, bucket_bytes=1 << 20, init_tag=3, timeout=5)
        cudarecv.send(
            make("flat", 5.0), 1, bucket_bytes=1 << 20, init_tag=4, timeout=5, transport="wire"
        )
        return None
    [transfer] = cudarecv.irecv(
        make("flat", 0.0), 0, bucket_bytes=1 << 20, timeout=1.0, return_premature=True
    )
    ended = threading.Event()
    transfer.add_done_callback(lambda _: ended.set())
    fired = ended.wait(10)  # never transfer.wait(): its own deadline must end it
    signals.set(key, "1")
    first = _attempt(transfer.wait)
    later, wire = make("nested", 0.0), make("flat", 0.0)
    cudarecv.recv(later, 0, bucket_bytes=1 << 20, init_tag=3, timeout=5)
    cudarecv.recv(wire, 0, bucket_bytes=1 << 20, init_tag=4, timeout=5, transport="wire")
    return fired, first, same(later, make("nested", 2.0)), same(wire, make("flat", 5.0))


def test_an_unwaited_receive_times_out_and_the_link_goes_on(cluster):
    try:
        _, (fired, ((kind, message, _), _), later_ok, wire_ok) = cluster().run(
            unwaited_receive, args=(unique_key("unwaited"),)
        )
    finally:
        cluster().close()  # the receive that timed out stays posted on this link
    assert fired, "a receive nobody waited for did not end at its own timeout"
    assert kind == "TransferTimeout" and "fast-wire header" in message and "1 s" in message, message
    assert later_ok and wire_ok


def group_timeout(rank, world, group):
    """No timeout=: the process group's own (2 s here) bounds the wait, and the error says so. (Its 2 s also bound
    its forming, which gloo times from each rank's call: both ranks call once both are there.)"""
    signals = store()
    signals.set(f"short-timeout-ready/{rank}", "1")
    signals.wait([f"short-timeout-ready/{r}" for r in range(world)])
    short = dist.ProcessGroupGloo(
        dist.PrefixStore("short-timeout", signals), rank, world, timedelta(seconds=2)
    )
    td = TensorDict(a=torch.zeros(3))
    if rank == 0:  # silent until the receiver gave up
        signals.wait(["short-timeout-done"])
        return None
    try:
        return _attempt(cudarecv.recv, td, group=short, group_src=0)
    finally:
        signals.set("short-timeout-done", "1")


def test_without_timeout_the_group_timeout_bounds_the_wait(cluster):
    _, (outcome, took) = cluster().run(group_timeout)
    kind, message, _ = outcome
    assert kind == "TransferTimeout" and "2 s" in message and "closed every link" in message, (
        outcome
    )
    assert 2.0 <= took < 20  # bounded by the group's 2 s, not the default 30 min


def short_caller_wait(rank, world, group):
    signals = store()
    td = make("flat", 6.0 if rank == 0 else 0.0)
    if rank == 0:
        signals.wait(["short_caller_wait"])
        cudarecv.send(td, 1)
        return None
    [transfer] = cudarecv.irecv(td, 0, return_premature=True)
    waited = _attempt(transfer.wait, 0.3)
    signals.set("short_caller_wait", "1")
    transfer.wait()
    return waited, same(td, make("flat", 6.0))


def test_a_short_wait_raises_wait_timeout_and_the_transfer_goes_on(cluster):
    _, ((outcome, took), ok) = cluster().run(short_caller_wait)
    kind, message, usable = outcome
    assert kind == "WaitTimeout" and usable and "0.3 s" in message and "goes on" in message, outcome
    assert "from rank 0" in message and "receive of" in message, (
        outcome
    )  # the peer, and what it waited for
    assert took >= 0.3 and ok


def test_bad_timeouts_are_refused():
    td = make("flat", 0.0)
    for bad in (0, -1, "1", True):
        with pytest.raises(cudarecv.ArgumentError, match="`timeout` must be a positive number"):
            cudarecv.recv(td, 0, timeout=bad)


def _deadlines_thread() -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == "cudarecv-deadlines"), None)


def deadlines_thread_comes_and_goes(rank, world, group, key):
    """Timed transfers (fast wire and stock wire, each way) on a new group, all ended and let go of: the
    ``cudarecv-deadlines`` thread ends by itself (once it lingered: 1 s here, 5 s by default). Then rank 1 posts a
    timed receive nobody answers: the thread starts again, fails it at its time, and ends again."""
    import gc

    from cudarecv.core.deadlines import DEADLINES

    DEADLINES.linger = 1.0  # (the ranks' processes are this test's own: a new Cluster)
    signals = store()
    pg = dist.ProcessGroupGloo(dist.PrefixStore(key, signals), rank, world, timedelta(seconds=30))
    peer = {"group": pg, ("group_dst" if rank == 0 else "group_src"): 1 - rank}
    td = make("nested", 4.0 if rank == 0 else 0.0)
    for kw in (dict(bucket_bytes=1 << 10), {}, dict(bucket_bytes=1 << 10, transport="wire")):
        if rank == 0:
            [t] = cudarecv.isend(td, **peer, **kw, timeout=60, return_early=True)
        else:
            [t] = cudarecv.irecv(td, **peer, **kw, timeout=60, return_premature=True)
        t.wait(timeout=60)
    del t
    gc.collect()
    thread = _deadlines_thread()
    ended = thread is None or (thread.join(30) or not thread.is_alive())
    late = None
    if rank == 1:
        [t] = cudarecv.irecv(
            make("flat", 0.0),
            **peer,
            bucket_bytes=1 << 10,
            init_tag=9,
            timeout=1.0,
            return_premature=True,
        )
        restarted = _deadlines_thread()
        fired = t.ended(
            drive=False
        )  # waited on without driving, never with t.wait(): its deadline must end it
        started = time.monotonic()
        fired.wait()
        late = (
            restarted is not None and restarted is not thread,
            t.failed,
            time.monotonic() - started,
            type(t._error).__name__,
        )
        del t, fired
        gc.collect()
        again = _deadlines_thread()
        late += (again is None or (again.join(30) or not again.is_alive()),)
    signals.set(f"{key}_done_{rank}", "1")
    signals.wait(
        [f"{key}_done_{1 - rank}"], timedelta(seconds=60)
    )  # neither drops the group while the other uses it
    return ended, same(td, make("nested", 4.0)), late


def test_the_deadlines_thread_ends_when_it_watches_nothing_and_starts_again():
    from cudarecv.testing.launch import Cluster

    with Cluster(
        2, pg_timeout=30.0
    ) as ranks:  # (new ranks: no timed transfer of an earlier test is in flight)
        results = ranks.run(
            deadlines_thread_comes_and_goes, args=(unique_key("deadlines"),), timeout=120
        )
    for rank, (ended, ok, _) in enumerate(results):
        assert ok, rank
        assert ended, (
            f"rank {rank}: cudarecv-deadlines still runs with nothing to watch"
        )  # before: it never ended
    restarted, failed, took, kind, ended_again = results[1][2]
    assert restarted and failed and kind == "TransferTimeout" and took < 30, results[1][2]
    assert ended_again, "cudarecv-deadlines still runs after the timed-out receive ended"


class _Timed:
    """A stand-in for a transfer as :class:`~cudarecv.core.deadlines.Deadlines` sees it (its deadline, whether it
    ended, its expiry), which tells its owner when it was failed at its time."""

    what = "a stand-in transfer"

    def __init__(self, deadlines, seconds: float) -> None:
        self._deadlines, self._end = deadlines, time.monotonic() + seconds
        self.settled, self.expired = False, threading.Event()

    def deadline(self) -> float:
        return self._end

    def expire(self) -> None:
        if not self.settled and time.monotonic() >= self._end:
            self.end()
            self.expired.set()

    def end(self) -> None:
        self.settled = True
        self._deadlines.ended(self)


def test_a_deadline_kept_while_the_thread_decides_to_end_is_kept():
    """With no linger, the thread ends each time its one transfer ends; a deadline kept at that moment (from another
    thread, racing its decision) is still kept: each is failed at its time, and once none is left the thread is
    gone."""
    from cudarecv.core.deadlines import Deadlines

    deadlines = Deadlines(linger=0.0)
    for _ in range(200):
        first, second = _Timed(deadlines, 3600.0), _Timed(deadlines, 0.0)
        deadlines.keep(first)
        racer = threading.Thread(target=deadlines.keep, args=(second,))
        racer.start()
        first.end()  # (the thread may be deciding to end now, while the racer keeps the second)
        racer.join(10)
        assert second.expired.wait(10), "a deadline kept while the thread was ending was never kept"
    thread = deadlines.thread
    if thread is not None:
        thread.join(10)
    assert deadlines.thread is None and (thread is None or not thread.is_alive())
    assert not any(
        t.name == "cudarecv-deadlines" and t is thread and t.is_alive()
        for t in threading.enumerate()
    )
