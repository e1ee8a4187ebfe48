"""bench/gpu_check.sh, the one-shot check run on a lent GPU machine, checked here where it cannot run.

A lent machine gives one try: a script that does not parse, a test id or file one of its steps names that no
longer exists (pytest then runs nothing of that step), or an NCCL test its ``-m nccl`` steps do not select,
would waste it. So would an NCCL smoke check that leaves its ranks running when the step's ``timeout`` ends it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
SMOKE = ROOT / "bench" / "nccl_smoke.py"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")


def _listed(flag: str) -> list[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), flag], capture_output=True, text=True, timeout=30, check=True
    ).stdout.split()


def _collect(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line.strip() for line in done.stdout.splitlines() if "::" in line]


def test_the_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_every_former_failure_it_names_is_a_test():
    """Step 8's explicit list (the tests that failed on the H200): each id is collected."""
    ids = _listed("--former")
    assert len(ids) == len(set(ids)) >= 18
    collected = set(_collect(*ids))
    assert collected == set(ids), set(ids) ^ collected


def test_every_file_and_id_it_names_collects():
    """Every file a step names exists, and each test id collects (the NCCL subset of step 9 included)."""
    named = _listed("--ids")
    files = [n for n in named if "::" not in n]
    ids = sorted({n for n in named if "::" in n})
    for name in files:
        assert (ROOT / name).is_file(), name
    assert "tests/test_gpu_check.py" not in files  # (CPU only: no GPU step runs it)
    collected = set(_collect(*ids))
    assert collected == set(ids), set(ids) ^ collected


_MARKS = """
import inspect, json, pytest

class Report:
    def __init__(self):
        self.items = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            fixtures = item._fixtureinfo.name2fixturedefs
            source = ""
            for name in item.fixturenames:
                for fixturedef in fixtures.get(name, ()):
                    try:
                        source += inspect.getsource(fixturedef.func)
                    except (OSError, TypeError):
                        pass
            self.items[item.nodeid] = {
                "nccl": item.get_closest_marker("nccl") is not None,
                "starts_nccl": "nccl_ranks(" in source or "_nccl(" in source,
            }

report = Report()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "", *FILES], plugins=[report])
print("MARKS" + json.dumps(report.items))
raise SystemExit(code)
"""


def test_every_test_that_starts_nccl_ranks_is_marked_nccl():
    """The NCCL steps select with ``-m nccl``, the others with ``-m "not nccl"``: a test whose fixtures start
    NCCL ranks (``nccl_ranks``) and is not marked would run in a step that never waits for NCCL."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_gpu*.py"))
    done = subprocess.run(
        [sys.executable, "-c", _MARKS.replace("*FILES", f"*{files!r}")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("MARKS")]
    items = json.loads(line[len("MARKS") :])
    unmarked = sorted(i for i, f in items.items() if f["starts_nccl"] and not f["nccl"])
    assert not unmarked, unmarked
    nccl = {i for i, f in items.items() if f["nccl"]}
    for name in ("test_gpu_fanout.py", "test_gpu_staging.py", "test_gpu_streams.py", "test_gpu.py"):
        assert any(i.startswith(f"tests/{name}::") for i in nccl), name
    # (the marker is registered: pytest says nothing of an unknown "nccl")
    assert "PytestUnknownMarkWarning" not in done.stdout + done.stderr


def test_the_nccl_marker_is_registered():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--markers", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "@pytest.mark.nccl:" in done.stdout, done.stdout[-2000:]


def _children(pid: int) -> set[tuple[int, int]]:
    """The children of ``pid``, each as (pid, start time): a pid the kernel gives again to a new process (this
    machine's pid_max is 32768) is not the child that died."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.add((int(entry.name), int(fields[19])))
    return found


def _alive(child: tuple[int, int]) -> bool:
    """Whether that very process (its pid and start time) still runs (a zombie does not)."""
    pid, started = child
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return int(fields[19]) == started and fields[0] != "Z"


def smoke_pair_interrupted(
    script: Path, tmp_path: Path
) -> tuple[subprocess.CompletedProcess, set[tuple[int, int]]]:
    """Start ``script pair`` over gloo, SIGINT it once both ranks run; its output and its ranks' pids."""
    parent = subprocess.Popen(
        [sys.executable, str(script), "pair", "--backend", "gloo", "--logs", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        end = time.monotonic() + 60
        ranks: set[tuple[int, int]] = set()
        while len(ranks) < 2 and time.monotonic() < end and parent.poll() is None:
            ranks = _children(parent.pid)
            time.sleep(0.05)
        assert len(ranks) == 2, "the pair's two ranks never started"
        parent.send_signal(signal.SIGINT)
        out, _ = parent.communicate(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    return subprocess.CompletedProcess(parent.args, parent.returncode, out), ranks


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_the_smoke_pair_ends_its_ranks_when_interrupted(tmp_path):
    """``timeout -s INT`` signals the step's process group; the pair's ranks, in sessions of their own, are
    not in it: their parent kills them."""
    done, ranks = smoke_pair_interrupted(SMOKE, tmp_path)
    try:
        end = time.monotonic() + 15
        while any(_alive(rank) for rank in ranks) and time.monotonic() < end:
            time.sleep(0.1)  # (a poll of their end, bounded)
        assert not any(_alive(rank) for rank in ranks), (ranks, done.stdout)
        assert done.returncode == 1, done.stdout
        assert "stopped by SIGINT" in done.stdout, done.stdout
    finally:
        for rank in ranks:
            if _alive(rank):
                os.kill(rank[0], signal.SIGKILL)


def test_the_nccl_test_modules_bound_each_test_beyond_their_own_waits():
    """Each new NCCL module's pytest timeout covers its ranks' start and its longest call into them."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        for name in ("test_gpu_fanout", "test_gpu_staging", "test_gpu_streams"):
            module = pytest.importorskip(name)
            [mark] = [m for m in module.pytestmark if m.name == "timeout"]
            assert mark.args[0] >= module.RUN_TIMEOUT + module.START, name
        fanout = sys.modules["test_gpu_fanout"]
        # the receivers' groups outlive their wait for the trainer; the trainer's wait outlives its groups
        assert (
            fanout.RECEIVER_PG_TIMEOUT > fanout.DONE_WAIT > fanout.PAST_WATCHDOG > fanout.PG_TIMEOUT
        )
        assert fanout.RUN_TIMEOUT > fanout.DONE_WAIT
        streams = sys.modules["test_gpu_streams"]
        assert streams.PG_TIMEOUT > streams.STALL > streams.WAIT
        staging = sys.modules["test_gpu_staging"]
        assert staging.PG_TIMEOUT > staging.WAIT
    finally:
        sys.path.remove(str(ROOT / "tests"))
