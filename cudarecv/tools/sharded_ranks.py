"""The rank code of the sharded weight-sync benchmark across hosts (``bench/bench_sharded.py``), run with torchrun.

Ranks 0..T-1 are the trainer (FSDP2 over their mesh), ranks T..T+R-1 the actors (a tensor-parallel mesh of R:
even layers column-parallel, odd layers row-parallel, as Megatron cuts an MLP), one rank per simulated host.
Each way of getting a new version from the trainer to the actors is timed in turn, round by round:

- ``sharded``: ``ShardedSender(TensorDict.from_module(model), dst=actors)`` on every trainer rank,
  ``ShardedReceiver(src=trainers, expect=<the actor's DTensors>)`` on every actor: each byte goes once from the
  trainer rank that holds it to the actor that needs it;
- ``gather_relay``: what users do today: ``full_tensor()`` of every parameter on the trainer ranks (FSDP2's
  all-gather), then rank 0 pushes the whole model down a relay chain (``WeightSender(fanout="relay")``), and
  each actor copies out its slice.

A round runs from the trainer's start (after a barrier) to the last actor holding its slice of the version
(every element checked after the rounds). Each rank reads its NIC's byte counters around each method, so each
host link's bytes per version are measured. Rank 0 writes everything to ``OUT/sharded_bench.json``.

Usage (inside each host, as :class:`~cudarecv.testing.hosts.SimulatedHosts` launches it)::

    torchrun ... -m cudarecv.tools.sharded_ranks OUT --trainers 4 --mib 256 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv

from .cli import plain
from .host_ranks import nic_bytes

if TYPE_CHECKING:
    from tensordict import NestedKey
    from torch.distributed.tensor import DTensor


def _dtensors(td: TensorDict) -> list[tuple[NestedKey, DTensor]]:
    """The leaves of ``td``, a model sharded by FSDP2 (DTensors)."""
    return [(key, cast("DTensor", t)) for key, t in td.items(True, True)]


METHODS = ("sharded", "gather_relay")
LAYERS = 4


def _model(mib: float) -> torch.nn.Module:
    """LAYERS square linear layers (with biases) of about ``mib`` MiB of float32 in all, on the meta device (its
    shapes only: a trainer materializes its shards alone, after ``fully_shard``)."""
    dim = int(math.sqrt(mib * (1 << 20) / 4 / LAYERS)) // 16 * 16
    return torch.nn.Sequential(*(torch.nn.Linear(dim, dim, device="meta") for _ in range(LAYERS)))


def _placements(name: str) -> list:
    """The actors' cut: even layers by rows (weight and bias), odd layers by columns (bias whole)."""
    from torch.distributed.tensor import Replicate, Shard

    layer = int(name.split(".")[0])
    if layer % 2 == 0:
        return [Shard(0)]
    return [Shard(1)] if name.endswith("weight") else [Replicate()]


def _actor_layout(model: torch.nn.Module, mesh: Any) -> TensorDict:
    """The actor's ``expect``: each parameter as a DTensor of its cut, built from local zeros (no collective)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    leaves = {}
    for name, p in model.named_parameters():
        placements = _placements(name)
        local, _ = compute_local_shape_and_global_offset(p.shape, mesh, placements)
        leaves[tuple(name.split("."))] = DTensor.from_local(
            torch.zeros(local), mesh, placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return TensorDict(leaves, [])


def _slices(td: TensorDict) -> dict[NestedKey, tuple[slice, ...]]:
    """Each DTensor leaf's part of the whole, as torch cuts it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[NestedKey, tuple[slice, ...]] = {}
    for key, t in _dtensors(td):
        local, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        out[key] = tuple(slice(o, o + n) for o, n in zip(offset, local))
    return out


