"""The rank program of the cross-host tests (``test_hosts.py``), launched with torchrun on each simulated host.

``python hosts_job.py OUT cross_section``: a cross-section of the suite between ranks on different
hosts: stock <-> cudarecv interop, the fast wire with a mismatched header, weight sync with star
and relay fan-out. ``python hosts_job.py OUT kill``: a relay chain 1 -> 2 -> 3 -> 4 whose receiver 2's process
is killed mid-push; the chain heals in place (1 -> 3 -> 4), nothing rebuilt.
Each rank writes what it saw to ``OUT/rank<r>.json``; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from tensordict import TensorDict
from test_fast_wire import mismatch_then_ok
from test_interop import MODES, PAIRS, transfer
from test_sharded import holds as sharded_holds
from test_sharded import model as sharded_model
from test_sharded import set_version as set_sharded_version
from test_weights import fan_out

import cudarecv

TIMEOUT = 20.0
VICTIM = 2


def cross_section(rank: int, world: int) -> dict:
    out: dict = {"host": os.environ["CUDARECV_HOST"]}
    if rank < 2:  # ranks 0 and 1 are on different hosts
        out["interop"] = {
            f"{s}->{r}:{mode}": transfer(rank, 2, None, s, r, True, MODES[mode])
            for s, r in PAIRS
            for mode in ("plain", "consolidated")
        }
        out["mismatch"] = mismatch_then_ok(rank, 2, None, "buckets-shape")
    dist.barrier()
    for fanout in ("star", "relay"):
        out[f"weights_{fanout}"] = fan_out(rank, world, None, 4, False, fanout)
        dist.barrier()
    out["sharded"] = sharded_relay(rank)
    return out


def sharded_relay(rank: int) -> object:
    """FSDP2 on ranks 0 and 1 (two hosts) to ranks 2 and 3 (two more), each receiving the whole model: both want the
    same pieces of each trainer rank, which sends them down a relay chain of the two."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh("cpu", [0, 1])  # (every rank creates every mesh)
    if rank < 2:
        net = sharded_model()
        fully_shard(net, mesh=mesh)
        td = TensorDict.from_module(net)
        with cudarecv.ShardedSender(td, dst=[2, 3], timeout=TIMEOUT, verify=True) as sender:
            set_sharded_version(td, 1)
            sender.push()
            transports = (
                sender.transports
            )  # (read before the receivers can have closed: they await version 3)
            for version in (2, 3):
                set_sharded_version(td, version)
                sender.push()
            return sender.fanout, transports
    with cudarecv.ShardedReceiver(src=[0, 1], timeout=TIMEOUT) as receiver:
        return [(receiver.pull(), sharded_holds(receiver.td, version)) for version in (1, 2, 3)]


def _big_model() -> TensorDict:
    return TensorDict({f"w{i}": torch.zeros(1 << 19) for i in range(4)}, batch_size=[])  # 8 MiB


def _fill(td: TensorDict, version: int) -> None:
    for value in td.values():
        value.fill_(version)


def _holds(td: TensorDict, version: int) -> bool:
    return all(bool((v == version).all()) for v in td.values())


def kill(rank: int, world: int) -> dict:
    """Trainer 0 pushes through the chain 1 -> 2 -> 3 -> 4 until a push fails; rank 2 dies mid-push:
    rank 3's link to it fails, rank 4 hears of it in band (the trailer rank 3 still sends it). Ranks 3 and 4
    lose that version and get the next ones through the chain 1 -> 3 -> 4, on the same group."""
    out: dict = {"host": os.environ["CUDARECV_HOST"]}
    td = _big_model()
    if rank == 0:
        with cudarecv.WeightSender(
            td,
            dst=list(range(1, world)),
            fanout="relay",
            bucket_bytes=256 << 10,
            timeout=TIMEOUT,
            verify=True,
        ) as sender:
            for version in range(1, 60):
                _fill(td, version)
                try:
                    sender.push()
                except cudarecv.Error as error:
                    out.update(
                        failed_version=version,
                        error=f"{type(error).__name__}: {error}",
                        failed_at=time.time(),
                        ranks_left=sender.ranks,
                    )
                    break
            out["after"] = []
            for _ in range(
                2
            ):  # every survivor gets these, through the healed chain (then it is told CLOSED)
                _fill(td, sender.version + 1)
                out["after"].append(sender.push())
            out["ranks_after"] = sender.ranks
        return out
    receiver = cudarecv.WeightReceiver(src=0, expect=td, timeout=TIMEOUT)
    seen, lost = [], []
    if rank == VICTIM:
        receiver.pull()
        _die_mid_push()
    while True:
        try:
            # the next version may come only once the trainer has named the victim (within TIMEOUT + 10 s of the
            # kill, what the test allows): a pull waits past that
            version = receiver.pull(timeout=TIMEOUT + 10 + TIMEOUT)
        except cudarecv.SenderClosed:
            break
        except cudarecv.RelayLost as error:
            lost.append(
                [
                    f"{type(error).__name__}: {error}",
                    time.time(),
                    receiver.version,
                    _holds(receiver.td, receiver.version),
                ]
            )
            continue
        seen.append([version, _holds(receiver.td, version)])
    out.update(seen=seen, lost=lost)
    receiver.close()
    return out


def _die_mid_push() -> None:
    """Die once the second chunk of the next push has landed here (and the first is on its way down):
    mid-push by construction, whatever the machine's speed (a timer could fire between two pushes)."""
    from cudarecv.weights import relay as _relay

    landed = _relay.Relay.landed

    def landed_then_die(self, i: int) -> None:
        landed(self, i)
        if i == 1:
            _die()

    _relay.Relay.landed = landed_then_die


def _die() -> None:
    with open(os.path.join(sys.argv[1], f"rank{VICTIM}.json"), "w") as f:
        json.dump({"host": os.environ["CUDARECV_HOST"], "killed_at": time.time()}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out_dir, scenario = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if scenario == "kill" and rank == VICTIM and os.fork():
        os.wait()  # the rank runs in the child, which is killed: torchrun sees its worker end normally
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        result = (cross_section if scenario == "cross_section" else kill)(
            rank, dist.get_world_size()
        )
    finally:
        dist.destroy_process_group()  # also with a dead member: it releases this rank's side only
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
