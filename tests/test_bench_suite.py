"""The bench suite's own machinery: the process tree's memory, untimed work on one thread, weight sync a mode at a time."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cudarecv.testing.launch import Cluster
from cudarecv.tools import bench_memory
from cudarecv.tools import transfer_ranks as tb
from cudarecv.tools.bench_memory import TreeMemory, tree_pss

MB = 1_000_000
BENCH = Path(__file__).resolve().parents[1] / "bench"

# maps (read-only) the file argv[1] of argv[2] bytes, reads every page, allocates and touches argv[3] bytes, says so
_CHILD = """
import mmap, sys
path, size, private = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, "rb") as f:
    shared = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
touched = sum(shared[i] for i in range(0, size, 4096))
block = bytearray(b"x" * private)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_tree_pss_counts_a_child_and_shared_memory_once(tmp_path: Path) -> None:
    size, private = 200 * MB, 100 * MB
    path = Path("/dev/shm") / f"cudarecv-test-bench-{os.getpid()}"
    try:
        with open(path, "wb+") as f:
            f.truncate(size)
            shared = mmap.mmap(f.fileno(), size)
        shared[:] = b"\1" * size  # resident in this process; the child reads the same pages
        before = tree_pss(os.getpid())
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(path), str(size), str(private)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline().strip() == "ready"
            grown = tree_pss(os.getpid()) - before
            alone = tree_pss(child.pid)
            child.communicate("\n", timeout=30)
        finally:
            child.kill()
            child.wait(30)
        shared.close()
    finally:
        path.unlink(missing_ok=True)
    # the child's 100 MB, its interpreter, and half of the 200 MB it shares with this process (counted once)
    assert private <= grown < private + size / 2 + 60 * MB, grown
    assert private + size / 2 <= alone, alone


def test_tree_memory_keeps_each_cases_peak_and_stops() -> None:
    sampler = TreeMemory(interval=0.05)
    sampler.start()
    try:
        before = tree_pss(os.getpid())
        block = torch.ones(300 * MB, dtype=torch.uint8)  # resident: every page written
        sampler.enter("large")  # the samples from now on see the block
        deadline = time.monotonic() + 30
        while "large" not in sampler.peaks and time.monotonic() < deadline:
            time.sleep(0.01)
        del block
    finally:
        sampler.stop()
    assert sampler.peaks["large"] >= before + 250 * MB, (before, sampler.peaks)
    assert not sampler._thread.is_alive()


def test_tree_memory_stop_raises_a_failed_sample(monkeypatch) -> None:
    def unreadable(root: int) -> int:
        raise PermissionError(f"/proc/{root}/smaps_rollup")

    monkeypatch.setattr(bench_memory, "tree_pss", unreadable)
    sampler = TreeMemory(interval=0.05)
    sampler.start()
    with pytest.raises(RuntimeError, match="sampling the process tree's memory failed"):
        sampler.stop()


def test_one_thread_restores_torch_threads() -> None:
    threads = torch.get_num_threads()
    with tb.one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads
    with pytest.raises(ValueError), tb.one_thread():
        raise ValueError("inside")
    assert torch.get_num_threads() == threads


def _peak_above_start(run) -> tuple[object, int]:
    """``run()``'s result, and the process tree's peak memory above what it held before (sampled every 50 ms)."""
    base = tree_pss(os.getpid())
    sampler = TreeMemory(interval=0.05)
    sampler.start()
    try:
        out = run()
    finally:
        sampler.stop()
    return out, max(sampler.peaks.values()) - base


@pytest.mark.timeout(300)
def test_weight_bench_one_mode_at_a_time_holds_one_modes_memory() -> None:
    total = 50 * MB
    sys.path.insert(0, str(BENCH))  # the spawned ranks unpickle bench_weights.time_weights from it
    try:
        import bench_weights

        with Cluster(2, pg_timeout=60.0) as cluster:
            peaks = {}
            for alone in (False, True):
                out, peaks[alone] = _peak_above_start(
                    lambda alone=alone: cluster.run(
                        bench_weights.time_weights, args=(total, 1, alone), timeout=240
                    )
                )
                assert all(out[1]["checks"].values()) and len(out[1]["checks"]) == 6, out[1][
                    "checks"
                ]
                assert all(len(seconds) == 1 for seconds in out[1]["seconds"].values()), out[1][
                    "seconds"
                ]
    finally:
        sys.path.remove(str(BENCH))
    # side by side: the model, four senders' snapshots, four receivers' storages (two each), stock's and raw's
    # buffers; one at a time: the model and one mode's (at most about 7 models: zero-copy's snapshots and the
    # receiver's own two storages)
    assert peaks[False] > 10 * total, peaks
    assert peaks[True] < 8 * total, peaks
