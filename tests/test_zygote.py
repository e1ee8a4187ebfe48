"""The test kit's zygote (cudarecv/testing/zygote.py): ranks forked from one process that imported torch once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import os
    from cudarecv.testing.launch import Cluster

    def where(rank, world, group):
        return rank, __name__, os.getpid()

    if __name__ == "__main__":
        with Cluster(2) as cluster:
            print(cluster.run(where))
""")


def test_a_scripts_own_functions_run_on_the_ranks(tmp_path):
    """As with spawn: the script is run again in each rank as ``__mp_main__`` (its guarded part not), so the
    functions it defines can be sent to the ranks."""
    script = tmp_path / "ranks_script.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 - our own script's printed list
    assert [(rank, name) for rank, name, _ in results] == [
        (0, "__mp_main__"),
        (1, "__mp_main__"),
    ], results
    assert len({pid for *_, pid in results}) == 2
