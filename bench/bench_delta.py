"""Delta weight sync across simulated hosts: push-to-all-published latency of a 64 MiB bf16 model when a
fraction of it changed since the version the receivers hold.

The trainer and K = 2 receivers, each on its own simulated host (network namespaces on a bridge, a
1 Gbit/s link each way per host, :mod:`cudarecv.testing.hosts`); one torchrun launch on 3 hosts runs
every case side by side (:mod:`cudarecv.tools.delta_ranks`). Each round changes 1% or 100% of the
model's elements, then the trainer pushes it with:

- ``delta``: ``WeightSender(delta=True)``, ``fanout="auto"`` (relay across hosts: the chain forwards
  the patch);
- ``delta star``: ``WeightSender(delta=True, fanout="star")``, a patch to each receiver from the trainer;
- ``full``: the same sender without delta (``fanout="auto"``: relay), the version whole;
- ``full star``: without delta, by the star.

Latency: from the trainer's start to the last receiver holding the version (bit-exact, checked by
every receiver: ``extra_info.ok``). Sender link bytes: the trainer's NIC counter (what the link carried,
not cudarecv's count), ``extra_info.sender_link_bytes`` (median of the rounds) and
``extra_info.link_fraction`` (that median / the ``full`` method's at the same fraction). Targets: at
1% changed delta >= 8x faster than full (and than full star), its sender link bytes <= 6% of full's;
at 100% changed delta's time <= 1.1x full's. Skipped where namespaces cannot be created.
"""

from __future__ import annotations

import json
import statistics

import pytest

from cudarecv.testing import hosts as sim
from cudarecv.tools import transfer_ranks as tb
from cudarecv.tools.delta_ranks import LEAVES, METHODS

RECEIVERS = 2
MIB = 64
RATE = "1gbit"
FRACTIONS = (0.01, 1.0)
ROUNDS = 5
# the 3 hosts' 6 processes (torchrun and its rank) share this machine's cores: one torch thread each
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
CLOCK = tb.VirtualClock("delta_clock")
REASON = sim.unavailable()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"simulated hosts: {REASON}"),
    pytest.mark.timeout(900),
    pytest.mark.benchmark(timer=CLOCK),
]


@pytest.fixture(scope="module")
def delta_run(tmp_path_factory, transfer_targets):
    out = tmp_path_factory.mktemp("delta")
    with sim.SimulatedHosts(RECEIVERS + 1, rate=RATE) as hosts:
        procs = hosts.torchrun(
            "-m",
            [
                "cudarecv.tools.delta_ranks",
                str(out),
                "--receivers",
                str(RECEIVERS),
                "--mib",
                str(MIB),
                "--rounds",
                str(ROUNDS),
                "--fractions",
                ",".join(f"{f:g}" for f in FRACTIONS),
            ],
            env=ONE_THREAD,
            log_dir=str(out),
        )
        hosts.wait(procs, timeout=840, log_dir=str(out))
    with open(out / "delta_bench.json") as f:
        run = json.load(f)
    cases = {(c["method"], c["fraction"]): c for c in run["cases"]}
    med = {key: statistics.median(c["seconds"]) for key, c in cases.items()}
    sent = {key: statistics.median(c["sender_link_bytes"]) for key, c in cases.items()}
    low, high = FRACTIONS
    delta_low = med["delta", low]
    for other in ("full", "full star"):
        transfer_targets.append(
            f"delta {MIB} MiB bf16, {low:.0%} changed, {RECEIVERS} receivers ({RATE} hosts): "
            f"delta {med[other, low] / delta_low:.2f}x faster than {other} (target >= 8x)"
        )
    transfer_targets.append(
        f"delta {low:.0%} changed: sender link bytes {sent['delta', low] / 1e6:.2f} MB = "
        f"{sent['delta', low] / sent['full', low]:.1%} of full's {sent['full', low] / 1e6:.1f} MB "
        "(target <= 6%)"
    )
    transfer_targets.append(
        f"delta {high:.0%} changed: delta / full time = "
        f"{med['delta', high] / med['full', high]:.2f}x (target <= 1.1x)"
    )
    return run, cases, sent


def _case(fraction: float) -> str:
    return f"delta {MIB} MiB bf16, {fraction:.0%} changed, {RECEIVERS} receivers ({RATE} hosts)"


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("fraction", FRACTIONS, ids=lambda f: f"{f:.0%}")
def test_delta(benchmark, delta_run, fraction, method):
    run, cases, sent = delta_run
    case = cases[method, fraction]
    benchmark.extra_info.update(
        case=_case(fraction),
        impl="cudarecv",
        mode=method,
        bytes=run["bytes"],
        leaves=LEAVES,
        backend="gloo",
        ok=case["ok"],
        receivers=run["receivers"],
        fanout=case["fanout"],
        sender_link_bytes=sent[method, fraction],
        link_fraction=round(sent[method, fraction] / sent["full", fraction], 4),
    )
    tb.replay(benchmark, CLOCK, case["seconds"])
    assert case["ok"], f"{method} {fraction:.0%} changed: a receiver holds wrong values"
