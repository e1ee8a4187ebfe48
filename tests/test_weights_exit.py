"""No abort at interpreter exit for a weight sync never closed: a sender whose process ends right after
its push and a receiver whose process ends right after its pull, both left open, exit with 0, not SIGABRT
("terminate called without an active exception": a driver or listener thread still inside gloo at
shutdown). The abort comes from a race with the peer's exit, not every time: several runs, each two fresh
Python processes that end the way a user's script ends (falling off its end).

The sender is collected when its script's function returns, while its listener threads run on: at exit those
threads still run Python (here: a slow log handler, as an application's may be) after the hook ended their
waits, and one that frees a gloo work once the interpreter finalizes aborts the process. So each child also
says which of cudarecv's threads are still alive after the exit hook: none may be."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv
from cudarecv.core.shutdown import start_thread
from policies import holds_version, policy, set_version

HERE = Path(__file__).resolve().parent
RUNS = 1  # (the check of threads alive after the exit hook, the abort's cause, fails on every run: 3 of 3 before the fix)
CHILD = """
import atexit, logging, sys, threading
# registered before cudarecv's exit hook, so it runs after it (and before logging's, which waits for handlers)
atexit.register(lambda: print("ALIVE", [t.name for t in threading.enumerate() if t.name.startswith(("cudarecv",
                                                                                              "actor"))], flush=True))
sys.path.insert(0, {here!r})
import test_weights_exit
test_weights_exit.child({mode!r}, {rank}, {port}, {thread!r})
import gc
gc.collect()  # (as may happen any time) the sender and receiver, never closed, are collected: their threads run on
"""


class _SlowHandler(logging.Handler):
    """An application's log handler that takes its time (a file on a busy disk, a socket)."""

    def emit(self, record: logging.LogRecord) -> None:
        time.sleep(0.5)


def child(mode: str, rank: int, port: int, thread: bool) -> None:
    """One rank of one run: push (rank 0) or pull (rank 1) version 1, print it, meet at a barrier on the
    store, leave everything open; with ``thread``, the receiver's process goes on pulling on a thread of its
    own (``cudarecv.core.shutdown.start_thread``), as an actor does."""
    for name in ("cudarecv", "actor"):
        logging.getLogger(name).addHandler(_SlowHandler())
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=20)
    )
    model = policy()
    if rank == 0:
        sender = cudarecv.WeightSender(TensorDict.from_module(model), dst=1, mode=mode, timeout=20)
        set_version(model, 1)
        print("RESULT", sender.push(), flush=True)
    else:
        receiver = cudarecv.WeightReceiver(src=0, timeout=20)
        receiver.pull()
        print("RESULT", holds_version(receiver.td, 1), flush=True)
        if thread:
            start_thread(_take_versions, "actor-weights", (receiver,))
    store.set(
        f"{mode}-{rank}", "1"
    )  # a latest-mode push returns before the pull: the sender waits for it
    store.wait([f"{mode}-0", f"{mode}-1"])


def _take_versions(receiver: cudarecv.WeightReceiver) -> None:
    """An actor's thread: every next version, until the process exits (its pull then fails: logged, slowly)."""
    try:
        while True:
            receiver.pull()
    except cudarecv.Error as error:
        logging.getLogger("actor").warning("no more versions: %s", error)


def _run(mode: str, thread: bool = False) -> list[tuple[int, str]]:
    store = dist.TCPStore(
        "127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CHILD.format(here=str(HERE), mode=mode, rank=rank, thread=thread, port=store.port),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
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
        assert all("ALIVE []" in out for _, out in ended), (run, ended)


def test_an_applications_pulling_thread_exits_cleanly():
    """The receiver's process pulls on a thread started with ``cudarecv.core.shutdown.start_thread``, blocked in a pull when
    the process exits: the hook ends that pull and joins the thread."""
    for run in range(RUNS):
        ended = _run("sync", thread=True)
        assert [rc for rc, _ in ended] == [0, 0], (run, ended)
        assert all("ALIVE []" in out for _, out in ended), (run, ended)
