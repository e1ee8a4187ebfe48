"""GPU tests: dedicated streams, staging, event-backed futures, NCCL batching, the tag kernel.

Every test here is marked ``gpus(k)`` and is also skipped when
``torch.cuda.is_available()`` is False, so the CPU suite collects and skips
them. Run them on a GPU machine with::

    pytest --gpus 1 tests/test_gpu.py   # every test, the NCCL ones included
    pytest --gpus 2 tests/test_gpu.py   # also the two-GPU cases (CUDA IPC across GPUs)

The NCCL tests are marked ``gpus(1)`` too: their ranks come from
:func:`cudarecv.testing.gpu.nccl_ranks`, which puts rank ``r`` on GPU ``r`` where there
are enough GPUs and otherwise shares them: with NCCL >= 2.30 (the library loaded, asked
through ``ncclGetVersion``) by ``NCCL_MULTI_RANK_GPU_ENABLE=1``; with an older NCCL (2.28
on the lent one-GPU machines) by giving each rank its own ``NCCL_HOSTID``, so NCCL takes
them for separate nodes talking over sockets on loopback (slow, every NCCL path runs).
``CUDARECV_NCCL_MODE=per_gpu|multi_rank|hostid`` forces a mode. They are skipped, saying
why, without NCCL in torch (:func:`cudarecv.testing.gpu.nccl_ranks_problem`).

Transfers run between two spawned ranks (:class:`cudarecv.testing.launch.Cluster`):
rank 0 sends, rank 1 receives and checks what it got. Every wait is bounded: the
process groups time out after 60 s and each call into the ranks after 30-90 s,
so a hang fails its test (the ranks are then replaced) instead of stalling the run.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.core import streams as _cuda
from cudarecv.p2p.stock import Stock
from cudarecv.plan.walk import unwrap
from cudarecv.testing.gpu import nccl_ranks, nccl_ranks_problem
from cudarecv.testing.launch import Ranks
from held import many_transfers, weights_and_transfers
from rawwire import unique_key
from tdfactory import STRUCTURES, leaves, make

HAS_CUDA = torch.cuda.is_available()
NCCL_GPUS = 1  # nccl_ranks runs any number of NCCL ranks on one GPU (its module docstring)
PG_TIMEOUT = 60.0
RUN_TIMEOUT = 90.0
WAIT = 30.0  # Transfer.wait(timeout=...) inside the ranks
MEMORY_SLACK = 64 << 10  # bytes of device memory a few freed 64-byte headers may still hold

pytestmark = [
    pytest.mark.gpus(1),
    pytest.mark.skipif(
        not HAS_CUDA,
        reason="torch.cuda.is_available() is False: needs a CUDA build of torch and a visible GPU",
    ),
]
nccl_mark = pytest.mark.gpus(NCCL_GPUS)

SMALL = STRUCTURES
ALL = STRUCTURES + ("big",)


# --------------------------------------------------------------------------- parent side: ranks


@pytest.fixture(scope="module")
def gloo():
    """Two gloo ranks; the tests put their CUDA tensors on GPU 0 in both."""
    ranks = Ranks(2, pg_timeout=PG_TIMEOUT)
    yield ranks
    ranks.close()


def nccl_skip_reason(world: int = 2) -> str | None:
    """Why ``world`` NCCL ranks cannot run here, or None."""
    return nccl_ranks_problem(world)


def _nccl(world: int):
    """``world`` NCCL ranks: a GPU each where there are enough, else sharing GPU 0 (nccl_ranks)."""
    reason = nccl_skip_reason(world)
    if reason:
        pytest.skip(reason)
    ranks = nccl_ranks(world, pg_timeout=PG_TIMEOUT)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def nccl():
    """Two NCCL ranks (one GPU each, or both on GPU 0: see the module docstring)."""
    yield from _nccl(2)


# --------------------------------------------------------------------------- rank side: helpers


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _peer(rank: int, group: Any) -> dict:
    if group is None:
        return {"dst": 1} if rank == 0 else {"src": 0}
    return {"group": group, "group_dst": 1} if rank == 0 else {"group": group, "group_src": 0}


def _make(structure: str, fill: float):
    """tdfactory's structures, plus ``big``: leaves that span many messages."""
    if structure == "big":
        return TensorDict(
            big=torch.arange(300_000, dtype=torch.float32) + fill,
            small=torch.full((3,), fill),
            mid=torch.arange(5000, dtype=torch.float64) * (fill + 1),
            batch_size=[],
        )
    return make(structure, fill)


def _place(td, place: str, consolidated: bool):
    """``td`` on ``place`` ("cpu", "cuda" or, consolidated only, "pinned")."""
    if not consolidated:
        if place == "pinned":
            raise ValueError("pinned is for consolidated storage")
        return td.to(_device()) if place == "cuda" else td
    if place == "cuda":
        return td.consolidate(metadata=True, device=_device())
    if place == "pinned":
        return td.consolidate(metadata=True, pin_memory=True)
    return td.consolidate(metadata=True)


def _storage_facts(td) -> dict:
    """Where the consolidated storage is, and whether every leaf is a view of it."""
    storage = unwrap(td)._consolidated["storage"]
    start, end = storage.data_ptr(), storage.data_ptr() + storage.numel()
    # (an empty leaf has no storage: data pointer 0 once consolidated, stock's layout as ours)
    inside = all(
        start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end
        for t in leaves(td)
        if t.numel()
    )
    return {
        "device": storage.device.type,
        "pinned": storage.device.type == "cpu" and storage.is_pinned(),
        "leaves_in_storage": inside,
    }


def _equal(td, expected) -> bool:
    """Every leaf of ``td`` equals ``expected``'s (read on the caller's current stream)."""
    a, b = leaves(td), leaves(expected)
    return len(a) == len(b) and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def _call(impl: str, name: str, td, **kwargs):
    if impl == "stock":
        from tensordict.utils import _is_tensorclass

        inner = td._tensordict if _is_tensorclass(type(td)) else td
        return getattr(Stock, name)(inner, **kwargs)
    return getattr(cudarecv, name)(td, **kwargs)


