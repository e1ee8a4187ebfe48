"""Issue 47, item 9, on the CPU: a single NCCL op waits while another thread coalesces on its group; a control
message's device bytes belong to the transfer stream; the tag kernel runs on a non-blocking stream of its own.

The GPU side of the last two (real streams, the caching allocator, cupy) is in tests/test_gpu_digest_tags.py.
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import threading
import time
import types
from collections.abc import Iterator

import numpy as np
import torch

from cudarecv.core import transport
from cudarecv.core.link import Link
from cudarecv.cuda import tag_kernel
from cudarecv.testing.strict_nccl import NcclRuleError, StrictNccl, stand_in_cuda
from cudarecv.wire import control
from rawwire import store, unique_key

TIMEOUT = 20.0


def _waits_for_the_lock(thread: threading.Thread) -> bool:
    """``thread`` waits for its group's coalescing lock: its innermost Python frame is :func:`transport.post` or
    ``_coalesced`` at the line that takes the lock (the acquire itself is C)."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None or frame.f_code not in (
        transport.post.__code__,
        transport._coalesced.__code__,
    ):
        return False
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return line.startswith("with _coalescing(")


def single_op_while_coalescing(rank, world, group, key):
    """Rank 0: thread "batch" posts a batch and stays inside it until thread "single" (a single op on the same
    group) waits for the lock or has failed; rank 1 receives both (the batch on the group's communicator, the
    single op on the pair's)."""
    with stand_in_cuda("device"):
        pg = StrictNccl(store(), rank, world, timeout=TIMEOUT, name=key)
        link = Link(pg, 1 - rank, False)
        if rank == 1:
            batched, single = torch.zeros(64), torch.zeros(32)
            works = transport.post(link, False, [batched], [7], batch=True)
            works += transport.post(link, False, [single], [8])
            try:
                for work in works:
                    work.wait()
            except NcclRuleError as error:  # (what rank 0 says is the cause)
                return f"NcclRuleError: {error}"
            return batched.unique().tolist(), single.unique().tolist()
        inside, outcomes = threading.Event(), {}
        send = pg.send
        second: list[threading.Thread] = []

        def send_holding(tensors, dst, tag=0):
            if threading.current_thread().name == "batch" and not inside.is_set():
                inside.set()
                for _ in range(int(TIMEOUT / 0.01)):
                    if "single" in outcomes or (second and _waits_for_the_lock(second[0])):
                        break
                    time.sleep(
                        0.01
                    )  # (a bounded poll for the other thread's state; no ordering rests on it)
            return send(tensors, dst, tag)

        pg.send = send_holding

        def post(name, fill, size, batch):
            try:
                for work in transport.post(
                    link, True, [torch.full((size,), fill)], [7], batch=batch
                ):
                    work.wait()
                outcomes[name] = "ok"
            except NcclRuleError as error:
                outcomes[name] = f"NcclRuleError: {error}"

        first = threading.Thread(target=post, args=("batch", 1.0, 64, True), name="batch")
        second.append(threading.Thread(target=post, args=("single", 2.0, 32, False), name="single"))
        first.start()
        assert inside.wait(TIMEOUT)
        second[0].start()
        for thread in (first, second[0]):
            thread.join(2 * TIMEOUT)
        return outcomes


def test_a_single_op_waits_while_another_thread_coalesces(cluster):
    """(Issue 47, item 9: single ops skipped the coalescing lock; on NCCL one posted while another thread
    coalesces on the group joins that thread's batch, which the stand-in refuses: "posts an op while batch
    coalesces".) The single op waits for the batch to be posted; both arrive, each on its communicator."""
    sent, got = cluster().run(
        single_op_while_coalescing, args=(unique_key("single"),), timeout=4 * TIMEOUT
    )
    assert sent == {"batch": "ok", "single": "ok"}, sent
    assert got == ([1.0], [2.0]), got


class _Lane:
    """What :func:`control.wire_bytes` reads of a lane on NCCL: its transfer stream, entered by ``on_stream``."""

    nccl = True

    def __init__(self) -> None:
        self.cuda = types.SimpleNamespace(device=torch.device("cpu"))
        self.entered = False

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        self.entered = True
        try:
            yield
        finally:
            self.entered = False


