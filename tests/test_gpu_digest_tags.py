"""GPU tests of issue 47, items 8 and 9: the device digest (bounded temporaries, one host wait per version, its
kernels compiled before the first pull), the tag kernel's stream, and control messages' device bytes.

Marked ``gpus(1)`` and skipped without CUDA (as tests/test_gpu.py); run on a GPU machine with::

    pytest --gpus 1 tests/test_gpu_digest_tags.py
"""

from __future__ import annotations

import blake3
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from cudarecv.testing.launch import Ranks

HAS_CUDA = torch.cuda.is_available()
PG_TIMEOUT = 60.0
RUN_TIMEOUT = 120.0
WAIT = 60.0
SLEEP_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second of one SM's clock

pytestmark = [
    pytest.mark.gpus(1),
    pytest.mark.skipif(
        not HAS_CUDA,
        reason="torch.cuda.is_available() is False: needs a CUDA build of torch and a visible GPU",
    ),
]


def _cupy_or_skip():
    from cudarecv.cuda import kernels

    if not kernels.gpu_available():
        pytest.skip("cupy is not installed or sees no GPU (pip install 'cudarecv[gpu]')")


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("max_runs", [None, 1000, 3])
@pytest.mark.parametrize(
    "n", [0, 1, 1024, 1025, 5000, 1 << 17, (1 << 17) + 1, 1 << 20, (1 << 25) + 7]
)
def test_device_digest_is_blake3(monkeypatch, n, max_runs):
    """One block or several, a thread a chunk or (fewer threads allowed: past 4 GiB by default) a run of them:
    the same BLAKE3 as the host's."""
    _cupy_or_skip()
    from cudarecv.cuda import digest as d

    if max_runs is not None:
        monkeypatch.setattr(d, "MAX_RUNS", max_runs)
    host = _random(n, n)
    assert d.digest(host.cuda()) == blake3.blake3(host.numpy().tobytes()).digest(16), d.plan(
        n, d.MAX_RUNS
    )


def test_digest_parts_on_the_device_waits_once():
    """(Issue 47, item 8: each message's digest was followed by ``.cpu()``: one host sync per message.) 64 messages
    on the device: launched without a host sync (torch's sync debug mode set to raise), their results copied
    back at once, one event; the same digest as the host's."""
    _cupy_or_skip()
    from cudarecv.cuda import digest as d

    parts = [_random(4096 * i + 13, i).cuda() for i in range(64)]
    want = blake3.blake3(
        b"".join(blake3.blake3(p.cpu().numpy().tobytes()).digest(16) for p in parts)
    ).digest(16)
    d.prepare(parts[0].device)
    torch.cuda.synchronize()
    cpu_calls = []
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        cpu_calls.append(self.numel())
        return real_cpu(self, *args, **kwargs)

    torch.Tensor.cpu = counting_cpu  # type: ignore[method-assign]
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = d.digest_parts_pending(parts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.Tensor.cpu = real_cpu  # type: ignore[method-assign]
    assert cpu_calls == [], cpu_calls
    assert pending.work.wait()
    assert pending.value() == want
    assert d.digest_parts(parts) == want


def test_digest_temporaries_are_bounded():
    """(Issue 47, item 8: two levels of chaining values, 48 bytes per KiB hashed: 12 MiB for 256 MiB.) The peak
    of device memory while hashing 256 MiB is the workspace of its 2048 blocks (96 KiB) and the result."""
    _cupy_or_skip()
    from cudarecv.cuda.digest import digest, prepare, workspace_bytes

    storage = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device="cuda")
    prepare(storage.device)
    digest(storage[: 1 << 20])  # (the allocator's first blocks)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = digest(storage)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert workspace_bytes(256 << 20) == 96 << 10
    assert extra <= (96 << 10) + 4096, extra  # (the allocator rounds each block up to 512 bytes)
    assert got == blake3.blake3(storage.cpu().numpy().tobytes()).digest(16)


def test_the_tag_kernel_does_not_wait_for_the_default_stream():
    """(Issue 47, item 9: the tag kernel ran on cupy's default, CUDA's legacy default stream, behind whatever the
    caller queued on torch's default stream.) With a second of work queued there, the map comes back before it
    has run."""
    _cupy_or_skip()
    from cudarecv.cuda import tag_kernel
    from cudarecv.plan.tags import int_generator_many

    tag_kernel.tag_map_gpu()  # (compiled, loaded, its memory allocated: nothing that may wait for the device)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # on torch's current stream: the default one
    got = tag_kernel.tag_map_gpu()
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy, "the tag map waited for the work queued on torch's default stream"
    assert (got == int_generator_many(np.arange(10_001, dtype=np.uint64))).all()


