"""Concurrent fast-wire receives on one link, from several threads: each takes one whole message, in posting order.

The sender sends versions 1..N of a tensordict on one ``init_tag``, all in flight at once. The receiver receives them
from several threads at once (blocking or not, with or without a timeout, waited in any order). Every receive must
get one whole version (no offer taken for a header, no payload of another version), and receives whose posting order
is known (each thread posts once the one before it has) get the versions in that order. Both through shared memory
(the link's receiving side takes them on its thread) and on the plain fast wire (processes where segments cannot be
made: the receives take their turns per tag on the callers' threads).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.samehost import policy, sides
from rawwire import set_flag, store, unique_key, wait_flag

LONG = 60.0  # seconds: the own timeout of a transfer that must succeed (a bound, never reached)
THREADS = 4
MODES = ("recv", "recv_timeout", "irecv", "irecv_timeout", "irecv_wait_timeout")


def _group(rank: int, world: int, key: str) -> object:
    """A new gloo group of the two ranks (a fresh link: a fresh same-host side)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(key, store()), rank, world, timedelta(seconds=30))


def _whole(td: TensorDict) -> float | None:
    """The version ``td`` holds, or None if it holds parts of several (or nothing received)."""
    x = td["x"]
    return float(x[0]) if bool((x == x[0]).all()) and float(x[0]) > 0 else None


def _receive(
    mode: str,
    td: TensorDict,
    kw: dict,
    posted: threading.Event | None = None,
    turn: threading.Event | None = None,
) -> None:
    """One receive in ``mode``; the non-blocking ones set ``posted`` once posted and wait for ``turn`` (the order
    the test waits them in) before waiting."""
    if mode in ("recv", "recv_timeout"):
        cudarecv.recv(td, **kw, **({"timeout": LONG} if mode == "recv_timeout" else {}))
        return
    [t] = cudarecv.irecv(
        td, return_premature=True, **kw, **({"timeout": LONG} if mode == "irecv_timeout" else {})
    )
    if posted is not None:
        posted.set()
    if turn is not None:
        assert turn.wait(LONG)
    assert t.wait(**({"timeout": LONG} if mode == "irecv_wait_timeout" else {})) is td


def concurrent_receives(rank, world, group, key, modes, plain, same_td):
    """Rank 0 sends versions 1..THREADS, all in flight at once; rank 1 receives them on THREADS threads, thread k in
    ``modes[k]``.

    Non-blocking receives are posted in thread order (each once the one before it has posted) and waited in the
    reverse order; blocking ones start together (a barrier) and race. ``plain``: this process cannot make segments
    (the plain fast wire). ``same_td``: every thread receives into one tensordict."""
    available = sides.available, policy.available
    if plain:  # (in these ranks' processes alone, until the call returns)
        sides.available = policy.available = lambda: "this test's processes make no segments"
    try:
        return _concurrent_receives(rank, world, key, modes, same_td)
    finally:
        sides.available, policy.available = available


def _concurrent_receives(rank, world, key, modes, same_td):
    pg = _group(rank, world, key)
    kw = dict(group=pg, bucket_bytes=4096, **({"group_dst": 1} if rank == 0 else {"group_src": 0}))
    if (
        rank == 0
    ):  # every version in flight at once (on the plain wire all their messages are posted at once)
        tds = [
            TensorDict(x=torch.full((4096,), float(version))) for version in range(1, THREADS + 1)
        ]
        wait_flag(f"{key}_posted")
        sends = [cudarecv.isend(td, timeout=LONG, return_early=True, **kw)[0] for td in tds]
        for t in sends:
            t.wait(timeout=2 * LONG)
        result = None
    else:
        one = TensorDict(x=torch.zeros(4096))
        tds = [one if same_td else TensorDict(x=torch.zeros(4096)) for _ in range(THREADS)]
        posted = [threading.Event() for _ in range(THREADS)]
        turns = [threading.Event() for _ in range(THREADS)]
        start = threading.Barrier(sum(m.startswith("recv") for m in modes) + 1)
        errors: list[str] = []

        def receiver(k: int) -> None:
            try:
                mode = modes[k]
                if mode.startswith("recv"):
                    start.wait(LONG)
                    _receive(mode, tds[k], kw)
                else:
                    if k and not modes[k - 1].startswith("recv"):
                        assert posted[k - 1].wait(LONG)
                    _receive(mode, tds[k], kw, posted[k], turns[k])
            except BaseException as error:  # noqa: BLE001 - reported to the test
                errors.append(f"thread {k} ({modes[k]}): {type(error).__name__}: {error}")
            finally:
                posted[k].set()
                if k:
                    turns[k - 1].set()  # the next thread back waits once this one has

        threads = [threading.Thread(target=receiver, args=(k,)) for k in range(THREADS)]
        for thread in threads:
            thread.start()
        for k, mode in enumerate(modes):
            if not mode.startswith("recv"):
                assert posted[k].wait(LONG)
        set_flag(f"{key}_posted")
        turns[THREADS - 1].set()  # the last posted is waited first
        start.wait(LONG)
        for thread in threads:
            thread.join(2 * LONG)
        assert not any(t.is_alive() for t in threads), "a receiving thread did not end"
        result = errors, [_whole(td) for td in tds]
    set_flag(f"{key}_done_{rank}")
    wait_flag(f"{key}_done_{1 - rank}")  # neither drops the group while the other uses it
    return result


