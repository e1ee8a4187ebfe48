"""The GPU path's logic, checked on the CPU.

- a recording process-group backend (a Python ``dist.ProcessGroup`` registered
  with ``Backend.register_backend``) sees what one call issues: one batch, every
  leaf in stock order with stock tags;
- the NCCL coalescing path on a standalone group, against a backend object that
  records ``_start_coalescing``/``send``/``recv``/``_end_coalescing``;
- ``Transfer`` is a ``torch.futures.Future``;
- staging buffers are allocated once and reused;
- every GPU-only module imports without CUDA or cupy, and asks for CUDA with a
  clear error instead of failing obscurely.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

import cudarecv
from cudarecv.core import streams as _cuda
from cudarecv.core import transport as _transport
from cudarecv.core.link import Link
from cudarecv.testing.gpu import nccl_pair_problem
from tdfactory import make

RECORDS: list[tuple] = []


class Recording(dist.ProcessGroup):
    """Records every send/recv with its peer, tag and byte count; completes at once."""

    def __init__(self, store, rank: int, size: int, timeout=None) -> None:
        super().__init__(rank, size)

    def _done(self):
        future = torch.futures.Future()
        future.set_result(None)
        return _create_work_from_future(future)

    def send(self, tensors, dst, tag=0):
        RECORDS.append(("send", dst, tag, tensors[0].numel() * tensors[0].element_size()))
        return self._done()

    def recv(self, tensors, src, tag=0):
        RECORDS.append(("recv", src, tag, tensors[0].numel() * tensors[0].element_size()))
        return self._done()

    def getBackendName(self) -> str:
        return "recording"


@pytest.fixture(scope="module")
def recording_world():
    """This process as rank 0 of a world of 2 on the recording backend."""
    if "recording" not in dist.Backend.backend_list:
        dist.Backend.register_backend("recording", Recording, devices=["cpu"])
    dist.init_process_group("recording", store=dist.HashStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.fixture
def spy_post(monkeypatch):
    calls = []
    real = _transport.post

    def spy(link, sending, tensors, tags, **kwargs):
        calls.append((sending, len(tensors)))
        return real(link, sending, tensors, tags, **kwargs)

    import cudarecv.wire.staging as staging

    monkeypatch.setattr(staging, "post", spy)
    return calls


@pytest.mark.parametrize("structure", ["nested", "lazy", "nested_tensorclass"])
@pytest.mark.parametrize("pseudo_rand", [False, True])
def test_one_call_is_one_batch_in_stock_order(recording_world, spy_post, structure, pseudo_rand):
    from tdfactory import leaves

    td = make(structure, 0.0)
    RECORDS.clear()
    cudarecv.irecv(td, src=1, init_tag=5, pseudo_rand=pseudo_rand)
    expected_tags = cudarecv.tag_sequence(5, len(leaves(td)), pseudo_rand=pseudo_rand).tolist()
    assert spy_post == [(False, len(leaves(td)))]  # one batch holding every leaf
    assert [r[2] for r in RECORDS] == expected_tags
    assert [r[3] for r in RECORDS] == [t.numel() * t.element_size() for t in leaves(td)]
    assert all(r[:2] == ("recv", 1) for r in RECORDS)


def test_stock_sends_the_same_records(recording_world):
    """Stock tensordict on the recording backend issues exactly what cudarecv issues."""
    from cudarecv.p2p.stock import Stock

    td = make("nested", 1.0)
    RECORDS.clear()
    Stock.isend(td, dst=1, init_tag=3, pseudo_rand=True)
    stock = list(RECORDS)
    RECORDS.clear()
    cudarecv.isend(td, dst=1, init_tag=3, pseudo_rand=True)
    assert stock == RECORDS


def test_fast_wire_is_one_header_then_buckets(recording_world):
    """One header, then the buckets; the first time a link carries a schema, the sender's layout follows the header
    on its tag (its length, then itself: :mod:`cudarecv.wire.layouts`)."""
    from cudarecv.plan.plan import plan_for

    td = make("nested", 1.0)
    td["only_here"] = torch.zeros(3)  # (a schema no other test sends on this process's links)
    total = plan_for(td).total
    buckets = [16] * (total // 16) + ([total % 16] if total % 16 else [])
    for first in (True, False):
        RECORDS.clear()
        cudarecv.isend(td, dst=1, bucket_bytes=16)
        assert RECORDS[0][3] == 64 and RECORDS[0][2] >= 1 << 30
        head = (
            3 if first else 1
        )  # (the header, and the first time the layout's length and the layout)
        assert [r[2] for r in RECORDS[:head]] == [RECORDS[0][2]] * head and (
            not first or RECORDS[1][3] == 8
        )
        assert [r[3] for r in RECORDS[head:]] == buckets


def test_transfer_is_a_future(recording_world):
    td = make("flat", 0.0)
    [transfer] = cudarecv.irecv(td, src=1, return_premature=True)
    assert isinstance(transfer, torch.futures.Future)
    chained = transfer.then(lambda fut: fut.value() is td)
    assert transfer.wait() is td and transfer.done() and transfer.event is None
    assert chained.wait() is True
    [sent] = cudarecv.isend(td, dst=1, return_early=True)
    assert sent.wait() is None


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e10, -1.0, "5", True])
def test_a_wait_with_a_timeout_out_of_range_is_refused_by_name(recording_world, bad):
    """(a wait of inf or 1e10 raised OverflowError from inside threading before)"""
    [transfer] = cudarecv.irecv(make("flat", 0.0), src=1, return_premature=True)
    with pytest.raises(
        cudarecv.ArgumentError, match="`timeout` must be a non-negative number of seconds up to"
    ):
        transfer.wait(bad)
    assert transfer.wait() is not None  # nothing was waited for: the transfer goes on


def test_stream_on_cpu_is_refused(recording_world):
    with pytest.raises(ValueError, match="`stream` was given"):
        cudarecv.irecv(make("flat", 0.0), src=1, stream=object())


class CoalescingBackend:
    """A standalone backend object with NCCL's coalescing calls, recording them."""

    def __init__(self):
        self.calls = []

    def name(self):
        return "nccl"

    def _start_coalescing(self, device):
        self.calls.append(("start", str(device)))

    def send(self, tensors, peer, tag):
        self.calls.append(("send", peer, tag))

    def recv(self, tensors, peer, tag):
        self.calls.append(("recv", peer, tag))

    def _end_coalescing(self, device):
        self.calls.append(("end", str(device)))
        return "one-work"


