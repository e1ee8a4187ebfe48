"""Sharded weight sync across simulated hosts: an FSDP2 trainer on 4 hosts pushes a 256 MiB model to 4
tensor-parallel actors on 4 more hosts (1 Gbit/s links, :mod:`cudarecv.testing.hosts`), one torchrun launch on 8
hosts running both ways side by side (:mod:`cudarecv.tools.sharded_ranks`):

- ``cudarecv sharded``: ``ShardedSender`` of the FSDP2 model's DTensors on every trainer rank, ``ShardedReceiver(src=
  trainers, expect=<tensor-parallel DTensors>)`` on every actor: each byte once, from the rank holding it to the
  rank needing it, no gather;
- ``full_tensor + relay``: the way users do it today: ``full_tensor()`` of every parameter (FSDP2's all-gather),
  rank 0 pushes the whole model down a relay chain of the actors, each copies out its slice.

Time per version: from the trainer's start to the last actor holding its slice. Each host link's bytes per
version: its NIC counters. Targets: sharded >= 3x faster, and no host link carrying more than about a quarter
of the model per version. Skipped where namespaces cannot be created.
"""

from __future__ import annotations

import json
import statistics

import pytest

from cudarecv.testing import hosts as sim
from cudarecv.tools import transfer_ranks as tb

TRAINERS, ACTORS, MIB, ROUNDS = 4, 4, 256, 3
RATE = "1gbit"
ROWS = {
    "sharded": ("cudarecv", "sharded (no gather)"),
    "gather_relay": ("cudarecv", "full_tensor + relay"),
}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # (16 processes on the machine's cores, as in bench_hosts.py)
CLOCK = tb.VirtualClock("sharded_clock")
REASON = sim.unavailable()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"simulated hosts: {REASON}"),
    pytest.mark.timeout(900),
    pytest.mark.benchmark(timer=CLOCK),
]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, transfer_targets):
    out = tmp_path_factory.mktemp("sharded")
    with sim.SimulatedHosts(TRAINERS + ACTORS, rate=RATE) as hosts:
        procs = hosts.torchrun(
            "-m",
            [
                "cudarecv.tools.sharded_ranks",
                str(out),
                "--trainers",
                str(TRAINERS),
                "--mib",
                str(MIB),
                "--rounds",
                str(ROUNDS),
            ],
            env=ONE_THREAD,
            log_dir=str(out),
        )
        hosts.wait(procs, timeout=840, log_dir=str(out))
    with open(out / "sharded_bench.json") as f:
        run = json.load(f)
    cases = {c["method"]: c for c in run["cases"]}
    med = {method: statistics.median(c["seconds"]) for method, c in cases.items()}
    transfer_targets.append(
        f"sharded {MIB} MiB, {TRAINERS} FSDP2 hosts to {ACTORS} tensor-parallel hosts, {RATE}: "
        f"{med['gather_relay'] / med['sharded']:.2f}x faster than full_tensor + relay "
        "(target >= 3x)"
    )
    busiest = max(max(c["tx_per_version"] + c["rx_per_version"]) for c in [cases["sharded"]])
    transfer_targets.append(
        f"sharded: the busiest host link carries {busiest / run['bytes']:.2f} of the model per "
        "version (target <= about 0.25)"
    )
    for method, c in cases.items():
        actors = c["resident"][TRAINERS:]
        transfer_targets.append(
            f"{method}: each actor process resident {min(actors) / 1e6:.0f}-{max(actors) / 1e6:.0f} MB"
            f" once its versions landed (trainers {min(c['resident'][:TRAINERS]) / 1e6:.0f}-"
            f"{max(c['resident'][:TRAINERS]) / 1e6:.0f} MB)"
        )
    return run, cases


@pytest.mark.parametrize("method", list(ROWS))
def test_sharded_push(benchmark, sharded_run, method):
    run, cases = sharded_run
    case = cases[method]
    impl, mode = ROWS[method]
    benchmark.extra_info.update(
        case=f"sharded {MIB} MiB: {TRAINERS} FSDP2 hosts to {ACTORS} tensor-parallel hosts ({RATE})",
        impl=impl,
        mode=mode,
        bytes=run["bytes"],
        backend="gloo",
        ok=case["ok"],
        busiest_link_fraction=round(
            max(case["tx_per_version"] + case["rx_per_version"]) / run["bytes"], 3
        ),
        tx_per_version=case["tx_per_version"],
        rx_per_version=case["rx_per_version"],
        resident=case["resident"],
    )
    tb.replay(benchmark, CLOCK, case["seconds"])