def _finish() -> None:
    """Leave nothing running on the GPU when a rank function returns."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


_CYCLES_PER_SECOND: float | None = None


def _sleep_on(stream, seconds: float) -> None:
    """Queue a GPU kernel on ``stream`` that spins for about ``seconds``."""
    global _CYCLES_PER_SECOND
    if _CYCLES_PER_SECOND is None:
        probe = torch.cuda.Stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(probe):
            torch.cuda._sleep(1000)
            start.record()
            torch.cuda._sleep(20_000_000)
            end.record()
        end.synchronize()
        _CYCLES_PER_SECOND = 20_000_000 / (start.elapsed_time(end) / 1e3)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(_CYCLES_PER_SECOND * seconds))


def _options(consolidated: bool, bucket_bytes: int | None, extra: dict | None = None) -> dict:
    opts = dict(extra or {})
    if consolidated:
        opts["consolidated"] = True
    if bucket_bytes is not None:
        opts["bucket_bytes"] = bucket_bytes
    return opts


# --------------------------------------------------------------------------- in-process


def test_dedicated_stream_is_cached_and_not_the_default_stream():
    d0 = torch.device("cuda", 0)
    s = _cuda.dedicated_stream(d0)
    assert s is _cuda.dedicated_stream(torch.device("cuda:0"))
    assert s is _cuda.dedicated_stream(d0)
    assert s.device == d0
    assert s != torch.cuda.default_stream(d0)
    assert s != torch.cuda.current_stream(d0)
    copier = _cuda.copy_stream(d0)
    assert (
        copier is _cuda.copy_stream(d0) and copier != s and copier != torch.cuda.default_stream(d0)
    )
    assert _cuda.transfer_stream(d0, None) is s
    mine = torch.cuda.Stream(device=d0)
    assert _cuda.transfer_stream(d0, mine) is mine
    if torch.cuda.device_count() > 1:
        d1 = torch.device("cuda", 1)
        s1 = _cuda.dedicated_stream(d1)
        assert s1 is _cuda.dedicated_stream(d1) and s1 is not s and s1.device == d1
        with pytest.raises(ValueError, match="pass a stream of"):
            _cuda.transfer_stream(d1, mine)


def test_tag_kernel_matches_numpy_and_stock_and_is_fast():
    from cudarecv.cuda import tag_kernel
    from cudarecv.p2p.stock import int_generator as _int_generator
    from cudarecv.plan.tags import MAX_TAG, int_generator_many, tag_map

    if not tag_kernel.gpu_available():
        pytest.skip("cupy is not installed or sees no CUDA device (pip install 'cudarecv[gpu]')")
    got = tag_kernel.tag_map_gpu()
    assert got.dtype == np.int64 and got.shape == (MAX_TAG + 1,)
    # tag_map() may itself come from the kernel in a CUDA process: compare with the numpy twin too
    np.testing.assert_array_equal(got, tag_map())
    np.testing.assert_array_equal(got, int_generator_many(np.arange(MAX_TAG + 1, dtype=np.uint64)))
    assert got.tolist() == [_int_generator(s) for s in range(MAX_TAG + 1)]
    micros = min(tag_kernel.time_tag_map_gpu(100) for _ in range(3))
    assert micros < 100, (
        f"the tag map kernel took {micros:.1f} us per launch of all {MAX_TAG + 1} entries"
    )


def test_delta_codec_on_the_device_matches_the_host_and_its_speed_is_printed():
    """Delta's torch codec on a GPU (no host round trip): the same patch bytes as the native host codec, applied on
    the device; then the diff and compaction of 1 GB of bf16 with 1% changed, timed (issue 45's target: < 5 ms)."""
    from cudarecv.weights import delta

    generator = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (40 << 20 | 96,), dtype=torch.uint8, generator=generator)
    new = base.clone()
    words = new.view(torch.int16)
    words[torch.randperm(words.numel(), generator=generator)[: words.numel() // 100]] += 1
    words[(8 << 20) : (12 << 20)] += 1  # (full blocks, and bitmask ones at their edges)
    host = delta.encode(new, base, 2)
    device = delta.encode(new.cuda(), base.cuda(), 2)
    assert host is not None and device is not None and torch.equal(device.cpu(), host)
    into = base.cuda()
    delta.apply(device, into, 2)
    assert torch.equal(into.cpu(), new)
    big = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda")
    moved = big.clone()
    flat = moved.view(torch.int16)
    flat[torch.randint(0, flat.numel(), (flat.numel() // 100,), device="cuda")] += 1
    out = torch.empty_like(big)
    for _ in range(2):  # (warm: allocations, kernels)
        delta.encode(moved, big, 2, out)
    torch.cuda.synchronize()
    start = time.perf_counter()
    patch = delta.encode(moved, big, 2, out)
    torch.cuda.synchronize()
    millis = (time.perf_counter() - start) * 1e3
    assert patch is not None
    print(f"\ndelta: diff + compaction of 1 GiB bf16, 1% changed: {millis:.2f} ms on the device")


def test_blake3_kernel_digest_matches_the_host():
    from cudarecv.cuda import kernels as _kernels
    from cudarecv.cuda.digest import digest

    if not _kernels.gpu_available():
        pytest.skip("cupy is not installed or sees no CUDA device (pip install 'cudarecv[gpu]')")
    generator = torch.Generator().manual_seed(0)
    for n in (0, 1, 1023, 1024, 1025, 3 * 1024 + 5, 1 << 20, (1 << 26) + 3):
        host = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
        assert digest(host.cuda()) == digest(host), n
    big = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device="cuda")
    digest(big)
    torch.cuda.synchronize()
    start = time.perf_counter()
    digest(big)
    seconds = time.perf_counter() - start
    host = big.cpu()
    start = time.perf_counter()
    digest(host)
    host_seconds = time.perf_counter() - start
    print(
        f"BLAKE3 of 256 MiB: GPU {seconds * 1e3:.2f} ms ({big.numel() / seconds / 1e9:.1f} GB/s), "
        f"host {host_seconds * 1e3:.2f} ms"
    )  # measured, not asserted


# --------------------------------------------------------------------------- transfers, both backends


def roundtrip(rank, world, group, case, blocking):
    """Two transfers per structure with new values each; the receiver checks every leaf.

    ``case``: sender/receiver impl ("cudarecv"/"stock") and place ("cpu", "cuda",
    "pinned"), ``consolidated``, ``bucket_bytes``, ``extra`` options, ``structures``.
    """
    opts = _options(case["consolidated"], case["bucket_bytes"], case.get("extra"))
    peer = _peer(rank, group)
    out: dict[str, Any] = {"values": {}, "facts": {}, "futures": {}}
    for structure in case["structures"]:
        td = None
        for step in range(2):
            fill = 5.0 + step
            if rank == 0:
                sent = _place(_make(structure, fill), case["send_place"], case["consolidated"])
                if blocking:
                    _call(case["sender"], "send", sent, **peer, **opts)
                else:
                    works = _call(case["sender"], "isend", sent, **peer, return_early=True, **opts)
                    for work in works:
                        if case["sender"] == "stock":
                            work.wait()
                        else:
                            work.wait(timeout=WAIT)
                continue
            if td is None:  # the same receiver both steps: cached plan and staging
                td = _place(_make(structure, 0.0), case["recv_place"], case["consolidated"])
                if case["consolidated"]:
                    out["facts"][structure] = _storage_facts(td)
            if blocking:
                _call(case["receiver"], "recv", td, **peer, **opts)
            else:
                futures = _call(
                    case["receiver"], "irecv", td, **peer, return_premature=True, **opts
                )
                if case["receiver"] == "stock":
                    for work in futures:
                        work.wait()
                else:
                    [t] = futures
                    got = t.wait(timeout=WAIT)
                    out["futures"][(structure, step)] = {
                        "future": isinstance(t, torch.futures.Future),
                        "returns_td": got is td,
                        "event": None if t.event is None else type(t.event).__name__,
                    }
            out["values"][(structure, step)] = _equal(td, _make(structure, fill))
    _finish()
    return out


def _case(
    sender,
    send_place,
    receiver,
    recv_place,
    *,
    consolidated=False,
    bucket_bytes=None,
    extra=None,
    structures=ALL,
    name=None,
):
    kind = (
        "chunks"
        if consolidated and bucket_bytes
        else "consolidated"
        if consolidated
        else "buckets"
        if bucket_bytes
        else "per-leaf"
    )
    label = (
        name
        or f"{kind}{'' if bucket_bytes is None else '-' + str(bucket_bytes)}-"
        f"{sender}_{send_place}-to-{receiver}_{recv_place}"
    )
    case = dict(
        sender=sender,
        send_place=send_place,
        receiver=receiver,
        recv_place=recv_place,
        consolidated=consolidated,
        bucket_bytes=bucket_bytes,
        extra=extra,
        structures=structures,
    )
    return pytest.param(case, id=label)


KiB, MiB = 1 << 10, 1 << 20
C = "cudarecv"

GLOO_CASES = [
    # the stock wire, with a stock peer wherever it can be one (stock cannot send CUDA over gloo)
    _case("stock", "cpu", C, "cuda"),
    _case(C, "cuda", "stock", "cpu"),
    _case(C, "cuda", C, "cuda"),
    _case(
        C,
        "cuda",
        C,
        "cuda",
        extra={"pseudo_rand": True, "init_tag": 3},
        structures=SMALL,
        name="per-leaf-pseudo_rand-cuda-to-cuda",
    ),
    _case("stock", "cpu", C, "cuda", consolidated=True),
    _case(C, "cuda", "stock", "cpu", consolidated=True),
    _case(C, "cuda", C, "cuda", consolidated=True),
    _case("stock", "cpu", C, "pinned", consolidated=True),
    _case(C, "cuda", C, "pinned", consolidated=True),
    # the fast wire: buckets (non-consolidated) and chunks (consolidated)
    _case(C, "cuda", C, "cuda", bucket_bytes=64, structures=SMALL),
    _case(C, "cuda", C, "cuda", bucket_bytes=100_000, structures=("big", "nested")),
    _case(C, "cpu", C, "cuda", bucket_bytes=MiB),
    _case(C, "cuda", C, "cpu", bucket_bytes=MiB),
    _case(C, "cuda", C, "cuda", consolidated=True, bucket_bytes=64, structures=SMALL),
    _case(C, "cuda", C, "cuda", consolidated=True, bucket_bytes=256 * KiB, structures=("big",)),
    _case(
        C, "cpu", C, "cuda", consolidated=True, bucket_bytes=256 * KiB, structures=("big", "nested")
    ),
    _case(
        C,
        "cuda",
        C,
        "pinned",
        consolidated=True,
        bucket_bytes=256 * KiB,
        structures=("big", "nested"),
    ),
    _case(C, "pinned", C, "cuda", consolidated=True, bucket_bytes=256 * KiB, structures=("big",)),
]

NCCL_CASES = [
    _case(C, "cuda", C, "cuda"),
    _case(
        C,
        "cuda",
        C,
        "cuda",
        extra={"pseudo_rand": True, "init_tag": 3},
        structures=SMALL,
        name="per-leaf-pseudo_rand-cuda-to-cuda",
    ),
    _case(C, "cuda", C, "cpu"),  # host leaves: a ring of two device buffers
    _case(C, "cpu", C, "cuda"),
    _case(C, "cuda", C, "cuda", consolidated=True),
    _case(C, "cuda", C, "pinned", consolidated=True),
    _case(C, "pinned", C, "cuda", consolidated=True),
    _case(C, "cuda", C, "cuda", bucket_bytes=64, structures=SMALL),
    _case(C, "cuda", C, "cuda", bucket_bytes=MiB),
    _case(C, "cuda", C, "cpu", bucket_bytes=MiB),
    _case(C, "cpu", C, "cuda", bucket_bytes=MiB),
    _case(C, "cuda", C, "cuda", consolidated=True, bucket_bytes=4096, structures=("big", "nested")),
    _case(
        C, "cuda", C, "pinned", consolidated=True, bucket_bytes=4096, structures=("big", "nested")
    ),
    _case(C, "pinned", C, "cuda", consolidated=True, bucket_bytes=4096, structures=("big",)),
]


def _check_roundtrip(out: dict, case: dict, blocking: bool, backend: str) -> None:
    bad = [k for k, ok in out["values"].items() if not ok]
    assert out["values"] and not bad, f"wrong values received for (structure, step) {bad}"
    for structure, facts in out["facts"].items():
        place = case["recv_place"]
        assert facts["leaves_in_storage"], (
            f"{structure}: a leaf is not a view of the consolidated storage"
        )
        assert facts["device"] == ("cuda" if place == "cuda" else "cpu"), (structure, facts)
        assert facts["pinned"] == (place == "pinned"), f"{structure}: storage pinned? {facts}"
    if not blocking and case["receiver"] == "cudarecv":
        gpu = backend == "nccl" or case["recv_place"] == "cuda"
        for key, f in out["futures"].items():
            assert f["future"] and f["returns_td"], (key, f)
            assert f["event"] == ("Event" if gpu else None), (
                f"{key}: Transfer.event is {f['event']}"
            )


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("case", GLOO_CASES)
def test_gloo_cuda_roundtrip(gloo, case, blocking):
    _, out = gloo().run(roundtrip, args=(case, blocking), timeout=RUN_TIMEOUT)
    _check_roundtrip(out, case, blocking, "gloo")


@nccl_mark
@pytest.mark.nccl
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("case", NCCL_CASES)
def test_nccl_roundtrip(nccl, case, blocking):
    _, out = nccl().run(roundtrip, args=(case, blocking), timeout=RUN_TIMEOUT)
    _check_roundtrip(out, case, blocking, "nccl")


STANDALONE_IDS = {
    "per-leaf-cudarecv_cuda-to-cudarecv_cuda",
    "consolidated-cudarecv_cuda-to-cudarecv_cuda",
    "consolidated-cudarecv_cuda-to-cudarecv_pinned",
    "buckets-1048576-cudarecv_cuda-to-cudarecv_cuda",
    "chunks-4096-cudarecv_cuda-to-cudarecv_cuda",
}
STANDALONE_CASES = [p for p in NCCL_CASES if p.id in STANDALONE_IDS]
assert len(STANDALONE_CASES) == len(STANDALONE_IDS), (
    "a standalone case id no longer matches NCCL_CASES"
)


@nccl_mark
@pytest.mark.nccl
@pytest.mark.parametrize("case", STANDALONE_CASES)
def test_nccl_standalone_group(nccl, case):
    """A ProcessGroupNCCL built on a store, never registered: group + group_src/group_dst."""
    _, out = nccl().run(roundtrip, args=(case, True), timeout=RUN_TIMEOUT, standalone=True)
    _check_roundtrip(out, case, True, "nccl")


def mismatch_then_ok(rank, world, group, place, consolidated):
    """A fast-wire mismatch raises HeaderError, leaves the tensordict untouched; the next transfer works."""
    peer = _peer(rank, group)
    good = _make("nested", 3.0 if rank == 0 else 0.0)
    if consolidated:
        bad = _make("flat", 3.0)  # another layout
    else:
        bad = good.clone()
        bad["b"] = torch.zeros(6)  # another shape and byte count
    good, bad = _place(good, place, consolidated), _place(bad, place, consolidated)
    if rank == 0:
        cudarecv.send(bad, **peer, bucket_bytes=16, consolidated=consolidated)
        cudarecv.send(good, **peer, bucket_bytes=16, consolidated=consolidated)
        _finish()
        return None
    before = [t.cpu().clone() for t in leaves(good)]
    try:
        cudarecv.recv(good, **peer, bucket_bytes=32, consolidated=consolidated)
    except cudarecv.HeaderError as error:
        message = str(error)
    else:
        message = None
    untouched = all(torch.equal(a.cpu(), b) for a, b in zip(leaves(good), before))
    cudarecv.recv(good, **peer, bucket_bytes=32, consolidated=consolidated)
    next_ok = _equal(good, _make("nested", 3.0))
    _finish()
    return message, untouched, next_ok


def _check_mismatch(result) -> None:
    message, untouched, next_ok = result
    assert message is not None, "a mismatched fast-wire transfer did not raise HeaderError"
    assert "drained" in message and "untouched" in message, message
    assert untouched, "the tensordict was written despite the mismatch"
    assert next_ok, "the next transfer on the same link failed"


@pytest.mark.parametrize("consolidated", [False, True], ids=["buckets", "chunks"])
def test_gloo_cuda_header_mismatch_then_next_transfer_works(gloo, consolidated):
    _, result = gloo().run(mismatch_then_ok, args=("cuda", consolidated), timeout=RUN_TIMEOUT)
    _check_mismatch(result)


@nccl_mark
@pytest.mark.nccl
@pytest.mark.parametrize(
    "consolidated,place",
    [(False, "cuda"), (False, "cpu"), (True, "cuda"), (True, "pinned")],
    ids=["buckets-cuda", "buckets-cpu", "chunks-cuda", "chunks-pinned"],
)
def test_nccl_header_mismatch_then_next_transfer_works(nccl, consolidated, place):
    _, result = nccl().run(mismatch_then_ok, args=(place, consolidated), timeout=RUN_TIMEOUT)
    _check_mismatch(result)


# --------------------------------------------------------------------------- streams and futures (gloo)


def explicit_stream(rank, world, group):
    """``stream=s`` runs the transfer on ``s``; without it, on the dedicated stream."""
    peer = _peer(rank, group)
    if rank == 0:
        for fill in (5.0, 6.0):
            cudarecv.send(_place(_make("nested", fill), "cuda", False), **peer)
        _finish()
        return None
    td = _place(_make("nested", 0.0), "cuda", False)
    s = torch.cuda.Stream()
    _sleep_on(s, 1.0)  # s is busy: a transfer on s lands after this
    [t] = cudarecv.irecv(td, **peer, stream=s, return_premature=True)
    t.wait(timeout=WAIT)
    on_s = {
        "stream_is_s": t._stream is s,
        "event_pending": not t.event.query(),
        "s_busy": not s.query(),
    }
    on_s["values"] = _equal(td, _make("nested", 5.0))  # the current stream waits for s
    _sleep_on(s, 1.0)
    [t2] = cudarecv.irecv(td, **peer, return_premature=True)
    t2.wait(timeout=WAIT)
    deadline = time.monotonic() + 0.5
    while not t2.event.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    dedicated = {
        "stream_is_dedicated": t2._stream is _cuda.dedicated_stream(_device()),
        "event_done": t2.event.query(),
        "s_busy": not s.query(),
    }
    dedicated["values"] = _equal(td, _make("nested", 6.0))
    _finish()
    return on_s, dedicated


def test_transfer_runs_on_the_given_stream(gloo):
    _, (on_s, dedicated) = gloo().run(explicit_stream, timeout=RUN_TIMEOUT)
    assert on_s["stream_is_s"], "irecv(stream=s) did not run on s"
    assert on_s["s_busy"] and on_s["event_pending"], (
        f"the transfer's event did not queue behind s: {on_s}"
    )
    assert on_s["values"]
    assert dedicated["stream_is_dedicated"], (
        "without stream=..., the transfer is not on the dedicated stream"
    )
    assert dedicated["s_busy"] and dedicated["event_done"], (
        f"the default transfer waited for s: {dedicated}"
    )
    assert dedicated["values"]


FUTURE_MODES = {
    # mode: (consolidated, bucket_bytes, at most two messages: the host never waits for a copy)
    "per-leaf": (False, None, True),
    "consolidated": (True, None, True),
    "buckets": (False, MiB, True),
    "chunks": (True, 256 * KiB, False),
}


def future_semantics(rank, world, group, mode):
    """irecv(return_premature=True): a Future whose wait() orders the current stream, not the host."""
    consolidated, bucket_bytes, short = FUTURE_MODES[mode]
    opts = _options(consolidated, bucket_bytes)
    peer = _peer(rank, group)
    structure = "big"
    if rank == 0:
        for fill in (5.0, 6.0):
            cudarecv.send(_place(_make(structure, fill), "cuda", consolidated), **peer, **opts)
        _finish()
        return None
    td = _place(_make(structure, 0.0), "cuda", consolidated)
    cudarecv.recv(td, **peer, **opts)  # warm-up: plan, staging, streams
    facts = {"warm_values": _equal(td, _make(structure, 5.0))}
    _sleep_on(_cuda.dedicated_stream(_device()), 0.5)  # the transfer's copies queue behind this
    futures = cudarecv.irecv(td, **peer, return_premature=True, **opts)
    facts["list_of_one"] = isinstance(futures, list) and len(futures) == 1
    [t] = futures
    facts["is_future"] = isinstance(t, torch.futures.Future) and isinstance(t, cudarecv.Transfer)
    got = t.wait(timeout=WAIT)
    facts["event_pending_after_wait"] = not t.event.query()
    facts["returns_td"] = got is td and t.value() is td and t.done()
    facts["event_is_cuda_event"] = isinstance(t.event, torch.cuda.Event)
    # kernels on the current stream, no host sync in between: they must see the new values
    sums = torch.stack([x.double().sum() for x in leaves(td)]).cpu()
    expected = torch.stack([x.double().sum() for x in leaves(_make(structure, 6.0))])
    facts["sums_new"] = torch.equal(sums, expected)
    facts["short"] = short
    _finish()
    return facts


@pytest.mark.parametrize("mode", list(FUTURE_MODES))
def test_irecv_future_orders_the_current_stream(gloo, mode):
    _, facts = gloo().run(future_semantics, args=(mode,), timeout=RUN_TIMEOUT)
    assert facts["warm_values"]
    assert facts["list_of_one"] and facts["is_future"], facts
    assert facts["returns_td"], "Transfer.wait() did not return the tensordict"
    assert facts["event_is_cuda_event"], "Transfer.event is not a torch.cuda.Event"
    assert facts["sums_new"], "a kernel on the current stream after wait() read stale values"
    if facts["short"]:
        assert facts["event_pending_after_wait"], "wait() blocked the host until the GPU finished"


def pending_receive(rank, world, group, mode, delay):
    """While a receive is pending (the sender waits ``delay`` s), the caller's stream keeps running."""
    consolidated, bucket_bytes = {"consolidated": (True, None), "chunks": (True, MiB)}[mode]
    opts = _options(consolidated, bucket_bytes)
    peer = _peer(rank, group)
    nbytes = 64 * MiB
    shape = dict(batch_size=[])

    def td_of(fill):
        return TensorDict(
            {f"k{i}": torch.full((nbytes // 16,), fill + i) for i in range(4)}, **shape
        )

    if rank == 0:
        for fill in (1.0, 2.0):
            sent = _place(td_of(fill), "cuda", True)
            torch.cuda.synchronize()
            if fill == 2.0:
                time.sleep(delay)
            cudarecv.send(sent, **peer, **opts)
        _finish()
        return None
    td = _place(td_of(0.0), "cuda", True)
    cudarecv.recv(td, **peer, **opts)  # warm-up, also NCCL's communicator
    dedicated = _cuda.dedicated_stream(_device())
    x = torch.randn(1024, 1024, device=_device())
    x @ x  # cuBLAS's first use in the process (its handle and workspace) is not what is timed
    torch.cuda.synchronize()
    _sleep_on(dedicated, 1.0)  # the transfer's own stream is busy too
    t0 = time.monotonic()
    [t] = cudarecv.irecv(td, **peer, return_premature=True, **opts)
    call_s = time.monotonic() - t0
    y = x @ x  # work on the caller's current stream
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    since_call = time.monotonic() - t0
    pending = not t.done() if t.event is None else not t.event.query()
    facts = {
        "call_s": call_s,
        "since_call": since_call,
        "pending": pending,
        "dedicated_busy": not dedicated.query(),
        "y_finite": bool(torch.isfinite(y).all()),
    }
    t.wait(timeout=WAIT + delay)
    facts["values"] = _equal(td, td_of(2.0))
    _finish()
    return facts


def _check_pending(facts, delay) -> None:
    assert facts["call_s"] < 1.0, f"irecv(return_premature=True) blocked {facts['call_s']:.2f} s"
    assert facts["since_call"] < min(1.0, delay / 2), (
        f"work on the current stream finished {facts['since_call']:.2f} s after the call: "
        "it waited for the pending receive"
    )
    assert facts["pending"], "the receive was done before the sender sent: the test proves nothing"
    assert facts["y_finite"] and facts["values"]


@pytest.mark.parametrize("mode", ["consolidated", "chunks"])
def test_pending_receive_does_not_block_the_current_stream(gloo, mode):
    delay = 3.0
    _, facts = gloo().run(pending_receive, args=(mode, delay), timeout=RUN_TIMEOUT)
    _check_pending(facts, delay)


@nccl_mark
@pytest.mark.nccl
@pytest.mark.parametrize("mode", ["consolidated", "chunks"])
def test_nccl_pending_receive_does_not_block_the_current_stream(nccl, mode):
    delay = 3.0
    _, facts = nccl().run(pending_receive, args=(mode, delay), timeout=RUN_TIMEOUT)
    _check_pending(facts, delay)


# --------------------------------------------------------------------------- staging: reuse and safety


WARMUP_LIMIT = 12  # transfers a fresh link may take to settle on its transport (a declined offer waits 1, 2, 4)
STAGING_MODES = {
    # mode: (consolidated, bucket_bytes, send place, receive place)
    "gloo-consolidated": (True, None, "cuda", "cuda"),
    "gloo-chunks": (True, 64 * KiB, "cuda", "cuda"),
    "gloo-per-leaf": (False, None, "cuda", "cuda"),
    "gloo-buckets": (False, 64 * KiB, "cuda", "cuda"),
    "nccl-consolidated-to-pinned": (True, None, "cuda", "pinned"),
    "nccl-chunks-to-pinned": (True, 64 * KiB, "cuda", "pinned"),
    "nccl-pinned-to-cuda": (True, None, "pinned", "cuda"),
    "nccl-per-leaf-to-cpu": (False, None, "cuda", "cpu"),
    "nccl-buckets-to-cpu": (False, 64 * KiB, "cuda", "cpu"),
}


def staging_reuse(rank, world, group, mode, count):
    """After a warm-up, ``count`` transfers allocate no staging and no device memory, on both ends."""
    from cudarecv.plan.plan import plan_for

    consolidated, bucket_bytes, send_place, recv_place = STAGING_MODES[mode]
    opts = _options(consolidated, bucket_bytes)
    peer = _peer(rank, group)
    structure = "big"
    place = send_place if rank == 0 else recv_place
    td = _place(_make(structure, 0.0), place, consolidated)

    def once(step) -> str:
        if rank == 0:
            for dst, src in zip(leaves(td), leaves(_make(structure, 10.0 + step))):
                dst.copy_(src)
            works = cudarecv.isend(td, **peer, **opts, return_early=True)
        else:
            works = cudarecv.irecv(td, **peer, **opts, return_premature=True)
        for work in works:
            work.wait(WAIT)
        return ",".join(
            sorted({getattr(work, "transport", "wire") for work in works})
        )  # per leaf: torch's works

    def snapshot():
        torch.cuda.synchronize()
        plan = plan_for(unwrap(td))
        return {
            "pool": plan.pool.allocations,
            "device_bytes": torch.cuda.memory_allocated(),
            "plan": id(plan),
            "staging": {k: v.data_ptr() for k, v in plan._staging.items()},
        }

    # warm up until the link settled on its transport: a fresh link may start on the wire and take CUDA IPC
    # once its offer is accepted, and a segment's staging comes with its first use (double buffered: a
    # transfer takes segment n % 2). Settled: the last three transfers carried alike, as both ranks see it
    # (agreed through the group, so that both make the same number of transfers)
    carried = [once(0), once(1), once(2)]
    agree = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    while len(carried) < WARMUP_LIMIT:
        settled = torch.tensor([int(len(set(carried[-3:])) == 1)], device=agree)
        dist.all_reduce(settled, op=dist.ReduceOp.MIN, group=group)
        if settled.item():
            break
        carried.append(once(len(carried)))
    warm = len(carried)
    before = snapshot()
    peaks = []
    for step in range(warm, warm + count):
        carried.append(once(step))
        peaks.append(snapshot()["device_bytes"])
    after = snapshot()
    ok = rank == 0 or _equal(td, _make(structure, 10.0 + warm + count - 1))
    _finish()
    return {
        "before": before,
        "after": after,
        "device_bytes": peaks,
        "values": ok,
        "carried": carried,
        "warm": warm,
    }


def _check_staging(results) -> None:
    for rank, r in enumerate(results):
        before, after = r["before"], r["after"]
        measured = r["carried"][r["warm"] - 1 :]
        assert len(set(measured)) == 1, (
            f"rank {rank}: the transport changed after the warm-up: {r['carried']}"
        )
        assert r["values"], f"rank {rank}: wrong values after the transfers"
        assert after["pool"] == before["pool"], (
            f"rank {rank}: staging pool grew {before['pool']} -> {after['pool']}"
        )
        assert after["plan"] == before["plan"], f"rank {rank}: the plan was rebuilt"
        assert after["staging"] == before["staging"], (
            f"rank {rank}: the plan's staging buffers changed"
        )
        grown = max(r["device_bytes"]) - before["device_bytes"]
        assert grown <= MEMORY_SLACK, (
            f"rank {rank}: device memory grew by {grown} bytes over the transfers"
        )


@pytest.mark.parametrize("mode", [m for m in STAGING_MODES if m.startswith("gloo")])
def test_gloo_staging_is_reused(gloo, mode):
    _check_staging(gloo().run(staging_reuse, args=(mode, 5), timeout=RUN_TIMEOUT))


@nccl_mark
@pytest.mark.nccl
@pytest.mark.parametrize("mode", [m for m in STAGING_MODES if m.startswith("nccl")])
def test_nccl_staging_is_reused(nccl, mode):
    _check_staging(nccl().run(staging_reuse, args=(mode, 5), timeout=RUN_TIMEOUT))


B2B_MODES = {
    # mode: (consolidated, bucket_bytes or "half": two chunks of half the storage)
    "consolidated": (True, None),
    "chunks": (True, "half"),
    "per-leaf": (False, None),
    "buckets": (False, MiB),
}


def _b2b_td(fill: float) -> TensorDict:
    return TensorDict(
        x=torch.full((1 << 16,), fill), y=torch.full((1 << 14,), -fill), batch_size=[]
    )


def back_to_back(rank, world, group, mode, count, send_place, recv_place, receiver_lags):
    """``count`` transfers in a row, each with new values; each is snapshotted on the GPU right after.

    A staging buffer reused by transfer k+1 while transfer k's copy out of it is
    still queued (here: behind work on the caller's stream, or behind a send
    waiting for its receiver) would put k+1's values in snapshot k.
    """
    consolidated, bucket_bytes = B2B_MODES[mode]
    peer = _peer(rank, group)
    td = _place(_b2b_td(0.0), send_place if rank == 0 else recv_place, consolidated)
    if bucket_bytes == "half":
        storage = unwrap(td)._consolidated["storage"]
        bucket_bytes = (storage.numel() + 1) // 2
    opts = _options(consolidated, bucket_bytes)
    if rank == 0:
        for k in range(count):
            for dst, src in zip(leaves(td), leaves(_b2b_td(10.0 + k))):
                dst.copy_(src)  # the source is rewritten as soon as send() returns
            cudarecv.send(td, **peer, **opts)
        _finish()
        return None
    snaps = []
    for _ in range(count):
        if receiver_lags:
            time.sleep(0.3)  # the sender's transfers queue up behind this receiver
        else:
            _sleep_on(torch.cuda.current_stream(), 0.25)  # the caller's stream is busy
        [t] = cudarecv.irecv(td, **peer, return_premature=True, **opts)
        t.wait(timeout=WAIT)
        snaps.append([x.clone() for x in leaves(td)])  # on the current stream, after the transfer
    _finish()
    bad = []
    for k, snap in enumerate(snaps):
        want = leaves(_b2b_td(10.0 + k))
        if not all(torch.equal(a.cpu(), b) for a, b in zip(snap, want)):
            bad.append((k, [float(a.flatten()[0]) for a in snap]))
    return bad


@pytest.mark.parametrize("mode", list(B2B_MODES))
def test_gloo_back_to_back_receives_into_cuda_keep_each_value(gloo, mode):
    """The caller's stream is busy, so each transfer's host-to-device copies wait; the pinned
    staging must not be refilled by the next transfer before they ran."""
    _, bad = gloo().run(back_to_back, args=(mode, 4, "cpu", "cuda", False), timeout=RUN_TIMEOUT)
    assert not bad, f"snapshots (transfer, first values) holding another transfer's values: {bad}"


@nccl_mark
@pytest.mark.nccl
@pytest.mark.parametrize("mode", ["consolidated", "chunks"])
def test_nccl_back_to_back_sends_from_host_keep_each_value(nccl, mode):
    """Sends from pinned host memory go through a ring of device buffers; a send waiting for its
    receiver must not see its buffer refilled by the next send (nor by the caller's next write)."""
    _, bad = nccl().run(back_to_back, args=(mode, 4, "pinned", "cuda", True), timeout=RUN_TIMEOUT)
    assert not bad, f"snapshots (transfer, first values) holding another transfer's values: {bad}"


# --------------------------------------------------------------------------- NCCL with a stock peer


def nccl_stock_peer(rank, world, group, sender, receiver):
    os.environ["CUDARECV_NCCL_BATCH"] = "0"  # one op per leaf, on stock's two-rank communicator
    peer = _peer(rank, group)
    out = {}
    for structure in ("flat", "nested", "big"):
        for step in range(2):
            td = _place(_make(structure, 5.0 + step if rank == 0 else 0.0), "cuda", False)
            if rank == 0:
                _call(sender, "send", td, **peer)
                continue
            _call(receiver, "recv", td, **peer)
            out[(structure, step)] = _equal(td, _make(structure, 5.0 + step))
    _finish()
    del os.environ["CUDARECV_NCCL_BATCH"]
    return out


@nccl_mark
@pytest.mark.nccl
@pytest.mark.parametrize(
    "sender,receiver", [("stock", C), (C, "stock")], ids=["stock-to-cudarecv", "cudarecv-to-stock"]
)
def test_nccl_per_leaf_with_a_stock_peer(nccl, sender, receiver):
    """Stock sends each CUDA leaf with its own dist.isend (PyTorch's two-rank communicator);
    with CUDARECV_NCCL_BATCH=0 cudarecv does the same (a mismatch hangs: bounded here)."""
    _, out = nccl().run(nccl_stock_peer, args=(sender, receiver), timeout=30)
    bad = [k for k, ok in out.items() if not ok]
    assert out and not bad, f"wrong values for (structure, step) {bad}"


# --------------------------------------------------------------------------- weight sync on GPUs


def weight_sync_on_gpu(rank, world, group, receiver_device, pulls, standalone, verify):
    """Trainer weights on this rank's GPU; the receiver keeps them on ``receiver_device``.

    Returns, in the receiver, the versions, whether each landed version holds the pushed
    values, and device memory / staging allocations before and after the steady pulls."""
    import cudarecv as cr

    device = _device()
    weights = TensorDict(w=torch.zeros(1 << 20, device=device), b=torch.zeros(1000, device=device))
    peer = (
        ({"group": group, "group_dst": 1} if rank == 0 else {"group": group, "group_src": 0})
        if standalone
        else ({"dst": 1} if rank == 0 else {"src": 0})
    )
    if rank == 0:
        with cr.WeightSender(
            weights, **peer, bucket_bytes=1 << 18, timeout=WAIT, verify=verify
        ) as sender:
            for version in range(1, pulls + 1):
                weights.apply_(lambda t, v=version: t.fill_(float(v)))
                sender.push()
        return None
    where = device if receiver_device == "cuda" else "cpu"
    receiver = cr.WeightReceiver(
        **peer, device=where, pin_memory=receiver_device == "pinned", timeout=WAIT
    )
    seen, before = [], None
    for version in range(1, pulls + 1):
        got = receiver.pull()
        with receiver.reading() as td:
            seen.append(
                (got, bool((td["w"] == float(version)).all() and (td["b"] == float(version)).all()))
            )
        if version == 3:
            torch.cuda.synchronize()
            before = (torch.cuda.memory_allocated(), receiver._lane.pool.allocations)
    torch.cuda.synchronize()
    after = (torch.cuda.memory_allocated(), receiver._lane.pool.allocations)
    receiver.close()
    return seen, before, after


def _check_weight_sync(result, pulls) -> None:
    seen, before, after = result
    assert [v for v, _ in seen] == list(range(1, pulls + 1))
    assert all(ok for _, ok in seen), "a pulled version held other values"
    assert after[1] == before[1], "staging buffers were allocated in steady state"
    assert abs(after[0] - before[0]) <= MEMORY_SLACK, (
        f"device memory moved by {after[0] - before[0]} bytes"
    )


@pytest.mark.parametrize("receiver_device", ["cuda", "pinned", "cpu"])
def test_gloo_weight_sync_into_gpu_or_pinned_memory_is_flat(gloo, receiver_device):
    pulls = 40
    _, result = gloo().run(
        weight_sync_on_gpu, args=(receiver_device, pulls, False, True), timeout=RUN_TIMEOUT
    )
    _check_weight_sync(result, pulls)


@nccl_mark
@pytest.mark.nccl
@pytest.mark.parametrize("standalone", [False, True], ids=["default_group", "standalone_group"])
@pytest.mark.parametrize("receiver_device", ["cuda", "pinned"])
def test_nccl_weight_sync(nccl, receiver_device, standalone):
    pulls = 40
    _, result = nccl().run(
        weight_sync_on_gpu,
        args=(receiver_device, pulls, standalone, True),
        standalone=standalone,
        timeout=RUN_TIMEOUT,
    )
    _check_weight_sync(result, pulls)


# --------------------------------------------------------------------------- relay fan-out on GPUs

RELAY_GPUS = 1  # as NCCL_GPUS


@pytest.fixture(scope="module")
def gloo3():
    """Three gloo ranks with their CUDA tensors on GPU 0 (relay through staged memory)."""
    ranks = Ranks(3, pg_timeout=PG_TIMEOUT)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def nccl3():
    """Three NCCL ranks (a GPU each, or all on GPU 0: see the module docstring)."""
    yield from _nccl(3)


def relay_on_gpu(rank, world, group, receiver_device, pushes):
    """Trainer 0 relays GPU weights through the chain 1 -> 2; each receiver checks every version."""
    import cudarecv as cr

    device = _device()
    weights = TensorDict(w=torch.zeros(1 << 20, device=device), b=torch.zeros(1000, device=device))
    if rank == 0:
        with cr.WeightSender(
            weights, dst=[1, 2], fanout="relay", bucket_bytes=1 << 18, timeout=WAIT, verify=True
        ) as sender:
            for version in range(1, pushes + 1):
                weights.apply_(lambda t, v=version: t.fill_(float(v)))
                sender.push()
            return sender.fanout
    where = device if receiver_device == "cuda" else "cpu"
    with cr.WeightReceiver(
        src=0, device=where, pin_memory=receiver_device == "pinned", timeout=WAIT
    ) as receiver:
        seen = []
        for version in range(1, pushes + 1):
            got = receiver.pull()
            with receiver.reading() as td:
                seen.append(
                    (
                        got,
                        bool(
                            (td["w"] == float(version)).all() and (td["b"] == float(version)).all()
                        ),
                    )
                )
        return seen


def _check_relay(results, pushes) -> None:
    assert results[0] == "relay"
    for seen in results[1:]:
        assert [v for v, _ in seen] == list(range(1, pushes + 1))
        assert all(ok for _, ok in seen), "a relayed version held other values"


@pytest.mark.parametrize("receiver_device", ["cuda", "pinned"])
def test_gloo_relay_of_gpu_weights(gloo3, receiver_device):
    _check_relay(gloo3().run(relay_on_gpu, args=(receiver_device, 20), timeout=RUN_TIMEOUT), 20)


@pytest.mark.gpus(RELAY_GPUS)
@pytest.mark.nccl
@pytest.mark.parametrize("receiver_device", ["cuda", "pinned"])
def test_nccl_relay(nccl3, receiver_device):
    """The relay over NCCL point-to-point: each hop forwards chunk i on its own stream while chunk
    i + 1 arrives; every receiver verifies (BLAKE3 on the GPU) what it publishes."""
    _check_relay(nccl3().run(relay_on_gpu, args=(receiver_device, 20), timeout=RUN_TIMEOUT), 20)


# --------------------------------------------------------------------------- CUDA IPC (same-host transport)


@contextlib.contextmanager
def _ipc_gpu(rank: int, gpus: str):
    """Both ranks on GPU 0 (colocated), or rank r on GPU r (peer GPUs of one node), as the current device;
    the ranks' device is GPU 0 again afterwards (where the other tests put their tensors)."""
    index = rank if gpus == "two_gpus" else 0
    with torch.cuda.device(index):
        yield torch.device("cuda", index)


def _memory(device: torch.device) -> tuple[int, int]:
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def ipc_weight_sync(rank, world, group, gpus, syncs):
    """GPU weights to a GPU receiver through CUDA IPC: exported once, opened once; every version exact and
    neither end's device memory growing over ``syncs`` syncs."""
    with _ipc_gpu(rank, gpus) as device:
        return _ipc_weight_sync(rank, device, syncs)


def _ipc_weight_sync(rank, device, syncs):
    import cudarecv as cr

    weights = TensorDict(w=torch.zeros(1 << 20, device=device), b=torch.zeros(1000, device=device))
    memory = []
    if rank == 0:
        with cr.WeightSender(weights, dst=1, timeout=WAIT) as sender:
            transports = sender.transports
            for version in range(1, syncs + 1):
                weights.apply_(lambda t, v=version: t.fill_(float(v)))
                sender.push()
                if version in (10, syncs):
                    memory.append(_memory(device))
        return transports, memory
    with cr.WeightReceiver(src=0, device=device, timeout=WAIT) as receiver:
        exact = True
        for version in range(1, syncs + 1):
            got = receiver.pull()
            with receiver.reading() as td:
                exact &= got == version and bool(
                    (td["w"] == version).all() and (td["b"] == version).all()
                )
            if version in (10, syncs):
                memory.append(_memory(device))
        return receiver.transport, exact, memory


def ipc_fast_wire(rank, world, group, gpus, transfers, consolidated):
    """CUDA tensordicts on the fast wire over gloo: through CUDA IPC once negotiated, values exact, memory flat."""
    with _ipc_gpu(rank, gpus) as device:
        return _ipc_fast_wire(rank, device, transfers, consolidated)


def _ipc_fast_wire(rank, device, transfers, consolidated):
    td = TensorDict(a=torch.zeros(300_000, device=device), b=torch.zeros(77, device=device))
    if consolidated:
        td = td.consolidate(metadata=True)
    routes, exact, memory = [], True, []
    for step in range(1, transfers + 1):
        if rank == 0:
            td["a"].fill_(step)
            td["b"].fill_(-step)
            [t] = cudarecv.isend(
                td, 1, bucket_bytes=1 << 18, consolidated=consolidated, return_early=True
            )
        else:
            [t] = cudarecv.irecv(
                td, 0, bucket_bytes=1 << 18, consolidated=consolidated, return_premature=True
            )
        t.wait(WAIT)
        routes.append(t.transport)
        if rank == 1:
            exact &= bool((td["a"] == step).all() and (td["b"] == -step).all())
        if step in (10, transfers):
            memory.append(_memory(device))
    return routes, exact, memory


IPC_GPUS = [
    pytest.param("one_gpu", id="one_gpu_two_processes"),
    pytest.param("two_gpus", id="two_gpus", marks=pytest.mark.gpus(2)),
]


@pytest.mark.parametrize("gpus", IPC_GPUS)
def test_cuda_ipc_weight_sync_exact_and_memory_flat(gloo, gpus):
    (transports, sent_memory), (transport, exact, received_memory) = gloo().run(
        ipc_weight_sync, args=(gpus, 200), timeout=RUN_TIMEOUT
    )
    assert transports == {1: "cuda ipc"} and transport == "cuda ipc"
    assert exact, "a version arrived with other values"
    for early, late in (sent_memory, received_memory):
        # flat or less (a temporary of the first syncs may be freed later): never more
        assert all(b <= a for a, b in zip(early, late)), (
            f"device memory (allocated, reserved) grew over 190 syncs: {early} -> {late}"
        )


@pytest.mark.parametrize("consolidated", [False, True], ids=["buckets", "chunks"])
@pytest.mark.parametrize("gpus", IPC_GPUS)
def test_cuda_ipc_fast_wire_exact_and_memory_flat(gloo, gpus, consolidated):
    (routes, _, sent_memory), (received, exact, received_memory) = gloo().run(
        ipc_fast_wire, args=(gpus, 200, consolidated), timeout=RUN_TIMEOUT
    )
    assert routes == received and set(routes[1:]) == {"cuda ipc"}, routes[:5]
    assert exact
    for early, late in (sent_memory, received_memory):
        assert late[0] - early[0] <= MEMORY_SLACK and late[1] == early[1], (
            f"device memory grew: {early} -> {late}"
        )


def ipc_weights_and_transfers(rank, world, group, gpus, key):
    """tests/held.py's lifecycle run on GPU tensors (CUDA IPC carries them): three of four receives refused."""
    with _ipc_gpu(rank, gpus):
        return weights_and_transfers(rank, world, group, "auto", 3, key, device="cuda")


def ipc_many_transfers(rank, world, group, gpus, key):
    with _ipc_gpu(rank, gpus):
        return many_transfers(rank, world, group, "auto", key, device="cuda")


@pytest.mark.parametrize("gpus", IPC_GPUS)
def test_cuda_ipc_nothing_outlives_close_and_destroy(gloo, gpus):
    """Weight sync (sync, latest) and fast-wire transfers through CUDA IPC, three refused, then close, destroy
    and collect: no thread of cudarecv's left, the tensordicts (and the device memory they hold, with the
    other end's IPC mappings of it) and the group let go."""
    (
        (_, _, _, sender, sender_alive, sent),
        (refused, exact, links, receiver, receiver_alive, carried),
    ) = gloo().run(
        ipc_weights_and_transfers, args=(gpus, unique_key("ipc_outlive")), timeout=RUN_TIMEOUT
    )
    assert sent == ["cuda ipc"] * 2 and carried == ["cuda ipc"] * 3, (sent, carried)
    assert refused == 3 and exact
    assert [name.split("#")[0] for name in links] == ["cudarecv-recv-0"], (
        links
    )  # one per link, not per failure
    left = (sender, receiver, sender_alive, receiver_alive)
    assert left == ([], [], [False] * 4, [False] * 4), (
        left
    )  # (threads; weights, good, wrong, group)


@pytest.mark.parametrize("gpus", IPC_GPUS)
def test_cuda_ipc_many_transfers_with_refusals_keep_resources_flat(gloo, gpus):
    results = gloo().run(ipc_many_transfers, args=(gpus, unique_key("ipc_many")), timeout=300)
    assert results[1][0] == 250
    for rank, (_, early, late) in enumerate(results):
        assert early[:4] == late[:4], (
            f"rank {rank}: (cudarecv threads, threads, descriptors, shared mappings) "
            f"{early[:4]} after 20, {late[:4]} after 1000"
        )
        assert late[4] - early[4] <= MEMORY_SLACK and late[5] == early[5], (
            f"rank {rank}: device memory (allocated, reserved) grew: {early[4:]} -> {late[4:]}"
        )
