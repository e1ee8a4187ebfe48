"""No abort at interpreter exit for a weight sync never closed: a sender whose process ends right after
its push and a receiver whose process ends right after its pull, both left open, exit with 0, not SIGABRT
("terminate called without an active exception": a driver or listener thread still inside gloo at
shutdown). The abort comes from a race with the peer's exit, not every time: several runs, each two fresh
Python processes that end the way a user's script ends (falling off its end)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from policies import holds_version, policy, set_version

HERE = Path(__file__).resolve().parent
RUNS = 3  # (the abort it guards against came on the first run)
CHILD = """
import sys
sys.path.insert(0, {here!r})
import test_weights_exit
test_weights_exit.child({mode!r}, {rank}, {port})
"""


def child(mode: str, rank: int, port: int) -> None:
    """One rank of one run: push (rank 0) or pull (rank 1) version 1, print it, meet at a barrier on the
    store, leave everything open."""
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=20))
    model = policy()
    if rank == 0:
        sender = cudarecv.WeightSender(TensorDict.from_module(model), dst=1, mode=mode, timeout=20)
        set_version(model, 1)
        print("RESULT", sender.push(), flush=True)
    else:
        receiver = cudarecv.WeightReceiver(src=0, timeout=20)
        receiver.pull()
        print("RESULT", holds_version(receiver.td, 1), flush=True)
    store.set(f"{mode}-{rank}", "1")  # a latest-mode push returns before the pull: the sender waits for it
    store.wait([f"{mode}-0", f"{mode}-1"])


def _run(mode: str) -> list[tuple[int, str]]:
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD.format(here=str(HERE), mode=mode, rank=rank,
                                                                    port=store.port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    ended = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        ended.append((proc.returncode, out))
    return ended


@pytest.mark.parametrize("mode", ["sync", "latest"])
def test_sender_and_receiver_never_closed_exit_cleanly(mode):
    for run in range(RUNS):
        ended = _run(mode)
        assert [rc for rc, _ in ended] == [0, 0], (run, ended)  # SIGABRT is -6
        assert "RESULT 1" in ended[0][1] and "RESULT True" in ended[1][1], (run, ended)