def _check(result, modes, same_td) -> None:
    errors, got = result
    assert not errors, errors
    if same_td:
        assert got[0] == float(THREADS), (
            got
        )  # the receives ran one after the other, the last one last
        return
    assert sorted(got) == [float(v) for v in range(1, THREADS + 1)], (
        got
    )  # each a whole version, each once
    ordered = [v for v, m in zip(got, modes) if not m.startswith("recv")]
    assert ordered == sorted(ordered), (got, modes)  # the posted ones, in posting order


@pytest.mark.parametrize("plain", [False, True], ids=["shared_memory", "plain_wire"])
@pytest.mark.parametrize("mode", [*MODES, "mixed"])
def test_concurrent_receives_on_one_link_each_take_a_whole_message_in_order(cluster, mode, plain):
    modes = [MODES[k % len(MODES)] for k in range(THREADS)] if mode == "mixed" else [mode] * THREADS
    try:
        _, result = cluster().run(
            concurrent_receives, args=(unique_key("threads"), modes, plain, False), timeout=240
        )
    except BaseException:
        cluster().close()
        raise
    _check(result, modes, same_td=False)


@pytest.mark.parametrize("plain", [False, True], ids=["shared_memory", "plain_wire"])
@pytest.mark.parametrize("mode", ["recv", "recv_timeout"])
def test_concurrent_receives_into_one_tensordict_take_their_turns(cluster, mode, plain):
    """Blocking receives into one tensordict from several threads at once: each waits for the one before it (its
    staging is the tensordict's), none is lost or torn. (A non-blocking one waits for the one before it in the
    call, as from one thread.)"""
    modes = [mode] * THREADS
    try:
        _, result = cluster().run(
            concurrent_receives, args=(unique_key("one_td"), modes, plain, True), timeout=240
        )
    except BaseException:
        cluster().close()
        raise
    _check(result, modes, same_td=True)


def concurrent_sends(rank, world, group, key, plain):
    """Rank 0 sends versions 1..THREADS from THREADS threads at once (a barrier), one init_tag, 1 MiB each in 16
    messages; rank 1 receives THREADS times: each receive gets one whole version, each version once."""
    available = sides.available, policy.available
    if plain:
        sides.available = policy.available = lambda: "this test's processes make no segments"
    try:
        pg = _group(rank, world, key)
        kw = dict(
            group=pg,
            bucket_bytes=1 << 16,
            timeout=LONG,
            **({"group_dst": 1} if rank == 0 else {"group_src": 0}),
        )
        if rank == 1:
            got = []
            for _ in range(THREADS):
                td = TensorDict(x=torch.zeros(1 << 18))
                cudarecv.recv(td, **kw)
                got.append(_whole(td))
            result = got
        else:
            start, errors = threading.Barrier(THREADS), []

            def sender(version: int) -> None:
                try:
                    td = TensorDict(x=torch.full((1 << 18,), float(version)))
                    start.wait(LONG)
                    cudarecv.send(td, **kw)
                except BaseException as error:  # noqa: BLE001 - reported to the test
                    errors.append(f"version {version}: {type(error).__name__}: {error}")

            threads = [threading.Thread(target=sender, args=(v,)) for v in range(1, THREADS + 1)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(2 * LONG)
            assert not any(t.is_alive() for t in threads), "a sending thread did not end"
            result = errors
        set_flag(f"{key}_done_{rank}")
        wait_flag(f"{key}_done_{1 - rank}")
        return result
    finally:
        sides.available, policy.available = available


@pytest.mark.parametrize("plain", [False, True], ids=["shared_memory", "plain_wire"])
def test_concurrent_sends_on_one_link_each_go_whole(cluster, plain):
    try:
        errors, got = cluster().run(
            concurrent_sends, args=(unique_key("sends"), plain), timeout=240
        )
    except BaseException:
        cluster().close()
        raise
    assert not errors, errors
    assert sorted(got) == [float(v) for v in range(1, THREADS + 1)], got
