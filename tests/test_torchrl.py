"""The cudarecv weight-sync scheme in real TorchRL collectors (the torchrl extra, tensordict 0.14).

Every test runs a real collector over two ``PendulumEnv`` worker processes.
The policy's actions encode its weights (:mod:`cudarecv.testing.rl`), so the
batches show which version each worker acted with, and whether any action saw
half of one.
"""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "torchrl", reason="the torchrl extra is not installed (pip install 'cudarecv[torchrl]')"
)

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme  # noqa: E402

import cudarecv  # noqa: E402
from cudarecv.testing.rl import make_env, marker_policy, markers, set_marker  # noqa: E402
from cudarecv.torchrl import BACKEND, CudarecvWeightSyncScheme  # noqa: E402

pytestmark = pytest.mark.timeout(240)
WORKERS = 2


@contextlib.contextmanager
def collector(cls, policy, scheme, frames=20):
    coll = cls(
        [make_env] * WORKERS,
        policy,
        frames_per_batch=frames,
        total_frames=-1,
        device="cpu",
        weight_sync_schemes={"policy": scheme},
    )
    try:
        yield coll
    finally:
        done = threading.Thread(target=coll.shutdown, daemon=True)
        done.start()
        done.join(60)
        for proc in getattr(coll, "procs", []):  # a shutdown that waited on a dead worker: end it
            if proc.is_alive():
                proc.kill()


def update(coll, policy, value, **kwargs):
    set_marker(policy, value)
    coll.update_policy_weights_(**kwargs)


def test_backend_is_registered_and_arguments_checked():
    scheme = WeightSyncScheme.from_backend(BACKEND, timeout=5.0, sync=False)
    assert (
        isinstance(scheme, CudarecvWeightSyncScheme) and scheme.timeout == 5.0 and not scheme.sync
    )
    for kwargs, name in [
        ({"strategy": "state_dict"}, "strategy"),
        ({"sync": 1}, "sync"),
        ({"timeout": 0}, "timeout"),
        ({"connect_timeout": -1}, "connect_timeout"),
        ({"transport": "carrier pigeon"}, "transport"),
        ({"bucket_bytes": -1}, "bucket_bytes"),
        ({"host": ""}, "host"),
        ({"device": "warp drive"}, "device"),
        ({"zero_copy": 1}, "zero_copy"),
    ]:
        with pytest.raises(cudarecv.ArgumentError, match=f"`{name}`"):
            CudarecvWeightSyncScheme(**kwargs)


def test_travels_to_workers_without_its_connections():
    class Context:
        num_workers = 3

    class NoWorkers:
        pass

    scheme = CudarecvWeightSyncScheme(timeout=5.0)
    scheme.init_on_sender(model_id="policy", context=Context(), ctx=None)
    copy = pickle.loads(pickle.dumps(scheme))
    assert copy._store is None and copy._port == scheme._port and copy._workers == 3
    assert copy._session == scheme._session and not copy.initialized_on_sender
    with pytest.raises(cudarecv.UsageError, match="not connected"):
        scheme.send()
    with pytest.raises(cudarecv.ArgumentError, match="number of workers"):
        CudarecvWeightSyncScheme().init_on_sender(model_id="policy", context=NoWorkers())


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero_copy"])
def test_multisync_workers_act_with_every_version(zero_copy):
    policy = marker_policy(1 << 20)
    scheme = CudarecvWeightSyncScheme(timeout=30.0, zero_copy=zero_copy)
    with collector(MultiSyncCollector, policy, scheme) as coll:
        batches = iter(coll)
        assert markers(next(batches)) == {0.0}
        # (the workers told the trainer in the handshake whether they act where the snapshots lie)
        assert [r.alias for r in scheme._trainer.sender._s.members] == [zero_copy] * WORKERS
        for i in range(1, 16):
            update(coll, policy, i / 4)
            batch = next(batches)
            for worker in range(WORKERS):  # dim 0 is the worker
                assert markers(batch[worker]) == {i / 4}, (i, worker, markers(batch[worker]))
        # explicit weights: sent as they are, the trainer's policy untouched
        other = (
            TensorDict.from_module(marker_policy(1 << 20))
            .data.clone()
            .apply(lambda t: t.fill_(9.5))
        )
        coll.update_policy_weights_(other)
        assert markers(next(batches)) == {9.5} and policy.module.bias.item() == 15 / 4
        with pytest.raises(cudarecv.ArgumentError, match="worker_ids"):
            coll.update_policy_weights_(worker_ids=[0])
        with pytest.raises(cudarecv.ArgumentError, match="keys, shapes and dtypes"):
            coll.update_policy_weights_(TensorDict({"bias": torch.zeros(1)}, []))
        update(coll, policy, 20.0)  # the refused calls sent nothing: the link is in step
        assert markers(next(batches)) == {20.0}
        set_marker(
            policy, 33.0
        )  # changed, not sent: workers act with what was sent (no alias of the trainer's)
        assert markers(next(batches)) | markers(next(batches)) == {20.0}


