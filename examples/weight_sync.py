"""Weight sync: a trainer and 2 actors, in sync mode (every version to every actor) or latest mode
(the trainer never waits; each actor takes the newest version when it is ready).

Run: python examples/weight_sync.py [sync|latest]
"""

import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

import cudarecv

STEPS = 20


def policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def trainer(mode: str) -> None:
    model = policy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cudarecv.WeightSender(
        TensorDict.from_module(model), dst=[1, 2], mode=mode, timeout=60
    ) as sender:
        for _ in range(STEPS):
            loss = model(torch.randn(32, 8)).pow(2).mean()  # a training step
            opt.zero_grad()
            loss.backward()
            opt.step()
            sender.push()  # sync: returns once both actors have it; latest: at once
        print(
            f"trainer ({mode}): pushed {sender.version} versions to ranks {sender.ranks}",
            flush=True,
        )
        dist.barrier()  # the actors hold the final version: close after them


def actor(rank: int, mode: str) -> None:
    model = policy()  # the structure the weights must match
    with cudarecv.WeightReceiver(src=0, expect=model, timeout=60) as receiver:
        pulls = 0
        while receiver.version < STEPS:
            receiver.pull()  # sync: the next version; latest: the newest (skipping those missed)
            pulls += 1
            receiver.load_into(model)  # or act on receiver.td (views, no copy)
            if rank == 2:
                time.sleep(0.05)  # a slow actor: in latest mode the trainer does not wait for it
        dist.barrier()
        print(
            f"actor {rank} ({receiver.mode}): {pulls} pulls, holds version {receiver.version}",
            flush=True,
        )


def main(rank: int, world: int, port: int, mode: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        trainer(mode) if rank == 0 else actor(rank, mode)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "sync"
    mp.spawn(main, args=(3, free_port(), mode), nprocs=3, join=True)
