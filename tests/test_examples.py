"""The README's runnable examples (``examples/``), each run as a user would: its own processes,
``init_process_group`` on a free loopback port, and a bounded wait."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from procs import HANG

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return f"{proc.stdout}\n(stderr:\n{proc.stderr})"


def test_drop_in_example() -> None:
    assert "rank 1 received 3 transfers; obs[0, 0] = 2" in _run("examples/drop_in.py")


@pytest.mark.parametrize("mode", ["sync", "latest"])
def test_weight_sync_example(mode: str) -> None:
    out = _run("examples/weight_sync.py", mode)
    assert f"trainer ({mode}): pushed 20 versions to ranks [1, 2]" in out, out
    for rank in (1, 2):
        # the ranks share one pipe: a line of one may come before another's newline
        found = re.search(rf"actor {rank} \({mode}\): (\d+) pulls, holds version 20(?!\d)", out)
        assert found, out
        pulls = int(found.group(1))
        assert pulls == 20 if mode == "sync" else 1 <= pulls <= 20, out


@pytest.mark.long
def test_ray_actors_example() -> None:
    """Ray actors (Ray on the CPU) join the trainer through a store; one is killed with ray.kill and replaced."""
    out = _run("examples/ray_actors.py", "--actors", "3", "--pushes", "20")
    assert re.search(
        r"ray actors: 4 joined, dropped \[\d\] \(the killed actor's: True\), 60 pulls, every version "
        r"whole: True, last version 20",
        out,
    ), out