def test_delta_workers_on_the_wire_take_patches_and_act_with_every_version():
    """``delta=True`` with workers on the wire: a version whose every weight moved goes whole, one that changed
    little as a patch (here none: a few hundred bytes of a 1 MiB policy); every batch acts with the version."""
    policy = marker_policy(1 << 20)
    scheme = CudarecvWeightSyncScheme(timeout=30.0, transport="wire", delta=True)
    with collector(MultiSyncCollector, policy, scheme) as coll:
        batches = iter(coll)
        assert markers(next(batches)) == {0.0}
        sender = scheme._trainer.sender
        total = sender.schema.total
        for i in range(1, 4):
            update(coll, policy, i / 4)  # (every weight moves: the version whole)
            assert markers(next(batches)) == {i / 4}
            assert set(sender.payload_bytes.values()) == {total}
            update(coll, policy, i / 4)  # (nothing moved: a patch of its fixed part alone)
            assert markers(next(batches)) == {i / 4}
            assert all(0 < b < 1024 for b in sender.payload_bytes.values()), sender.payload_bytes


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero_copy"])
def test_multiasync_actions_never_see_half_a_version(zero_copy):
    policy = marker_policy(
        4 << 20
    )  # 4 MB: a switch that copied in place would be caught in the middle
    sent = [0.0]
    with collector(
        MultiAsyncCollector, policy, CudarecvWeightSyncScheme(timeout=30.0, zero_copy=zero_copy)
    ) as coll:
        batches = iter(coll)
        next(batches)
        for i in range(1, 21):
            sent.append(float(i))
            update(coll, policy, float(i))
            seen = set()
            for _ in range(WORKERS + 1):  # batches collected before the update may still be queued
                seen |= markers(next(batches))
                assert seen <= set(sent), (
                    f"actions computed with no version that was sent: {seen - set(sent)}"
                )
                if float(i) in seen:
                    break
            assert float(i) in seen, (
                f"version {i} not acted with in {WORKERS + 1} batches after the update"
            )


def test_latest_mode_never_waits_and_workers_catch_up():
    policy = marker_policy(1 << 20)
    with collector(
        MultiSyncCollector, policy, CudarecvWeightSyncScheme(sync=False, timeout=30.0)
    ) as coll:
        batches = iter(coll)
        next(batches)
        for i in range(1, 6):
            update(coll, policy, float(i))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # each worker switches as soon as the version has landed
            seen = markers(next(batches))
            assert seen <= {0.0, 1.0, 2.0, 3.0, 4.0, 5.0}
            if seen == {5.0}:
                break
        assert seen == {5.0}


def test_dead_worker_is_named_within_the_timeout():
    policy = marker_policy(1 << 16)
    timeout = 10.0
    with collector(MultiSyncCollector, policy, CudarecvWeightSyncScheme(timeout=timeout)) as coll:
        batches = iter(coll)
        next(batches)
        update(coll, policy, 1.0)
        coll.procs[1].kill()
        coll.procs[1].join(10)
        start = time.monotonic()
        with pytest.raises(cudarecv.Error, match=r"worker") as info:
            update(coll, policy, 2.0)
        assert time.monotonic() - start < timeout + 5, (
            "the dead worker was not reported within the timeout"
        )
        assert isinstance(
            info.value, (cudarecv.PeerError, cudarecv.TransferTimeout, cudarecv.ReceiverFailed)
        )


def test_readme_example_runs():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "examples/torchrl_collector.py"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    for k in range(5):
        assert f"batch {k} collected with weights [{float(k)}]" in proc.stdout, proc.stdout


def test_distributed_collector_syncs_through_cudarecv():
    from torchrl.collectors.distributed import DistributedCollector

    from cudarecv.testing.rl import free_ports

    policy = marker_policy(1 << 20)
    coll = DistributedCollector(
        [make_env] * WORKERS,
        policy,
        frames_per_batch=20,
        total_frames=10**12,
        launcher="mp",
        backend="gloo",
        sync=True,
        tcp_port=free_ports(3),
        weight_sync_schemes={"policy": CudarecvWeightSyncScheme(timeout=30.0)},
    )
    try:
        batches = iter(coll)
        assert markers(next(batches)) == {0.0}
        for i in range(1, 6):
            update(coll, policy, float(i))
            assert markers(next(batches)) == {float(i)}
    finally:
        coll.shutdown()


def test_latest_mode_names_a_dead_worker_once_and_goes_on():
    policy = marker_policy(1 << 16)
    timeout = 10.0
    with collector(
        MultiSyncCollector, policy, CudarecvWeightSyncScheme(sync=False, timeout=timeout)
    ) as coll:
        next(iter(coll))
        scheme = coll._weight_sync_schemes["policy"]
        coll.procs[1].kill()
        coll.procs[1].join(10)
        start, raised = time.monotonic(), None
        while raised is None and time.monotonic() - start < timeout:
            try:
                update(coll, policy, 1.0)  # never waits: the loss is named by a later call
            except cudarecv.PeerError as error:
                raised = error
            time.sleep(0.05)
        assert raised is not None and "worker" in str(raised), (
            "the dead worker was not named within the timeout"
        )
        update(coll, policy, 2.0)  # named once; the live worker keeps getting versions
        assert scheme.version >= 2 and len(scheme._trainer.sender.ranks) == 1


