"""Throughput of a stream of transfers: 2000 leaves x 8 KiB, back to back, over gloo loopback.

``bench_transfers.py`` times each transfer alone (a barrier before each); here each
mode moves the tensordict ``STREAM`` times in a row between two barriers, as a trainer
streaming updates does, so consecutive transfers overlap where the wire allows. Modes
alternate round by round in one pair of processes. Each bench's pytest-benchmark
rounds are its mode's rounds as the receiving rank measured them (stream time /
``STREAM``, i.e. seconds per transfer), replayed through a virtual clock
(``tb.VirtualClock``), so ``stats.median`` is the median over rounds. After the
timed rounds, one more stream per mode is checked value by value on the receiver
(``ok`` in ``extra_info``; a wrong one fails its bench).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.p2p.stock import Stock
from cudarecv.tools import transfer_ranks as tb

LEAVES, LEAF_BYTES, STREAM, ROUNDS = 2000, 8192, 8, 5
MODES = [
    ("stock", "per-leaf", None),
    ("cudarecv", "per-leaf", "per-leaf"),
    ("cudarecv", "buckets 1MiB", "per-leaf"),
    ("stock", "consolidated", None),
    ("cudarecv", "chunks 1MiB", "consolidated"),
    ("raw", "flat recv", None),
]

CLOCK = tb.VirtualClock("receiver_clock")
pytestmark = [pytest.mark.timeout(600), pytest.mark.benchmark(timer=CLOCK)]


def stream_times(rank: int, world: int, group, rounds: int) -> dict:
    """The receiver's seconds per transfer of each mode's streams, and each mode's check (None: right)."""
    td = TensorDict(
        {f"k{i:04d}": torch.full((LEAF_BYTES // 4,), float(rank)) for i in range(LEAVES)}
    )
    consolidated = td.consolidate(metadata=True)
    flat = torch.zeros(LEAVES * LEAF_BYTES, dtype=torch.uint8)
    peer = 1 - rank

    def once(impl: str, mode: str) -> None:
        send = rank == 0
        if impl == "raw":
            (dist.send if send else dist.recv)(flat, peer)
        elif impl == "stock":
            target = consolidated if mode == "consolidated" else td
            (Stock.isend if send else Stock.irecv)(
                target, peer, consolidated=mode == "consolidated"
            )
        elif mode == "per-leaf":
            (cudarecv.isend if send else cudarecv.irecv)(td, peer)
        elif mode.startswith("buckets"):
            (cudarecv.isend if send else cudarecv.irecv)(td, peer, bucket_bytes=1 << 20)
        else:
            (cudarecv.isend if send else cudarecv.irecv)(
                consolidated, peer, bucket_bytes=1 << 20, consolidated=True
            )

    def fill(value: float) -> None:
        td.apply_(lambda t: t.fill_(value))
        consolidated.apply_(lambda t: t.fill_(value))

    times: dict[str, list[float]] = {mode_id(impl, mode): [] for impl, mode, _ in MODES}
    for impl, mode, _ in MODES:  # warm-up: plans, staging, connections
        once(impl, mode)
    for r in range(rounds):
        for impl, mode, _ in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            if rank == 0:
                fill(float(r + 10))
            dist.barrier()
            start = time.perf_counter()
            for _ in range(STREAM):
                once(impl, mode)
            times[mode_id(impl, mode)].append((time.perf_counter() - start) / STREAM)

    checks: dict[str, str | None] = {}
    for k, (impl, mode, _) in enumerate(MODES):  # one checked stream per mode: a value of its own
        value = float(1000 + k)
        fill(value if rank == 0 else 0.0)
        flat.fill_(k + 1 if rank == 0 else 0)
        dist.barrier()
        for _ in range(STREAM):
            once(impl, mode)
        if rank == 1:
            if impl == "raw":
                right = bool((flat == k + 1).all())
            else:
                got = consolidated if "consolidated" in mode or mode.startswith("chunks") else td
                right = all(bool((t == value).all()) for t in got.values(True, True))
            checks[mode_id(impl, mode)] = (
                None if right else f"the receiver's values are not {value:g}"
            )
    return {"seconds": times, "checks": checks}


def mode_id(impl: str, mode: str) -> str:
    return f"{impl} {mode}"


_RESULT: dict[str, dict] = {}


@pytest.mark.parametrize("impl,mode,stock_mode", MODES, ids=[mode_id(i, m) for i, m, _ in MODES])
def test_stream_throughput(benchmark, transfer_cluster, transfer_targets, impl, mode, stock_mode):
    if not _RESULT:
        _RESULT.update(transfer_cluster.get().run(stream_times, args=(ROUNDS,), timeout=540)[1])
        med = {k: statistics.median(v) for k, v in _RESULT["seconds"].items()}
        transfer_targets.append(
            f"2000 x 8KiB stream: buckets 1MiB vs stock per-leaf: "
            f"{med['stock per-leaf'] / med['cudarecv buckets 1MiB']:.2f}x (target >= 4x), "
            f"per-leaf vs stock: {med['stock per-leaf'] / med['cudarecv per-leaf']:.2f}x"
        )
    problem = _RESULT["checks"][mode_id(impl, mode)]
    benchmark.extra_info.update(
        case="2000 x 8KiB stream",
        impl=impl,
        mode=mode,
        bytes=LEAVES * LEAF_BYTES,
        leaves=LEAVES,
        backend="gloo",
        stream=STREAM,
        suite_rounds=ROUNDS,
        ok=problem is None,
        **({"stock_mode": stock_mode} if stock_mode else {}),
    )
    tb.replay(benchmark, CLOCK, _RESULT["seconds"][mode_id(impl, mode)])
    assert problem is None, f"2000 x 8KiB stream: {impl} {mode}: {problem}"
