"""No abort at interpreter exit: a process whose transfer timed out, was refused or was never matched
exits with 0, not SIGABRT (rc -6, "terminate called without an active exception").

Each run is two fresh Python processes that join a store of this test's, do one case, meet at a
barrier on the store and end the way a user's script ends (falling off its end, the interpreter
shutting down), sometimes after ``destroy_process_group()``. Their exit codes are asserted over
several runs: the abort, when it comes, comes from a race with the peer's exit, not every time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
RUNS = 2
CHILD = """
import sys
sys.path.insert(0, {here!r})
import exit_abort_child
exit_abort_child.child({case!r}, {rank}, {port})
"""


def _run(case: str) -> list[tuple[int, str]]:
    """Both ranks of one run of ``case``: their exit codes and output."""
    store = dist.TCPStore(
        "127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=240)
    )
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CHILD.format(here=str(HERE), case=case, rank=rank, port=store.port),
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
            out, _ = proc.communicate(
                timeout=240
            )  # (a run takes 5-20 s; a loaded machine 3-5x that)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        ended.append((proc.returncode, out))
    return ended


def _outcome(out: str):
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["refused", "refused-destroyed", "unmatched"])
def test_no_abort_at_exit(case):
    for run in range(
        RUNS if case != "refused" else 1
    ):  # (refused-destroyed runs the same case twice, and more)
        ended = _run(case)
        assert [rc for rc, _ in ended] == [0, 0], (run, ended)  # SIGABRT is -6
        if case.startswith("refused"):
            sent, received = (_outcome(out) for _, out in ended)
            assert "send of the fast-wire header" in sent and "bucket_bytes on both ends" in sent, (
                sent
            )
            assert (
                "receive of 2 leaves" in received and "stock wire (no bucket_bytes)" in received
            ), received
        if case == "unmatched":
            assert "STOPPED True True" in ended[1][1], ended[1][1]