def test_standalone_nccl_batch_is_one_coalesced_group():
    backend = CoalescingBackend()
    link = Link(backend, 1, registered=False)
    works = _transport.post(link, False, [torch.zeros(2), torch.zeros(3)], [7, 8], batch=True)
    assert works == ["one-work"]
    assert backend.calls == [("start", "cpu"), ("recv", 1, 7), ("recv", 1, 8), ("end", "cpu")]


def test_standalone_group_without_coalescing_is_refused():
    class NoCoalescing:
        def name(self):
            return "nccl"

    with pytest.raises(RuntimeError, match="cannot coalesce"):
        _transport.post(
            Link(NoCoalescing(), 1, registered=False),
            True,
            [torch.zeros(1)] * 2,
            [0, 1],
            batch=True,
        )


def test_unbatched_nccl_goes_one_op_each():
    """cudarecv's own protocols post single ops (the pair's communicator), a stock peer too."""
    backend = CoalescingBackend()
    link = Link(backend, 1, registered=False)
    _transport.post(link, True, [torch.zeros(2)], [0])
    _transport.post(link, False, [torch.zeros(2), torch.zeros(3)], [5, 6], batch=False)
    assert backend.calls == [("send", 1, 0), ("recv", 1, 5), ("recv", 1, 6)]


def test_a_batch_of_one_is_still_a_batch():
    """A ring's messages of a batched transfer go one batch each: the peer's batch is on the group's communicator."""
    backend = CoalescingBackend()
    _transport.post(Link(backend, 1, registered=False), True, [torch.zeros(2)], [4], batch=True)
    assert backend.calls == [("start", "cpu"), ("send", 1, 4), ("end", "cpu")]