def test_control_bytes_are_not_handed_to_the_callers_stream():
    """(Issue 47, item 9: wire_bytes allocated on the caller's stream and wrote on the transfer stream; once
    dropped, its block went to the caller's next tensor while the copy was still queued, and the copy then wrote
    the header over that tensor.) With the transfer stream held back, the caller's new tensors keep their
    bytes."""
    from cudarecv.core.link import Link
    from cudarecv.wire.control import wire_bytes
    from cudarecv.wire.staging import Lane

    transfer = torch.cuda.Stream()
    lane = Lane(Link(None, 1, False, "nccl"), transfer)  # type: ignore[arg-type]  # (no group: nothing posted)
    # (first the allocations that may wait for the device: the page-locked and device blocks, cached after)
    wire_bytes(lane, b"\x00" * 200)
    warm = [torch.full((200,), 0xFF, dtype=torch.uint8, device="cuda") for _ in range(8)]
    del warm
    torch.cuda.synchronize()
    with torch.cuda.stream(transfer):
        torch.cuda._sleep(SLEEP_CYCLES)  # the transfer stream's copy waits a second
    header = wire_bytes(lane, b"\x01" * 200)
    taken = header.data_ptr()
    # dropped as after its send: torch's NCCL group lets go of a posted tensor at the send's Work.wait(), which
    # orders the transfer stream, not the host (no group here: nothing is posted)
    del header
    mine = [torch.full((200,), 0xFF, dtype=torch.uint8, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    reused = [m.data_ptr() == taken for m in mine]
    assert all(bool((m == 0xFF).all()) for m in mine), (
        f"the header was written over a tensor of the caller's (block reused: {reused})"
    )


def verified_pulls(rank, world, group, pulls):
    """Rank 0 pushes GPU weights with ``verify=True``; rank 1 (a GPU receiver) counts the
    digest kernels' compiles (construction, each pull), the device launches and the host waits of each pull."""
    import cudarecv as cr
    from cudarecv.cuda import digest as d
    from cudarecv.cuda import kernels

    device = torch.device("cuda", torch.cuda.current_device())
    weights = TensorDict(
        {f"w{i}": torch.zeros(4096 + i, device=device) for i in range(32)}, batch_size=[]
    )
    if rank == 0:
        with cr.WeightSender(
            weights, dst=1, bucket_bytes=1 << 18, timeout=WAIT, verify=True
        ) as sender:
            for version in range(1, pulls + 1):
                weights.apply_(lambda t, v=version: t.fill_(float(v)))
                sender.push()
        return None
    launches, values = [], []
    launch_all, value = d._launch_all, d.Pending.value

    def counting_launch(parts, *args, **kwargs):
        launches.append(len(parts))
        return launch_all(parts, *args, **kwargs)

    def counting_value(self):
        values.append(1)
        return value(self)

    d._launch_all = counting_launch
    d.Pending.value = counting_value  # type: ignore[method-assign]
    before = kernels.loaded[("blake3.cu", device.index)]
    receiver = cr.WeightReceiver(src=0, device=device, timeout=WAIT)
    built = kernels.loaded[("blake3.cu", device.index)]
    per_pull, seen = [], []
    for version in range(1, pulls + 1):
        launches.clear(), values.clear()
        got = receiver.pull()
        per_pull.append((kernels.loaded[("blake3.cu", device.index)], list(launches), len(values)))
        with receiver.reading() as td:
            seen.append((got, all(bool((t == float(version)).all()) for t in td.values())))
    receiver.close()
    return before, built, per_pull, seen


def test_digest_kernels_are_compiled_before_the_first_pull():
    """(Issue 47, item 8: NVRTC compiled the digest kernels inside the first pull that checked a digest, within its
    timeout.) A GPU receiver builds them at construction; no pull builds them again; each pull launches every
    message's digest at once and reads one result."""
    _cupy_or_skip()
    ranks = Ranks(2, pg_timeout=PG_TIMEOUT)
    try:
        _, (before, built, per_pull, seen) = ranks.run(
            verified_pulls, args=(3,), timeout=RUN_TIMEOUT
        )
    finally:
        ranks.close()
    assert seen == [(1, True), (2, True), (3, True)], seen
    assert before == 0 and built == 1, (before, built)
    for loaded, launches, values in per_pull:
        assert loaded == 1, per_pull  # nothing compiled within a pull
        assert len(launches) == 1, per_pull  # every message's kernels queued in one go
        assert values == 1, per_pull