class _Method:
    """One way to get the trainer's version to the actors: set up once, then ``round()``; ``holds(fill)``."""

    def __init__(
        self,
        method: str,
        trainers: list[int],
        actors: list[int],
        meshes: dict,
        mib: float,
        timeout: float,
    ) -> None:
        from torch.distributed.fsdp import fully_shard

        rank = dist.get_rank()
        self.method, self.trainer, self.actor = method, rank in trainers, rank in actors
        self.sender: cudarecv.ShardedSender | cudarecv.WeightSender | None = None
        self.receiver: cudarecv.ShardedReceiver | cudarecv.WeightReceiver | None = None
        self.mine: TensorDict | None = (
            None  # an actor's slice (gather_relay: copied out of the whole)
        )
        if self.trainer:
            net = _model(mib)
            fully_shard(net, mesh=meshes["trainers"])
            net.to_empty(device="cpu")  # this rank's shards only (filled each round)
            self.td = TensorDict.from_module(net)
            if method == "sharded":
                self.sender = cudarecv.ShardedSender(self.td, dst=actors, timeout=timeout)
            elif (
                rank == trainers[0]
            ):  # (the other trainer ranks take part in each all-gather, and drop its result)
                self.whole = TensorDict(
                    {k: torch.zeros(t.shape) for k, t in self.td.items(True, True)}, []
                )
                self.sender = cudarecv.WeightSender(
                    self.whole, dst=actors, fanout="relay", timeout=timeout
                )
        elif self.actor:
            layout = _actor_layout(_model(mib), meshes["actors"])
            if method == "sharded":
                self.receiver = cudarecv.ShardedReceiver(
                    src=trainers, expect=layout, timeout=timeout
                )
            else:
                self.receiver = cudarecv.WeightReceiver(src=trainers[0], timeout=timeout)
                self.cut = _slices(layout)
                self.mine = TensorDict({k: t.to_local().clone() for k, t in _dtensors(layout)}, [])

    def fill(self, value: float) -> None:
        if self.trainer:
            with torch.no_grad():
                for _, t in _dtensors(self.td):
                    t.to_local().fill_(value)

    def round(self) -> None:
        if self.trainer and self.method == "sharded":
            assert self.sender is not None  # (every trainer sends its shards)
            self.sender.push()
        elif self.trainer:
            for key, t in _dtensors(self.td):
                whole = t.full_tensor()  # FSDP2's all-gather, on every trainer rank
                if self.sender is not None:
                    cast(torch.Tensor, self.whole[key]).copy_(whole)
            if self.sender is not None:
                self.sender.push()
        elif self.actor:
            assert self.receiver is not None  # (every actor receives)
            self.receiver.pull()
            if self.mine is not None:
                with self.receiver.reading() as td:
                    for key, cut in self.cut.items():
                        self.mine[key].copy_(td[key][cut])

    def holds(self, value: float) -> bool:
        if not self.actor:
            return True
        assert self.receiver is not None
        got = (
            self.mine
            if self.mine is not None
            else TensorDict({k: t.to_local() for k, t in _dtensors(self.receiver.td)}, [])
        )
        return all(bool((t == value).all()) for t in got.values(True, True))

    def close(self) -> None:
        for end in (self.sender, self.receiver):
            if end is not None:
                end.close()


def _resident() -> int:
    """This process's resident bytes now (its weights, buffers and snapshots, with the interpreter's)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(
    out: str,
    trainers: int,
    mib: float,
    rounds: int,
    timeout: float = 300.0,
    methods: tuple[str, ...] = METHODS,
) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    from torch.distributed.device_mesh import DeviceMesh

    rank, world = dist.get_rank(), dist.get_world_size()
    if not 0 < trainers < world:
        raise SystemExit(f"--trainers {trainers} leaves no actor in a world of {world}")
    trainer_ranks, actor_ranks = list(range(trainers)), list(range(trainers, world))
    meshes = {
        "trainers": DeviceMesh("cpu", trainer_ranks),
        "actors": DeviceMesh("cpu", actor_ranks),
    }  # every rank
    model_bytes = sum(p.numel() * 4 for p in _model(mib).parameters())
    results: dict[str, Any] = {
        "bytes": model_bytes,
        "rounds": rounds,
        "trainers": trainers,
        "actors": len(actor_ranks),
        "cases": [],
    }
    for method in methods:
        case = _Method(method, trainer_ranks, actor_ranks, meshes, mib, timeout)
        case.fill(0.0)
        case.round()  # a warm-up version: first-use costs are not the method's per-version time
        seconds, checks = [], True
        dist.barrier()
        before = nic_bytes()
        for step in range(1, rounds + 1):
            case.fill(float(step))
            dist.barrier()
            start = time.monotonic()
            case.round()
            end = time.monotonic()
            stamps = torch.tensor(
                [start if rank == 0 else 0.0, end if rank in actor_ranks else 0.0],
                dtype=torch.float64,
            )
            every = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, stamps)
            seconds.append(max(e[1].item() for e in every) - every[0][0].item())
            checks = checks and case.holds(float(step))
        after = nic_bytes()
        moved = torch.tensor(
            [after[0] - before[0], after[1] - before[1], int(checks), _resident()],
            dtype=torch.float64,
        )
        every = [torch.zeros(4, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, moved)
        case.close()
        del case  # (its buffers go before the next method's are made)
        gc.collect()
        dist.barrier()
        results["cases"].append(
            {
                "method": method,
                "seconds": seconds,
                "ok": all(e[2].item() == 1 for e in every),
                "tx_per_version": [e[0].item() / rounds for e in every],
                "rx_per_version": [e[1].item() / rounds for e in every],
                "resident": [e[3].item() for e in every],
            }
        )
        if rank == 0:
            print(f"{method}: median {sorted(seconds)[len(seconds) // 2] * 1e3:.0f} ms", flush=True)
    if rank == 0:
        with open(os.path.join(out, "sharded_bench.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=plain(__doc__))
    parser.add_argument("out")
    parser.add_argument(
        "--trainers", type=int, default=4, help="trainer ranks (the rest are actors)"
    )
    parser.add_argument("--mib", type=float, default=256.0, help="model size in MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"a subset of {','.join(METHODS)}"
    )
    args = parser.parse_args()
    methods = tuple(args.methods.split(","))
    if not set(methods) <= set(METHODS):
        parser.error(f"--methods: choose among {','.join(METHODS)}, got {args.methods}")
    run(args.out, args.trainers, args.mib, args.rounds, methods=methods)


if __name__ == "__main__":
    main()
