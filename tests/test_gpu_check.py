"""bench/gpu_check.sh, the one-shot check run on a lent GPU machine, checked here where it cannot run.

A lent machine gives one try: a script that does not parse, or a test id of its first GPU step that no
longer exists (pytest then runs nothing of that step), would waste it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")


def test_the_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_every_former_failure_it_names_is_a_test():
    """Step 4's explicit list (the tests that failed on the H200): each id is collected."""
    ids = subprocess.run(
        ["bash", str(SCRIPT), "--former"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.split()
    assert len(ids) == len(set(ids)) >= 18
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = {line.strip() for line in done.stdout.splitlines() if "::" in line}
    assert collected == set(ids), set(ids) ^ collected
