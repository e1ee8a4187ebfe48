"""The drop-in API between two processes: cudarecv's send/recv on a TensorDict, stock-compatible.

Run: python examples/drop_in.py
"""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

import cudarecv


def make_td(value: float) -> TensorDict:
    return TensorDict(
        {"obs": torch.full((64, 8), value), "net": {"w": torch.full((256,), value)}}, batch_size=[]
    )


def main(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        if rank == 0:
            td = make_td(1.0)
            cudarecv.send(td, dst=1)  # the stock wire: a stock `td.recv(src=0)` takes it too
            td.apply_(lambda t: t.add_(1))
            cudarecv.send(
                td, dst=1, bucket_bytes=1 << 20, timeout=30
            )  # the fast wire: both ends pass it
            with cudarecv.installed():  # or make them the TensorDict methods
                td.send(dst=1)
        else:
            td = make_td(0.0)  # same structure: received in place
            cudarecv.recv(td, src=0)
            assert (td["obs"] == 1).all()
            [transfer] = cudarecv.irecv(td, src=0, bucket_bytes=1 << 20, return_premature=True)
            transfer.wait(30)  # a future; also td.irecv's Transfer
            assert (td["net", "w"] == 2).all()
            with cudarecv.installed():
                td.recv(src=0)
            print(
                f"rank 1 received 3 transfers; obs[0, 0] = {td['obs'][0, 0].item():g}", flush=True
            )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(main, args=(2, free_port()), nprocs=2, join=True)
