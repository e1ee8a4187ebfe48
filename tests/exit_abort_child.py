"""One rank of one run of tests/test_exit_abort.py (a module of its own: the child imports no pytest)."""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.core import shutdown as _handle


def child(case: str, rank: int, port: int) -> None:
    """One rank of one run: the case, then a barrier on the store, then the interpreter's own exit."""
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=20)
    )
    td = TensorDict(a=torch.full((1000,), float(rank)), b=torch.zeros(10))
    outcome = None
    if case.startswith(
        "refused"
    ):  # the fast wire on the sender only: both ends time out, naming the cause
        try:
            if rank == 0:
                cudarecv.send(td, 1, bucket_bytes=1 << 20, timeout=1.5)
            else:
                cudarecv.recv(td, 0, timeout=1.5)
        except cudarecv.TransferTimeout as error:
            outcome = str(error)
    elif (
        case == "unmatched" and rank == 1
    ):  # a fast-wire receive posted, never matched, never waited
        [transfer] = cudarecv.irecv(td, 0, bucket_bytes=1 << 20, return_premature=True)
        # an owner's stop runs at exit once the hook has ended the waits (here: that receive's)
        _handle.at_exit(
            lambda seconds: print(f"STOPPED {transfer.settled} {seconds > 0}", flush=True)
        )
    store.set(f"{case}-{rank}", "1")
    store.wait([f"{case}-0", f"{case}-1"])
    if case == "refused-destroyed":
        dist.destroy_process_group()
    print("RESULT " + json.dumps(outcome), flush=True)
