"""Weight sync: push-to-pull latency and GB/s, cudarecv vs stock tensordict vs raw torch.distributed.

For a 100 MB and a 1 GB model (100 float32 leaves), two ranks over gloo:

- ``cudarecv``: ``WeightSender.push()`` -> ``WeightReceiver.pull()`` (handshake once), one
  message and 1 MiB chunks;
- ``stock``: ``td.init_remote(dst)`` / ``TensorDict.from_remote_init(src)`` once, then
  ``td.send(dst, consolidated=True)`` -> ``td.recv(src, consolidated=True)`` every step
  (the stock way of doing the same; the sender consolidates, i.e. copies, each step, as
  cudarecv's sender copies into its storage);
- ``raw``: ``dist.send``/``dist.recv`` of one flat uint8 buffer of the same size.

Latency = from the step barrier until the receiver holds the complete new version,
timed inside the receiving rank; the modes alternate round by round. Each bench's
pytest-benchmark rounds are its mode's rounds as the receiver measured them, replayed
through a virtual clock (``tb.VirtualClock``), so ``stats.median`` is the median
latency. Each mode's last version is checked value by value (``ok`` in ``extra_info``;
a wrong one fails its bench).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict
from tensordict._base.distributed import _Distributed as Stock

import cudarecv
from cudarecv.tools import transfer_ranks as tb

MODES = [("cudarecv", "push/pull"), ("cudarecv", "push/pull chunks 1MiB"), ("stock", "init_remote + consolidated"),
         ("raw", "flat recv")]

CLOCK = tb.VirtualClock("receiver_clock")
pytestmark = [pytest.mark.timeout(600), pytest.mark.benchmark(timer=CLOCK)]


def _model(total_bytes: int, fill: float) -> TensorDict:
    per = total_bytes // 100 // 4
    return TensorDict({f"layer{i:03d}": torch.full((per,), fill) for i in range(100)}, batch_size=[])


def time_weights(rank: int, world: int, group, total_bytes: int, rounds: int) -> dict:
    """Run every mode ``rounds`` times, alternating; the receiver returns its seconds per mode."""
    td = _model(total_bytes, 0.0)
    senders, receivers = {}, {}
    for impl, mode in MODES:  # the one-time setup of each mode (not timed)
        if impl == "cudarecv":
            bucket = 1 << 20 if "chunks" in mode else None
            if rank == 0:
                senders[mode] = cudarecv.WeightSender(td, dst=1, bucket_bytes=bucket, timeout=120, fanout="star")
            else:
                receivers[mode] = cudarecv.WeightReceiver(src=0, timeout=120)
        elif impl == "stock":
            if rank == 0:
                td.init_remote(dst=1)
            else:
                receivers[mode] = TensorDict.from_remote_init(src=0)
    flat = torch.zeros(total_bytes, dtype=torch.uint8)
    seconds: dict[str, list[float]] = {mode: [] for _, mode in MODES}
    checks: dict[str, bool] = {}
    for step in range(1, rounds + 1):
        order = MODES[step % len(MODES):] + MODES[: step % len(MODES)]
        for impl, mode in order:
            if rank == 0:
                td.apply_(lambda t, step=step: t.fill_(float(step)))
            dist.barrier()
            start = time.perf_counter()
            if impl == "cudarecv":
                if rank == 0:
                    senders[mode].push()
                else:
                    receivers[mode].pull()
            elif impl == "stock":
                if rank == 0:
                    Stock.send(td, dst=1, consolidated=True)
                else:
                    Stock.recv(receivers[mode], src=0, consolidated=True)
            elif rank == 0:
                flat.fill_(step)
                dist.send(flat, dst=1)
            else:
                dist.recv(flat, src=0)
            if rank == 1:
                seconds[mode].append(time.perf_counter() - start)
                got = receivers[mode].td if impl == "cudarecv" else receivers.get(mode)
                if impl == "raw":
                    checks[mode] = bool((flat == step % 256).all())
                else:
                    checks[mode] = all(bool((t == float(step)).all()) for t in got.values(True, True))
    for sender in senders.values():
        sender.close()
    for receiver in receivers.values():
        if isinstance(receiver, cudarecv.WeightReceiver):
            receiver.close()
    return {"seconds": seconds, "checks": checks}


SIZES = {"100MB": 100_000_000, "1GB": 1_000_000_000}
_RESULTS: dict[str, dict] = {}


@pytest.mark.parametrize("impl,mode", MODES, ids=[m for _, m in MODES])
@pytest.mark.parametrize("size", list(SIZES))
def test_weight_sync(benchmark, transfer_cluster, transfer_targets, size, impl, mode):
    total = SIZES[size]
    if size not in _RESULTS:  # one side-by-side run per size, shared by its modes
        rounds = 12 if total < 500_000_000 else 5
        _RESULTS[size] = transfer_cluster.get().run(time_weights, args=(total, rounds), timeout=540)[1]
        result = _RESULTS[size]
        med = {m: statistics.median(v) for m, v in result["seconds"].items()}
        for m in ("push/pull", "push/pull chunks 1MiB"):
            transfer_targets.append(f"weights {size}: cudarecv {m} vs stock init_remote+recv: "
                                    f"{med['init_remote + consolidated'] / med[m]:.2f}x, vs raw: "
                                    f"{med['flat recv'] / med[m]:.2f}x ({med[m] * 1e3:.1f} ms, "
                                    f"{total / med[m] / 1e9:.2f} GB/s)")
    result = _RESULTS[size]
    ok = result["checks"][mode]
    benchmark.extra_info.update(case=f"weight sync {size}", impl=impl, mode=mode, bytes=total, leaves=100,
                                backend="gloo", suite_rounds=len(result["seconds"][mode]), ok=ok,
                                stock_mode="init_remote + consolidated")
    tb.replay(benchmark, CLOCK, result["seconds"][mode])
    assert ok, f"{mode}: the receiver holds wrong values"