def test_a_backends_coalescing_takes_no_device():
    """torch's Backend objects (a standalone ProcessGroupNCCL) take no device in _start/_end_coalescing,
    unlike ProcessGroup's (the mock above): the stand-in of tests/test_nccl_rules.py is one."""
    from cudarecv.testing.strict_nccl import StrictNccl

    group = StrictNccl(dist.HashStore(), 0, 1, timeout=5.0)
    group._group_ready = True  # (one rank: its first batch needs nobody else)
    with pytest.raises(TypeError):
        group._start_coalescing(torch.device("cpu"))
    group._start_coalescing()
    group._end_coalescing()  # (the library's batches through it: tests/test_nccl_rules.py)


@pytest.mark.parametrize(
    "setting, size, batched",
    [("1", 3, True), ("0", 2, False), (None, 2, True), (None, 3, False), ("auto", 4, False)],
)
def test_nccl_batching_switch(monkeypatch, setting, size, batched):
    """The stock wire's per-leaf messages batch on two-rank groups by default (``CUDARECV_NCCL_BATCH`` forces
    it); a larger group's communicator would need every rank's first batch."""

    class Sized(CoalescingBackend):
        def size(self):
            return size

    if setting is None:
        monkeypatch.delenv("CUDARECV_NCCL_BATCH", raising=False)
    else:
        monkeypatch.setenv("CUDARECV_NCCL_BATCH", setting)
    assert _transport.nccl_batching(Link(Sized(), 1, registered=False)) is batched


def test_a_bad_batching_setting_is_refused(monkeypatch):
    monkeypatch.setenv("CUDARECV_NCCL_BATCH", "yes")
    with pytest.raises(cudarecv.ArgumentError, match="CUDARECV_NCCL_BATCH"):
        _transport.nccl_batching(Link(CoalescingBackend(), 1, registered=False))


def test_staging_pool_allocates_once_and_bounds_depth():
    pool = _cuda.StagingPool()
    first = pool.buffers("cpu", 1024)
    assert pool.fence(first[0]) is None
    pool.set_fence(first[0], "event")
    assert pool.fence(first[0]) == "event" and pool.fence(first[1]) is None
    assert len(first) == 2 and pool.allocations == 2
    for _ in range(100):
        again = pool.buffers("cpu", 1024)
        assert all(a is b for a, b in zip(again, first))
    assert pool.buffers("cpu", 1024, count=1)[0] is first[0]
    assert len(pool.buffers("cpu", 1024, count=50)) == 2  # never more than two per size
    assert pool.allocations == 2


def test_plan_staging_is_reused():
    from cudarecv.plan.plan import plan_for

    td = make("nested", 0.0)
    plan = plan_for(td)
    assert plan.staging("cpu") is plan.staging("cpu")
    assert plan.pieces(8, "cpu") is plan.pieces(8, "cpu")
    assert plan.staging_parts("cpu") is plan.staging_parts("cpu")