def test_control_bytes_are_allocated_on_the_transfer_stream(monkeypatch):
    """(Issue 47, item 9: wire_bytes allocated its device tensor on the caller's current stream, then wrote and
    sent it on the transfer stream; freed right after posting, its block went back to the caller's stream while
    the copy and the send were still queued.) The tensor is allocated with the transfer stream current, the
    stream whose work writes it, so the caching allocator orders its reuse after that work."""
    lane = _Lane()
    allocations: list[bool] = []
    empty = torch.empty

    def recording_empty(*args, **kwargs):
        if kwargs.get("device") is not None:  # a device allocation: which stream is current?
            allocations.append(lane.entered)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    out = control.wire_bytes(lane, b"header bytes")  # type: ignore[arg-type]
    assert bytes(out.numpy()) == b"header bytes"
    assert allocations == [True], allocations


class _FakeStream:
    def __init__(self, log: list[str], non_blocking: bool = False, null: bool = False) -> None:
        self.log, self.non_blocking, self.null = log, non_blocking, null

    def __enter__(self) -> _FakeStream:
        _FakeCupy.current.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _FakeCupy.current.pop()


class _FakeCupy(types.ModuleType):
    """Just what tag_map_gpu uses of cupy: which stream is current at the launch and at the copy back."""

    current: list[_FakeStream] = []
    int64 = np.int64

    def __init__(self) -> None:
        super().__init__("cupy")
        self.log: list[str] = []
        _FakeCupy.current = [
            _FakeStream(self.log, null=True)
        ]  # cupy's default: the legacy default stream
        self.cuda = types.SimpleNamespace(
            Stream=lambda non_blocking=False: _FakeStream(self.log, non_blocking),
            runtime=types.SimpleNamespace(getDevice=lambda: 0),
        )

    def empty(self, size: int, dtype: object) -> np.ndarray:
        return np.zeros(size, dtype=np.int64)

    def asnumpy(self, out: np.ndarray, stream: _FakeStream | None = None) -> np.ndarray:
        used = stream if stream is not None else _FakeCupy.current[-1]
        self.log.append(
            f"copy on {'legacy default' if used.null else 'non-blocking' if used.non_blocking else 'blocking'}"
        )
        return out


def test_the_tag_kernel_runs_on_a_non_blocking_stream_of_its_own(monkeypatch):
    """(Issue 47, item 9: the kernel and its copy back ran on cupy's current stream, by default CUDA's legacy
    default stream, which waits for the work of every blocking stream, torch's default stream included.) Both run
    on a non-blocking stream created for them."""
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(tag_kernel, "_STREAMS", {}, raising=False)

    def kernel(grid, block, args):
        current = _FakeCupy.current[-1]
        fake.log.append(
            f"kernel on {'legacy default' if current.null else 'non-blocking' if current.non_blocking else 'blocking'}"
        )

    monkeypatch.setattr(tag_kernel, "_range_kernel", lambda: kernel)
    assert tag_kernel.tag_map_gpu().shape == (10_001,)
    assert tag_kernel.tag_map_gpu().shape == (10_001,)
    assert fake.log == ["kernel on non-blocking", "copy on non-blocking"] * 2, fake.log
    assert len(tag_kernel._STREAMS) == 1  # (one stream, made once)


def test_the_stand_in_refuses_a_single_op_inside_another_threads_batch():
    """(The rule the first test leans on, shown to bite without cudarecv: a raw op from a second thread while one
    thread coalesces.)"""
    import torch.distributed as dist

    st = dist.HashStore()
    with stand_in_cuda("device"):
        pg = StrictNccl(st, 0, 1, timeout=2.0, name=unique_key("raw"))
        pg._group_ready = True
        pg._start_coalescing()
        caught = []

        def single():
            try:
                pg.send([torch.zeros(4)], 0, 0)
                caught.append("ok")
            except NcclRuleError:
                caught.append("NcclRuleError")

        thread = threading.Thread(target=single)
        thread.start()
        thread.join(10)
        pg._end_coalescing()
    assert caught == ["NcclRuleError"], caught
