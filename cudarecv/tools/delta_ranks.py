"""The rank code of the delta benchmark across hosts (``bench/bench_delta.py``), run with torchrun.

Rank 0 is the trainer, ranks 1..K the receivers, each on a host of its own. The model is ``--mib`` MiB of bf16 in
16 leaves; each round changes ``fraction`` of its elements at random positions (values that depend only on the
position and the round, so every receiver can check what it got bit for bit). Each method pushes the same
rounds: ``delta`` (``WeightSender(delta=True)``; ``fanout="auto"`` picks relay across hosts, the chain
forwarding the patch), ``full`` (the same sender without delta) and each by the star (``delta star``: a patch
per receiver from the sender; ``full star``). A round's latency runs
from the trainer's start (after a barrier) to the last receiver holding the version; the sender's NIC counts the
bytes it sent (the link's count, not cudarecv's). Rank 0 writes ``OUT/delta_bench.json``.

Usage (inside each host, as :class:`~cudarecv.testing.hosts.SimulatedHosts` launches it)::

    torchrun ... -m cudarecv.tools.delta_ranks OUT --receivers 2 --mib 64 --fractions 0.01,1 --rounds 5
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
from cudarecv.weights.options import Fanout

from .cli import plain
from .host_ranks import nic_bytes

#: method -> (delta, fanout): ``delta`` and ``full`` are what ``fanout="auto"`` picks across hosts (relay)
METHODS: dict[str, tuple[bool, Fanout]] = {
    "delta": (True, "auto"),
    "delta star": (True, "star"),
    "full": (False, "auto"),
    "full star": (False, "star"),
}
LEAVES = 16


def model(mib: float) -> TensorDict:
    """``mib`` MiB of bf16 weights in :data:`LEAVES` leaves, the same on every rank."""
    per_leaf = int(mib * (1 << 20)) // (2 * LEAVES)
    gen = torch.Generator().manual_seed(0)
    return TensorDict(
        {
            f"layer{i:02d}": torch.randn(per_leaf, generator=gen).to(torch.bfloat16)
            for i in range(LEAVES)
        },
        batch_size=[],
    )


def change(td: TensorDict, fraction: float, round_: int) -> None:
    """Round ``round_``'s step: ``fraction`` of each leaf's elements (random positions, repeats allowed) take
    values that depend on the position and the round alone."""
    gen = torch.Generator().manual_seed(round_)
    for leaf in td.values():
        words = leaf.view(torch.int16)
        if fraction >= 1:
            where = torch.arange(words.numel())
        else:
            where = torch.randint(0, words.numel(), (int(words.numel() * fraction),), generator=gen)
        words[where] = ((where * 40503 + round_ * 7919) % 30011 + 1).to(torch.int16)


def _same(got: TensorDict, want: TensorDict) -> bool:
    """Whether every leaf of ``got`` holds ``want``'s bits."""
    return all(
        torch.equal(got.get(key).view(torch.int16), want.get(key).view(torch.int16))
        for key in want.keys(True, True)
    )


def _round(sender: cudarecv.WeightSender | None, receiver: cudarecv.WeightReceiver | None) -> float:
    """One round: the trainer's push, the receivers' pull; its latency, from the trainer's start to the last
    receiver's end."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    start = time.monotonic()
    if sender is not None:
        sender.push()
    else:
        assert receiver is not None
        receiver.pull()
    stamps = torch.tensor([start if rank == 0 else 0.0, time.monotonic()], dtype=torch.float64)
    every = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, stamps)
    return max(e[1].item() for e in every[1:]) - every[0][0].item()


def run(
    out: str,
    receivers: int,
    mib: float,
    fractions: list[float],
    rounds: int,
    methods: tuple[str, ...] = tuple(METHODS),
    timeout: float = 120.0,
) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != receivers + 1:
        raise SystemExit(
            f"--receivers {receivers} needs {receivers + 1} ranks, this run has {world}"
        )
    results: dict[str, Any] = {"bytes": 0, "rounds": rounds, "receivers": receivers, "cases": []}
    for method in methods:
        td = model(mib)
        results["bytes"] = sum(t.numel() * 2 for t in td.values())
        sender = receiver = None
        if rank == 0:
            delta, fanout = METHODS[method]
            sender = cudarecv.WeightSender(
                td, dst=list(range(1, world)), delta=delta, fanout=fanout, timeout=timeout
            )
        else:
            receiver = cudarecv.WeightReceiver(src=0, expect=td, timeout=timeout)
        round_ = 0
        _round(sender, receiver)  # the first version goes whole (nobody holds a base): not timed
        for fraction in fractions:
            seconds, sent, exact = [], [], True
            for _ in range(rounds):
                round_ += 1
                change(
                    td, fraction, round_
                )  # (every rank: the receivers' copy is what they check against)
                before = nic_bytes()[0]
                seconds.append(_round(sender, receiver))
                sent.append(nic_bytes()[0] - before)
                if receiver is not None:
                    exact = exact and _same(receiver.td, td)
            payload = sender.payload_bytes if sender is not None else {}
            fanout_used = sender.fanout if sender is not None else ""
            checks = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(checks, torch.tensor([float(exact)]))
            results["cases"].append(
                {
                    "method": method,
                    "fanout": fanout_used,
                    "fraction": fraction,
                    "seconds": seconds,
                    "sender_link_bytes": sent,
                    "payload_bytes": list(payload.values()),
                    "ok": all(c.item() == 1 for c in checks[1:]),
                }
            )
            if rank == 0:
                print(
                    f"{method} {fraction:g}: median {sorted(seconds)[len(seconds) // 2] * 1e3:.0f} ms, "
                    f"{sorted(sent)[len(sent) // 2] / 1e6:.1f} MB sent",
                    flush=True,
                )
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.close()
        dist.barrier()
    if rank == 0:
        with open(os.path.join(out, "delta_bench.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("out")
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--mib", type=float, default=64.0, help="model size in MiB (bf16)")
    parser.add_argument("--fractions", default="0.01,1", help="changed fractions, e.g. 0.01,1")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"a subset of {','.join(METHODS)}"
    )
    args = parser.parse_args()
    methods = tuple(args.methods.split(","))
    if not set(methods) <= set(METHODS):
        parser.error(f"--methods: choose among {','.join(METHODS)}, got {args.methods}")
    run(
        args.out,
        args.receivers,
        args.mib,
        [float(f) for f in args.fractions.split(",")],
        args.rounds,
        methods,
    )


if __name__ == "__main__":
    main()
