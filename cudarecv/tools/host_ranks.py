"""The rank code of the fan-out benchmark across hosts (``bench/bench_hosts.py``), run with torchrun.

Rank 0 is the trainer; ranks 1..K the receivers, one per host. For each K the ranks 0..K
form a subgroup, and each way of getting the trainer's model to all K is timed in turn,
round by round: ``relay`` and ``star`` (a :class:`~cudarecv.WeightSender` with that
``fanout``), ``broadcast`` (gloo's ``dist.broadcast`` of the same storage) and ``stock``
(tensordict's ``init_remote`` once, then ``send(consolidated=True)`` to each receiver in turn).
A round's latency runs from the trainer's start (after a barrier) to the moment the last
receiver holds the whole version (one clock: the hosts share the machine's monotonic clock).
Each rank reads its NIC's byte counters around each case, so the busiest link's load is
measured, not assumed. Rank 0 writes everything to ``OUT/hosts_bench.json``.

Usage (inside each host, as :class:`~cudarecv.testing.hosts.SimulatedHosts` launches it)::

    torchrun ... -m cudarecv.tools.host_ranks OUT --ks 1,2,4,6 --mib 64 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv

from ..p2p.stock import Stock
from .cli import plain

METHODS = ("relay", "star", "broadcast", "stock")
LEAVES = 16


def _model(total: int) -> TensorDict:
    return TensorDict(
        {f"layer{i:02d}": torch.zeros(total // LEAVES // 4) for i in range(LEAVES)}, batch_size=[]
    )


def nic_bytes() -> tuple[int, int]:
    """This host's NIC bytes sent and received so far ((0, 0) where its counters cannot be read)."""
    base = f"/sys/class/net/{os.environ.get('GLOO_SOCKET_IFNAME', 'eth0')}/statistics"
    try:
        with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
            return int(tx.read()), int(rx.read())
    except OSError:
        return 0, 0


class _Case:
    """One method to K receivers on the subgroup ``group``: set up once, then ``round(fill)``."""

    def __init__(
        self,
        method: str,
        k: int,
        group: Any,
        td: TensorDict,
        timeout: float,
        bucket_bytes: int | None = None,
    ) -> None:
        self.method, self.k, self.group, self.td = method, k, group, td
        rank = dist.get_rank()
        self.flat = torch.zeros(sum(v.numel() for v in td.values()), dtype=torch.float32)
        self.sender = self.receiver = self.remote = None
        if method in ("relay", "star"):
            if rank == 0:
                self.sender = cudarecv.WeightSender(
                    td,
                    group=group,
                    group_dst=list(range(1, k + 1)),
                    fanout="relay" if method == "relay" else "star",
                    timeout=timeout,
                    bucket_bytes=bucket_bytes,
                )
            else:
                self.receiver = cudarecv.WeightReceiver(group=group, group_src=0, timeout=timeout)
        elif method == "stock":
            if rank == 0:
                for dst in range(1, k + 1):
                    td.init_remote(dst=dst, group=group)
            else:
                self.remote = TensorDict.from_remote_init(src=0, group=group)

    def round(self, fill: float) -> None:
        rank = dist.get_rank()
        if self.method in ("relay", "star"):
            if self.sender is not None:  # (rank 0)
                self.sender.push()
            else:
                assert self.receiver is not None
                self.receiver.pull()
        elif self.method == "broadcast":
            if rank == 0:
                self.flat.fill_(fill)
            dist.broadcast(self.flat, src=0, group=self.group)
        elif rank == 0:
            for dst in range(1, self.k + 1):
                Stock.send(self.td, dst=dst, group=self.group, consolidated=True)
        else:
            Stock.recv(self.remote, src=0, group=self.group, consolidated=True)

    def holds(self, fill: float) -> bool:
        if self.method == "broadcast":
            return bool((self.flat == fill).all())
        got = self.receiver.td if self.receiver is not None else self.remote
        assert got is not None  # (a receiving rank's)
        return all(bool((t == fill).all()) for t in got.values(True, True))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()


def run(
    out: str,
    ks: list[int],
    mib: float,
    rounds: int,
    timeout: float = 120.0,
    methods: tuple[str, ...] = METHODS,
    bucket_bytes: int | None = None,
) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if max(ks) >= world:
        raise SystemExit(f"--ks {ks} needs {max(ks) + 1} ranks, this run has {world}")
    total = int(mib * (1 << 20)) // (LEAVES * 4) * LEAVES * 4
    td = _model(total)
    groups = {
        k: dist.new_group(list(range(k + 1))) for k in ks
    }  # collectives: every rank creates every one
    results: dict[str, Any] = {"bytes": total, "rounds": rounds, "cases": []}
    for k in ks:
        for method in methods:
            member = rank <= k
            case = _Case(method, k, groups[k], td, timeout, bucket_bytes) if member else None
            seconds, checks = [], True
            before = nic_bytes()
            busy = 0.0
            for step in range(1, rounds + 1):
                fill = float(step)
                if rank == 0:
                    td.apply_(lambda t, fill=fill: t.fill_(fill))
                dist.barrier()
                start = time.monotonic()
                if case is not None:  # (a member)
                    case.round(fill)
                end = time.monotonic()
                stamps = torch.tensor(
                    [start if rank == 0 else 0.0, end if 0 < rank <= k else 0.0],
                    dtype=torch.float64,
                )
                every = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
                dist.all_gather(every, stamps)
                latency = max(e[1].item() for e in every) - every[0][0].item()
                seconds.append(latency)
                busy += latency
                if case is not None and rank > 0:
                    checks = checks and case.holds(fill)
            after = nic_bytes()
            moved = torch.tensor(
                [after[0] - before[0], after[1] - before[1], int(checks)], dtype=torch.float64
            )
            every = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, moved)
            if case is not None:
                case.close()
            dist.barrier()
            busiest = max(max(e[0].item(), e[1].item()) for e in every[: k + 1])
            results["cases"].append(
                {
                    "method": method,
                    "k": k,
                    "seconds": seconds,
                    "busiest_link_bytes": busiest,
                    "busy_seconds": busy,
                    "ok": all(e[2].item() == 1 for e in every[1 : k + 1]),
                }
            )
            if rank == 0:
                print(
                    f"K={k} {method}: median {sorted(seconds)[len(seconds) // 2] * 1e3:.0f} ms",
                    flush=True,
                )
    if rank == 0:
        with open(os.path.join(out, "hosts_bench.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("out")
    parser.add_argument("--ks", default="1,2,4", help="receiver counts, e.g. 1,2,4,6")
    parser.add_argument("--mib", type=float, default=64.0, help="model size in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"a subset of {','.join(METHODS)}"
    )
    parser.add_argument(
        "--bucket-bytes", type=int, help="relay and star: bytes per message (default: cudarecv's)"
    )
    args = parser.parse_args()
    methods = tuple(args.methods.split(","))
    if not set(methods) <= set(METHODS):
        parser.error(f"--methods: choose among {','.join(METHODS)}, got {args.methods}")
    run(
        args.out,
        [int(k) for k in args.ks.split(",")],
        args.mib,
        args.rounds,
        methods=methods,
        bucket_bytes=args.bucket_bytes,
    )


if __name__ == "__main__":
    main()
