"""Weight sync with several threads on one end: pushes from two threads on one sender, pulls from two
threads on one receiver. Calls take turns: every version is whole, versions go up, none is lost.

Each version's two leaves hold one value unique to it; the ranks compare what each receiver saw with
what the sender pushed.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from rawwire import store, unique_key

PER_THREAD = 25
LEAF = (
    1 << 15
)  # floats per leaf (128 KiB): a copy takes long enough for two threads' pushes to overlap
TIMEOUT = 20


def weights(value: float) -> TensorDict:
    return TensorDict(a=torch.full((LEAF,), value), b=torch.full((LEAF,), value))


def whole(td: TensorDict) -> float | None:
    """The one value both leaves hold, or None for a torn version."""
    value = td["a"][0].item()
    same = all(torch.equal(td[k], torch.full((LEAF,), value)) for k in ("a", "b"))
    return value if same else None


def two_pushing_threads(rank, world, group, key, mode):
    """Rank 0 pushes from two threads released together; rank 1 pulls on the wire, rank 2 through shared
    memory (copied out), rank 3 through shared memory with zero copy."""
    signals = store()
    total = 2 * PER_THREAD
    if rank == 0:
        with cudarecv.WeightSender(
            weights(0.0), dst=[1, 2, 3], mode=mode, timeout=TIMEOUT
        ) as sender:
            transports = sender.transports
            start = threading.Barrier(2, timeout=TIMEOUT)
            pushed: dict[int, float] = {}
            errors: list[str] = []

            def pushing(thread: int) -> None:
                try:
                    start.wait()
                    for i in range(PER_THREAD):
                        value = float(1 + thread * 1000 + i)
                        pushed[sender.push(values=weights(value))] = value
                except Exception as error:  # noqa: BLE001 - reported to the test
                    errors.append(f"{type(error).__name__}: {error}")

            threads = [threading.Thread(target=pushing, args=(t,)) for t in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(TIMEOUT * 2)
            alive = [t for t in threads if t.is_alive()]
            signals.set(f"{key}_pushed", "1")
            signals.wait([f"{key}_done_{r}" for r in (1, 2, 3)])
        return transports, pushed, errors, len(alive)
    transport = "wire" if rank == 1 else "auto"
    with cudarecv.WeightReceiver(
        src=0, timeout=TIMEOUT, transport=transport, zero_copy=rank == 3
    ) as receiver:
        seen = []
        try:
            while receiver.version < total:
                version = receiver.pull()
                with receiver.reading() as td:
                    seen.append((version, whole(td)))
        except cudarecv.Error as error:
            seen.append(f"{type(error).__name__}: {error}")
        signals.set(f"{key}_done_{rank}", "1")
        signals.wait([f"{key}_pushed"])
        return seen


@pytest.mark.parametrize("mode", ["sync", "latest"])
def test_two_threads_pushing_on_one_sender(four, mode):
    (transports, pushed, errors, alive), *receivers = four().run(
        two_pushing_threads, args=(unique_key("push_threads"), mode), timeout=100
    )
    assert errors == [] and alive == 0, errors
    assert transports == {1: "wire", 2: "shared memory", 3: "shared memory"}, transports
    assert sorted(pushed) == list(range(1, 2 * PER_THREAD + 1)), sorted(pushed)
    for rank, seen in enumerate(receivers, start=1):
        assert all(isinstance(s, tuple) for s in seen), (rank, seen[-1])
        versions = [v for v, _ in seen]
        assert versions == sorted(set(versions)) and versions[-1] == 2 * PER_THREAD, (
            rank,
            versions,
        )
        if mode == "sync":
            assert versions == list(range(1, 2 * PER_THREAD + 1)), (rank, versions)
        torn = [(v, value, pushed.get(v)) for v, value in seen if value != pushed.get(v)]
        assert torn == [], f"rank {rank}: (version, value held, value pushed): {torn}"


def two_pulling_threads(rank, world, group, key):
    """Rank 0 pushes versions whose value is the version itself; rank 1 pulls them from two threads."""
    signals = store()
    total = 2 * PER_THREAD
    if rank == 0:
        with cudarecv.WeightSender(weights(0.0), dst=1, timeout=TIMEOUT) as sender:
            failure = None
            try:  # (a receiver that failed closes: the test shows its result first)
                for version in range(1, total + 1):
                    assert sender.push(values=weights(float(version))) == version
            except cudarecv.Error as error:
                failure = f"{type(error).__name__}: {error}"
            signals.wait([f"{key}_done"])
        return failure
    with cudarecv.WeightReceiver(src=0, timeout=TIMEOUT) as receiver:
        start = threading.Barrier(2, timeout=TIMEOUT)
        seen: list[list] = [[], []]

        def pulling(thread: int) -> None:
            try:
                start.wait()
                for _ in range(PER_THREAD):
                    version = receiver.pull()
                    with (
                        receiver.reading() as td
                    ):  # this version, or one another pull published since
                        seen[thread].append((version, whole(td)))
            except Exception as error:  # noqa: BLE001 - reported to the test
                seen[thread].append(f"{type(error).__name__}: {error}")

        threads = [threading.Thread(target=pulling, args=(t,)) for t in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT * 2)
        signals.set(f"{key}_done", "1")
        return seen, sum(t.is_alive() for t in threads), receiver.version


def test_two_threads_pulling_on_one_receiver(cluster):
    failure, (seen, alive, version) = cluster().run(
        two_pulling_threads, args=(unique_key("pull_threads"),), timeout=100
    )
    assert alive == 0
    for pulls in seen:
        assert all(isinstance(p, tuple) for p in pulls), pulls[-1]
        versions = [v for v, _ in pulls]
        assert versions == sorted(set(versions)), versions
        assert all(value is not None and value >= v for v, value in pulls), (
            f"torn or older: {pulls}"
        )
    assert sorted(v for pulls in seen for v, _ in pulls) == list(range(1, 2 * PER_THREAD + 1))
    assert version == 2 * PER_THREAD and failure is None, failure