def test_gpu_modules_import_without_cuda_or_cupy():
    """Block cupy and pynvml: the package, its GPU modules and the plugin still import."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('cupy', 'pynvml'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import cudarecv, cudarecv.core.streams, cudarecv.wire.staging, cudarecv.core.transport, cudarecv.cuda.tag_kernel\n"
        "import cudarecv.testing.nvml, cudarecv.testing.pytest_plugin\n"
        "assert cudarecv.testing.nvml.gpu_count() == 0\n"
        "assert not cudarecv.cuda.tag_kernel.gpu_available()\n"
        "print(cudarecv.tag_sequence(0, 3, pseudo_rand=True).tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[9651, 3450, 3834]"


def test_tag_kernel_not_used_without_cuda(monkeypatch):
    from cudarecv.plan import tags as _tags

    assert not _tags._kernel_wanted()
    monkeypatch.setenv("CUDARECV_TAG_KERNEL", "0")
    assert not _tags._kernel_wanted()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_cuda_tensordict_without_cuda_is_a_clear_error(recording_world):
    link = Link(dist.distributed_c10d._get_default_group(), 1, registered=True)
    from cudarecv.wire.staging import lane_for

    with pytest.raises(RuntimeError, match="needs CUDA"):
        lane_for(link, torch.device("cuda", 0), None, _cuda.StagingPool())


def test_a_finished_transfer_does_not_keep_its_tensordict_alive(recording_world):
    import gc
    import weakref

    td = make("nested", 1.0)
    [transfer] = cudarecv.isend(td, dst=1, bucket_bytes=16, return_early=True)
    transfer.wait()
    ref = weakref.ref(td)
    del td, transfer
    gc.collect()
    assert ref() is None, "the plan cache kept a finished transfer's tensordict alive"


def test_nccl_pair_problem_explains_itself():
    import torch.distributed as dist

    for shared in (False, True):
        problem = nccl_pair_problem(shared)
        if not dist.is_nccl_available():
            assert problem == "torch.distributed has no NCCL backend in this build"
        elif not shared and torch.cuda.device_count() < 2:
            assert "2 GPUs" in problem and "NCCL_MULTI_RANK_GPU_ENABLE=1" in problem


class FakeEvent:
    """A CUDA event that fires after ``pending`` queries; records how it was waited for."""

    def __init__(self, pending: int = 3, **flags) -> None:
        self.pending, self.flags, self.calls = pending, flags, []

    def query(self) -> bool:
        self.calls.append("query")
        self.pending -= 1
        return self.pending < 0

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def record(self, stream) -> None:
        self.calls.append("record")


def test_an_event_wait_blocks_in_cuda_never_polls(monkeypatch):
    """EventWork.wait blocks in cudaEventSynchronize (one call, no query loop), timeout or not, and
    record() makes blocking-sync events (the host thread sleeps in the OS instead of spinning)."""
    from cudarecv.core.transfer import _UNBOUNDED

    for timeout in (None, _UNBOUNDED):
        event = FakeEvent()
        assert _cuda.EventWork(event).wait(timeout) is True
        assert event.calls == ["synchronize"], event.calls
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    made = _cuda.record("stream")
    assert made.flags == {"blocking": True} and made.calls == ["record"]


class Pending:
    """A work still in flight (as every gloo send or receive reports until something waits for it)."""

    def is_completed(self) -> bool:
        return False


def test_parked_works_are_never_dropped(monkeypatch, caplog):
    """Far more than the old bound of 256 parked entries: every pending one is kept, completed ones are
    let go once the count passes PARKED_WARN, and the logger says how many are kept."""
    warn = _transport.PARKED_WARN
    monkeypatch.setattr(_transport, "_PARKED", type(_transport._PARKED)())
    monkeypatch.setattr(_transport, "_warn_at", warn)
    monkeypatch.setattr(_transport, "_scan_at", warn)
    done = torch.futures.Future()
    done.set_result(None)
    first = Pending()
    _transport.park([first])
    for _ in range(warn - 1):
        _transport.park([_create_work_from_future(done)])  # completed: let go at the first scan
    assert list(_transport._PARKED) == [(None, (first,))]
    with caplog.at_level("WARNING", logger="cudarecv"):
        for _ in range(2 * warn):
            _transport.park([Pending()])
    parked = list(_transport._PARKED)
    assert parked[0] == (None, (first,)) and len(parked) == 2 * warn + 1, len(parked)
    messages = [record.getMessage() for record in caplog.records]  # one per doubling
    assert [int(m.split()[0]) for m in messages] == [warn, 2 * warn], messages
    assert "are kept alive (dropping one still pending would close its link)" in messages[0]


def test_parked_works_past_the_bound_go_oldest_first_and_are_said(monkeypatch, caplog):
    warn = _transport.PARKED_WARN
    monkeypatch.setattr(_transport, "_PARKED", type(_transport._PARKED)())
    monkeypatch.setattr(_transport, "_warn_at", warn)
    monkeypatch.setattr(_transport, "_scan_at", warn)
    monkeypatch.setattr(_transport, "PARKED_MAX", 2 * warn)
    works = [Pending() for _ in range(4 * warn)]
    with caplog.at_level("WARNING", logger="cudarecv"):
        for work in works:
            _transport.park([work])
    parked = [entry[1][0] for entry in _transport._PARKED]
    assert parked == works[-2 * warn :]  # the oldest went first, the newest are all kept
    dropped = [r.getMessage() for r in caplog.records if "were dropped" in r.getMessage()]
    assert dropped and "cancels its message and closes its link" in dropped[0], caplog.records


def test_what_is_parked_on_a_group_whose_peer_left_is_let_go_of(monkeypatch):
    """release(pg): every entry parked on that group goes, pending or not (its peer left for good); the others
    and the unnamed ones stay (an elastic sender's pairs would otherwise stay alive, with their sockets)."""
    monkeypatch.setattr(_transport, "_PARKED", type(_transport._PARKED)())

    class Group:  # (a process group: weakly referenced)
        pass

    gone, other = Group(), Group()
    kept = [Pending(), Pending()]
    _transport.park([Pending()], gone)
    _transport.park([kept[0]], other)
    _transport.park([Pending(), Pending()], gone)
    _transport.park([kept[1]])
    _transport.release(gone)
    assert [entry[1][0] for entry in _transport._PARKED] == kept


# -- GPU readiness, issue 27 (NCCL items 5 and 9), checked without a GPU ------------------------------


def test_a_device_without_index_is_the_callers_current_one(monkeypatch):
    """Driver threads' current device is 0 whatever the caller's: ``cuda`` is resolved on the caller's thread."""
    from cudarecv.core import streams

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert streams.explicit(torch.device("cuda")) == torch.device("cuda", 3)
    assert streams.explicit(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert streams.explicit(torch.device("cpu")) == torch.device("cpu")


def test_a_cuda_ipc_pointer_that_torch_would_copy_is_refused(monkeypatch):
    """``torch.as_tensor`` of a peer GPU's pointer may copy it onto the device asked: stale bytes later. The view
    is checked (same pointer, same device) and a copy refused, so the offer is declined and the wire carries it."""
    from cudarecv.samehost import cuda_ipc

    released = []
    monkeypatch.setattr(
        torch, "as_tensor", lambda obj, device=None: torch.zeros(16, dtype=torch.uint8)
    )
    with pytest.raises(cuda_ipc.MappingError, match="a copy of the device memory at 0x1000"):
        cuda_ipc._view(0x1000, 16, torch.device("cuda", 1), released.append)


def test_gpu_bench_rows_record_what_carried_them(cluster):
    """(Issue 27 item 7: a row labelled CUDA IPC measured the wire.) The GPU bench's rank code records each
    cudarecv receive's ``Transfer.transport``, which bench_gpu.py checks against the row's label; here on the
    CPU, where the same host gives shared memory and a ``wire`` mode the socket."""
    from cudarecv.tools import gpu_ranks

    cases = [
        dict(
            leaves=20,
            total_bytes=1 << 20,
            impl=impl,
            mode=mode,
            send_place="cpu",
            recv_place="cpu",
            iters=1,
            warmup=1,
        )
        for impl, mode in (
            ("cudarecv", "buckets 64KiB"),
            ("cudarecv", "chunks 256KiB wire"),
            ("stock", "per-leaf"),
        )
    ]
    rows = cluster().run(gpu_ranks.time_gpu_suite, args=(cases, 1), timeout=120)[1]
    assert [(row["ok"], row["transport"]) for row in rows] == [
        (True, "shared memory"),
        (True, "wire"),
        (True, "wire"),
    ], rows


# -- issue 47: lanes on background threads, a stream per link (CUDA faked here) ------------------------------


class _DeviceStream:
    """A fake CUDA stream that says its device."""

    def __init__(self, device=None, priority: int = 0) -> None:
        index = device if isinstance(device, int) else torch.device(device or "cuda:0").index
        self.device = torch.device("cuda", index or 0)

    def wait_stream(self, other) -> None:
        pass


class _ThreeRanks:
    """A group object as much as a lane needs: NCCL, three ranks, this one rank 1, lazily initialised."""

    def name(self) -> str:
        return "NCCL"

    def size(self) -> int:
        return 3

    def rank(self) -> int:
        return 1


@pytest.fixture
def device_one(monkeypatch):
    """CUDA as seen by a process whose main thread made device 1 current: any other thread's is device 0."""
    import threading

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "current_device",
        lambda: 1 if threading.current_thread() is threading.main_thread() else 0,
    )
    monkeypatch.setattr(torch.cuda, "Stream", _DeviceStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _DeviceStream(device))
    monkeypatch.setattr(
        _cuda, "_CUPY", None
    )  # (cudarecv's streams from the fake above, never cupy's)


def _on_a_thread(fn):
    """``fn()`` on a new thread: its result, or the exception it raised."""
    import threading

    out = []

    def run():
        try:
            out.append(fn())
        except Exception as error:  # noqa: BLE001 - the test says what it got
            out.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return out[0]


def test_a_relay_lane_built_on_a_pulls_thread_stages_on_the_receivers_device(device_one):
    """Issue 47 item 5: a receiver of host memory on NCCL stages through the device current when it was made
    (1); its relay lanes are made during a pull, maybe on a background thread (whose current device is 0):
    they stage on the receiver's device, with a stream of that device."""
    from cudarecv.weights.relay import Hop
    from cudarecv.wire.staging import lane_for

    pg = _ThreeRanks()
    to_sender = lane_for(
        Link(pg, 0, False, "nccl"),
        torch.device("cpu"),
        None,
        _cuda.StagingPool(),
        peers_at_once=True,
    )
    assert to_sender.stream.device == torch.device("cuda", 1)
    hop = Hop(to_sender, tags=None, device=torch.device("cpu"))
    lane = _on_a_thread(lambda: hop._lane(2, Link(pg, 2, False, "nccl")))
    assert not isinstance(lane, Exception), lane
    assert lane.stream.device == torch.device("cuda", 1)
    assert lane.stream is not to_sender.stream  # (a stream of the link's own)


def test_lane_for_stages_host_memory_on_the_device_it_is_told(device_one):
    from cudarecv.wire.staging import lane_for

    link = Link(_ThreeRanks(), 2, False, "nccl")
    told = _on_a_thread(
        lambda: lane_for(
            link, torch.device("cpu"), None, _cuda.StagingPool(), cuda=torch.device("cuda", 1)
        )
    )
    assert told.stream.device == torch.device("cuda", 1)
    mine = _DeviceStream(1)
    given = _on_a_thread(lambda: lane_for(link, torch.device("cpu"), mine, _cuda.StagingPool()))
    assert given.stream is mine  # (the caller's stream, on its device)
    # untold, a thread's current device it is: what a lane built on the caller's own thread wants
    assert _on_a_thread(
        lambda: lane_for(link, torch.device("cpu"), None, _cuda.StagingPool())
    ).stream.device == torch.device("cuda", 0)


def test_a_weight_ends_links_each_have_a_stream_of_their_own(device_one):
    """Issue 47 item 1: one stream per link (per group and peer), reused; p2p calls keep the device's one."""
    from cudarecv.wire.staging import lane_for

    pg = _ThreeRanks()
    device = torch.device("cuda", 1)

    def lane(peer, **kw):
        return lane_for(Link(pg, peer, False, "nccl"), device, None, _cuda.StagingPool(), **kw)

    to0, to2 = lane(0, peers_at_once=True), lane(2, peers_at_once=True)
    assert to0.stream is not to2.stream
    assert lane(0, peers_at_once=True).stream is to0.stream
    assert lane(0).stream is lane(2).stream is _cuda.dedicated_stream(device)
    copier = _DeviceStream(1)
    assert lane(0, peers_at_once=True, after=copier).after is copier


def test_a_registered_nccl_group_gets_pairs_of_its_own(monkeypatch):
    """Issue 47 item 4 (and the review's defect 1): on an NCCL group torch.distributed knows (lazy or eager, any
    size) a weight end's messages go on a pair group of the two ends (made once per peer while used, each
    formation under a prefix of its own); on a standalone group, on the group itself, except an eager one of 3+
    ranks, which cannot be used (UsageError)."""
    from cudarecv.wire import staging

    class Counts:  # (a store's add: what both ends count their formations on)
        def __init__(self):
            self.n = {}

        def add(self, key, by):
            self.n[key] = self.n.get(key, 0) + by
            return self.n[key]

    made = []
    registered = set()
    counts = Counts()
    monkeypatch.setattr(
        staging,
        "make_pair",
        lambda link, prefix, store: made.append((link.peer, prefix)) or object(),
    )
    monkeypatch.setattr(
        staging, "pair_store", lambda link: counts if id(link.pg) in registered else None
    )
    standalone = _ThreeRanks()
    assert staging.pair_link(Link(standalone, 2, False, "nccl")).pg is standalone
    eager_standalone = _ThreeRanks()
    eager_standalone.bound_device_id = torch.device("cuda", 1)
    with pytest.raises(cudarecv.UsageError, match="registered group"):
        staging.pair_link(Link(eager_standalone, 2, False, "nccl"))
    for eager in (False, True):
        made.clear()
        group = _ThreeRanks()
        if eager:
            group.bound_device_id = torch.device("cuda", 1)
        registered.add(id(group))
        pair = staging.pair_link(Link(group, 2, False, "nccl"))
        assert (
            pair.pg is not group and pair.peer == 1 and pair.backend == "nccl"
        )  # (rank 1 < 2: pair rank 0)
        assert staging.pair_link(Link(group, 2, False, "nccl")) is pair and len(made) == 1
        assert staging.pair_link(Link(group, 0, False, "nccl")).peer == 0 and len(made) == 2
        gloo = Link(group, 2, False, "gloo")
        assert staging.pair_link(gloo) is gloo
        # the last user's release lets go of it; the next end forms a new one, under a new prefix
        staging.release_pair(pair)
        assert staging.is_pair(pair)
        staging.release_pair(pair)
        assert not staging.is_pair(pair)
        again = staging.pair_link(Link(group, 2, False, "nccl"))
        assert again is not pair and made[-1][1] != made[0][1], made
        # an aborted pair is evicted at once, whoever still holds it
        assert staging.evict_pair(again) and not staging.is_pair(again)
        staging.release_pair(again)  # (a no-op now)


class _FakeCupy:
    """cupy as far as :func:`cudarecv.core.streams.new_stream` uses it: says which device was current when
    each stream was made, with which flags; each stream a distinct handle."""

    def __init__(self) -> None:
        import types

        self.current = 0
        self.made: list[tuple[int, bool]] = []  # (device current, non_blocking) per stream made
        fake = self

        class Device:
            def __init__(self, index: int) -> None:
                self.index = index

            def __enter__(self):
                self.before, fake.current = fake.current, self.index
                return self

            def __exit__(self, *exc) -> None:
                fake.current = self.before

        class Stream:
            def __init__(self, non_blocking: bool = False) -> None:
                fake.made.append((fake.current, non_blocking))
                self.ptr = 0x7000 + len(fake.made)

        self.cuda = types.SimpleNamespace(is_available=lambda: True, Device=Device, Stream=Stream)


class _FakeExternal:
    """``torch.cuda.ExternalStream`` that records the handle and device it wraps."""

    def __init__(self, stream_ptr: int, device=None) -> None:
        self.cuda_stream, self.device = stream_ptr, torch.device(device)

    def wait_stream(self, other) -> None:
        pass


def _fresh_streams(monkeypatch) -> None:
    """cudarecv's streams module as in a new process: nothing made, the choice of cupy not yet taken."""
    import weakref

    monkeypatch.setattr(_cuda, "_CUPY", _cuda._UNDECIDED)
    monkeypatch.setattr(_cuda, "_STREAMS", {})
    monkeypatch.setattr(_cuda, "_COPY_STREAMS", {})
    monkeypatch.setattr(_cuda, "_LINK_STREAMS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _DeviceStream(device))


def test_cudarecvs_streams_are_cupys_own_never_torchs_pool(monkeypatch):
    """Issue 47 (review, item 1): torch.cuda.Stream() hands out one of 32 pooled streams per device, which
    NCCL's communicators draw from too; cudarecv's streams (per link, per owner, per device) are each a CUDA
    stream of cupy's, made non-blocking on the stream's device, wrapped as an ExternalStream that keeps it
    alive, and released with its owner (a link's with its group)."""
    import gc
    import sys
    import weakref

    from cudarecv.wire.staging import lane_for

    _fresh_streams(monkeypatch)
    cupy = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch.cuda, "ExternalStream", _FakeExternal)

    def pooled(*args, **kwargs):
        raise AssertionError("a stream drawn from torch's pool")

    monkeypatch.setattr(torch.cuda, "Stream", pooled)
    device = torch.device("cuda", 1)
    pg = _ThreeRanks()
    made = [
        _cuda.link_stream(device, pg, 0),
        _cuda.link_stream(device, pg, 2),
        _cuda.link_copy_stream(device, pg, 0),
        _cuda.own_stream(device),
        _cuda.own_stream(device),
        _cuda.dedicated_stream(device),
        _cuda.copy_stream(device),
    ]
    assert all(isinstance(s, _FakeExternal) for s in made), made
    assert len({s.cuda_stream for s in made}) == len(made)  # each a CUDA stream of its own
    assert all(s.device == device and s._cudarecv_owner.ptr == s.cuda_stream for s in made)
    assert cupy.made == [(1, True)] * len(
        made
    )  # non-blocking, made with the stream's device current
    assert cupy.current == 0  # (the caller's current device is left as it was)
    # a weight end's lane of host memory on NCCL: its link's stream and its link's copy stream
    lane = lane_for(
        Link(pg, 0, False, "nccl"),
        torch.device("cpu"),
        None,
        _cuda.StagingPool(),
        peers_at_once=True,
        cuda=device,
    )
    assert lane.stream is made[0] and lane.copier is made[2]
    plain = lane_for(
        Link(pg, 0, False, "nccl"), torch.device("cpu"), None, _cuda.StagingPool(), cuda=device
    )
    assert plain.stream is made[5] and plain.copier is None  # (a plain call: the device's own pair)
    assert len(cupy.made) == len(made)  # (reused, none made again)
    # an owner's stream goes with its owner, a link's with its group
    owner = weakref.ref(made[3]._cudarecv_owner)
    link = weakref.ref(made[0]._cudarecv_owner)
    del made, lane, plain
    gc.collect()
    assert owner() is None and link() is not None
    del pg
    gc.collect()
    assert link() is None


def test_without_cupy_streams_come_from_torchs_pool_and_it_is_said_once(monkeypatch, caplog):
    """Without cupy, cudarecv's streams are torch's pooled ones, and the cudarecv logger says once that they
    may alias."""
    import logging
    import sys

    _fresh_streams(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", None)  # (import cupy raises ImportError)
    monkeypatch.setattr(torch.cuda, "Stream", _DeviceStream)
    pg = _ThreeRanks()
    with caplog.at_level(logging.WARNING, logger="cudarecv"):
        made = [
            _cuda.link_stream(torch.device("cuda", 1), pg, 0),
            _cuda.link_copy_stream(torch.device("cuda", 1), pg, 0),
            _cuda.own_stream(torch.device("cuda", 0)),
            _cuda.dedicated_stream(torch.device("cuda", 0)),
        ]
    assert all(type(s) is _DeviceStream for s in made)
    assert [s.device.index for s in made] == [1, 1, 0, 0]
    said = [
        r for r in caplog.records if r.name == "cudarecv" and "may then alias" in r.getMessage()
    ]
    assert len(said) == 1 and "cupy cannot be imported" in said[0].getMessage(), caplog.records


def test_a_pair_group_whose_shutdown_waits_on_a_posted_op_is_aborted_within_its_bound(monkeypatch):
    """The last end's release of a pair group: ``shutdown()`` (which in torch 2.6+ waits for ops still posted, e.g.
    the header receive of a pull that timed out) is waited for ``SHUTDOWN_WAIT`` s, then the group is aborted,
    which ends the posted op and so the shutdown; a shutdown that returns is left at that."""
    import threading

    from cudarecv.wire import staging

    monkeypatch.setattr(staging, "SHUTDOWN_WAIT", 0.2)

    class Stuck:
        def __init__(self, hangs: bool) -> None:
            self.hangs, self.aborted = hangs, threading.Event()

        def shutdown(self) -> None:
            if self.hangs:
                assert self.aborted.wait(30), "shutdown() was never released by an abort"

        def abort(self) -> None:
            self.aborted.set()

    for hangs in (True, False):
        group = Stuck(hangs)
        start = time.monotonic()
        staging._shut(group)
        assert group.aborted.is_set() is hangs
        assert time.monotonic() - start < 5.0
        assert not [t for t in threading.enumerate() if t.name == "cudarecv-pair-shutdown"]