def test_a_shut_down_scheme_leaves_no_thread_and_is_collectable():
    """A trainer and a worker in one process (threads): after shutdown, no thread of the scheme runs and
    nothing (an exit hook included) keeps either side, its group or its receiver alive."""
    import copy
    import gc
    import weakref

    class Context:
        num_workers = 1

    policy = marker_policy(1 << 10)
    before = set(
        threading.enumerate()
    )  # (earlier tests' collectors, never shut down, keep their schemes' threads)
    trainer = CudarecvWeightSyncScheme(timeout=10.0, connect_timeout=30.0)
    trainer.init_on_sender(model_id="policy", context=Context(), model=policy, weights=policy)
    worker = pickle.loads(pickle.dumps(trainer))
    acting = copy.deepcopy(policy)  # (the scheme holds the model weakly)
    worker.init_on_receiver(model_id="policy", model=acting, worker_idx=0)
    joining = threading.Thread(target=worker.connect, kwargs={"worker_idx": 0})
    joining.start()
    trainer.connect()
    joining.join(30)
    set_marker(policy, 1.0)
    trainer.send(weights=policy)  # returns once the worker acts with it
    assert trainer.version == worker.version == 2
    refs = [
        weakref.ref(worker),
        weakref.ref(trainer),
        weakref.ref(worker._worker.receiver),
        weakref.ref(worker._group),
    ]
    worker.shutdown()
    trainer.shutdown()
    del worker, trainer
    gc.collect()
    started = (
        set(threading.enumerate()) - before
    )  # (but the process-wide one that keeps transfers' deadlines)
    assert [t.name for t in started if t.name != "cudarecv-deadlines"] == []
    assert [ref() for ref in refs] == [None] * len(refs)


def test_weights_the_policy_replaced_are_the_ones_sent():
    policy = marker_policy(1 << 10)
    with collector(MultiSyncCollector, policy, CudarecvWeightSyncScheme(timeout=30.0)) as coll:
        batches = iter(coll)
        assert markers(next(batches)) == {0.0}
        policy.load_state_dict(
            {k: torch.full_like(v, 2.0) for k, v in policy.state_dict().items()}, assign=True
        )
        coll.update_policy_weights_()
        assert markers(next(batches)) == {2.0}, (
            "the weights load_state_dict(assign=True) replaced were sent"
        )
        with torch.no_grad():
            for p in policy.parameters():
                p.data = torch.full_like(p, 3.0)
        coll.update_policy_weights_()
        assert markers(next(batches)) == {3.0}, "the weights p.data = ... replaced were sent"


EXIT_RUNS = 6
EXIT_CHILD = """
import sys
sys.path.insert(0, {here!r})
import test_torchrl
kept = test_torchrl.exit_child({sync!r}, {role!r}, {port})
"""


def exit_child(sync: bool, role: str, port: int) -> tuple:
    """One side of one run: the trainer sends version 2 to one worker, both meet at a barrier on the store,
    print the version they hold and keep everything open to the end of the process (returned: a script's
    globals)."""
    from datetime import timedelta

    import torch.distributed as dist

    class Context:
        num_workers = 1

    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=30))
    policy = marker_policy(1 << 10)
    if role == "trainer":
        scheme = CudarecvWeightSyncScheme(sync=sync, timeout=20.0, connect_timeout=30.0)
        scheme.init_on_sender(model_id="policy", context=Context(), model=policy, weights=policy)
        store.set("scheme", pickle.dumps(scheme))
        scheme.connect()
        set_marker(policy, 1.0)
        scheme.send(weights=policy)
    else:
        scheme = pickle.loads(store.get("scheme"))
        scheme.init_on_receiver(model_id="policy", model=policy, worker_idx=0)
        scheme.connect(worker_idx=0)
    store.set(role, "1")
    store.wait(
        ["trainer", "worker"]
    )  # (sync: the worker's thread switched to version 2 before the send returned)
    print("RESULT", role, scheme.version, flush=True)
    return scheme, policy, store


def _exit_run(sync: bool) -> list[tuple[int, str]]:
    import os
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    here = str(Path(__file__).resolve().parent)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                EXIT_CHILD.format(here=here, sync=sync, role=role, port=store.port),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for role in ("trainer", "worker")
    ]
    ended = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        ended.append((proc.returncode, out))
    return ended


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "latest"])
def test_schemes_never_shut_down_exit_cleanly(sync):
    """A trainer and a worker process that end right after a transfer, their schemes never shut down, exit
    with 0 (not SIGABRT: the worker's thread inside gloo at interpreter shutdown, nor a hang)."""
    for run in range(EXIT_RUNS):
        ended = _exit_run(sync)
        assert [rc for rc, _ in ended] == [0, 0], (
            run,
            ended,
        )  # SIGABRT is -6, a hang is killed (-9)
        assert "RESULT trainer 2" in ended[0][1], (run, ended)
        assert not sync or "RESULT worker 2" in ended[1][1], (run, ended)
