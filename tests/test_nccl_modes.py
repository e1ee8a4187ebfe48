"""How :func:`cudarecv.testing.gpu.nccl_ranks` runs NCCL ranks, decided on the CPU.

The mode for a GPU count and an NCCL version (one GPU and NCCL 2.28, the lent machines: each rank
its own ``NCCL_HOSTID``), the environment each rank gets, and the version probe: ``ncclGetVersion``
through ctypes, checked against a stand-in ``libnccl`` built here with the C compiler, and None on a
machine without NCCL (this one).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch.distributed as dist

from cudarecv.testing import gpu
from cudarecv.testing.gpu import (
    decode_nccl_version,
    nccl_mode,
    nccl_rank_env,
    nccl_ranks,
    nccl_ranks_problem,
    nccl_runtime_version,
)


@pytest.mark.parametrize(
    ("world", "gpus", "version", "mode"),
    [
        (2, 1, (2, 28, 9), "hostid"),  # the lent H100/H200
        (3, 1, (2, 28, 9), "hostid"),
        (2, 1, None, "hostid"),  # version unknown: the mode every NCCL allows
        (3, 2, (2, 28, 9), "hostid"),
        (2, 1, (2, 30, 0), "multi_rank"),
        (3, 2, (2, 31, 1), "multi_rank"),
        (2, 1, (3, 0, 0), "multi_rank"),
        (2, 2, (2, 28, 9), "per_gpu"),
        (3, 8, None, "per_gpu"),
        (1, 1, (2, 28, 9), "per_gpu"),
    ],
)
def test_mode_for_gpus_and_version(world, gpus, version, mode):
    assert nccl_mode(world, gpus, version) == mode


def test_a_forced_mode_wins_and_a_bad_one_is_named():
    assert nccl_mode(2, 8, (2, 28, 9), forced="hostid") == "hostid"
    assert nccl_mode(2, 1, None, forced="") == "hostid"
    with pytest.raises(ValueError, match="CUDARECV_NCCL_MODE.*'shared'"):
        nccl_mode(2, 1, None, forced="shared")
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        nccl_mode(0, 1, None)


def test_env_of_each_mode():
    envs = [nccl_rank_env("hostid", rank) for rank in range(3)]
    assert len({env["NCCL_HOSTID"] for env in envs}) == 3
    for env in envs:
        assert env["NCCL_SOCKET_IFNAME"] == "lo"
        assert env["NCCL_IB_DISABLE"] == "1"
        assert env["NCCL_MNNVL_ENABLE"] == "0"
        assert "NCCL_MULTI_RANK_GPU_ENABLE" not in env
    assert nccl_rank_env("multi_rank", 1) == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    assert nccl_rank_env("per_gpu", 1) == {}


def test_nccl_ranks_composes_a_callers_rank_env_after_its_own():
    ranks = nccl_ranks(2, mode="hostid", rank_env=lambda rank: {"NCCL_SOCKET_IFNAME": f"if{rank}"})
    rank_env = ranks.cluster_kwargs["rank_env"]
    assert rank_env(1)["NCCL_SOCKET_IFNAME"] == "if1"
    assert rank_env(1)["NCCL_HOSTID"] != rank_env(0)["NCCL_HOSTID"]
    with pytest.raises(ValueError, match="backend must be 'nccl'"):
        nccl_ranks(2, backend="gloo")


@pytest.mark.parametrize(
    ("code", "version"),
    [(22809, (2, 28, 9)), (23001, (2, 30, 1)), (2804, (2, 8, 4)), (2708, (2, 7, 8))],
)
def test_decode_version_codes(code, version):
    assert decode_nccl_version(code) == version


def test_decode_refuses_a_non_code():
    with pytest.raises(ValueError, match="code must be"):
        decode_nccl_version(0)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_runtime_version_asks_the_library(tmp_path, monkeypatch):
    """A stand-in libnccl whose ncclGetVersion says 2.28.9: the probe loads it and decodes that."""
    source = tmp_path / "nccl.c"
    source.write_text("int ncclGetVersion(int *version) { *version = 22809; return 0; }\n")
    lib = tmp_path / "libnccl.so.2"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(lib), str(source)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    monkeypatch.setattr(gpu, "nccl_library_paths", lambda: [str(tmp_path / "absent.so"), str(lib)])
    assert nccl_runtime_version() == (2, 28, 9)


def test_runtime_version_is_none_without_nccl():
    """In a fresh process (this one may hold the stand-in above): None where torch has no NCCL and
    no libnccl is found; (2, x, y) where there is one."""
    probe = (
        "import torch.distributed as dist\n"
        "from cudarecv.testing.gpu import nccl_runtime_version, nccl_library_paths\n"
        "print(dist.is_nccl_available(), bool(nccl_library_paths()), nccl_runtime_version())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    has_nccl, has_lib, version = done.stdout.split(maxsplit=2)
    if has_nccl == "False" and has_lib == "False":
        assert version.strip() == "None"
    else:
        assert version.startswith("(2, "), done.stdout


def test_problem_says_why_not_here():
    problem = nccl_ranks_problem(2)
    if not dist.is_nccl_available():
        assert problem == "torch.distributed has no NCCL backend in this build"


def _smoke():
    """bench/nccl_smoke.py, the torch-only NCCL check of bench/gpu_check.sh."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "nccl_smoke.py"
    spec = importlib.util.spec_from_file_location("nccl_smoke", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_smoke_check_gives_its_ranks_what_nccl_ranks_gives():
    smoke = _smoke()
    for rank in range(3):
        assert smoke.rank_env(rank) == nccl_rank_env("hostid", rank)


def test_the_smoke_pair_runs_two_processes_each_its_own_host(tmp_path):
    """The pair check's machinery (processes, store, per-rank environment, logs) over gloo."""
    smoke = _smoke()
    done = subprocess.run(
        [sys.executable, smoke.__file__, "pair", "--backend", "gloo", "--logs", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pair: ok" in done.stdout
    for rank in range(2):
        log = (tmp_path / f"nccl-pair-rank{rank}.log").read_text()
        assert f"NCCL_HOSTID=cudarecv-rank-{rank} NCCL_SOCKET_IFNAME=lo" in log, log
        assert f"rank {rank}: init" in log and log.rstrip().endswith("; ok"), log


def test_the_smoke_checks_fail_cleanly_without_nccl(tmp_path):
    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL")
    smoke = _smoke()
    for what in (["self"], ["pair", "--logs", str(tmp_path)]):
        done = subprocess.run(
            [sys.executable, smoke.__file__, *what], capture_output=True, text=True, timeout=120
        )
        assert (
            done.returncode == 1 and "FAILED: torch.distributed has no NCCL backend" in done.stdout
        )


@pytest.fixture
def lent_machine(monkeypatch):
    """This process as the lent machine sees it: NCCL in torch, one GPU, NCCL 2.28.9 loaded."""
    import torch

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu, "nccl_runtime_version", lambda: (2, 28, 9))
    monkeypatch.delenv(gpu.MODE_ENV, raising=False)


def test_on_the_lent_machine_ranks_share_the_gpu_by_hostid(lent_machine, monkeypatch):
    assert nccl_ranks_problem(2) is None and nccl_ranks_problem(3) is None
    ranks = nccl_ranks(3, pg_timeout=5.0)
    assert ranks.mode == "hostid"
    hosts = {ranks.cluster_kwargs["rank_env"](rank)["NCCL_HOSTID"] for rank in range(3)}
    assert len(hosts) == 3
    assert "2 NCCL ranks need 2 GPUs (this machine: 1)" in nccl_ranks_problem(2, mode="per_gpu")
    assert "NCCL >= 2.30" in nccl_ranks_problem(2, mode="multi_rank")
    monkeypatch.setenv(gpu.MODE_ENV, "multi_rank")
    assert "the NCCL loaded here is (2, 28, 9)" in nccl_ranks_problem(2)
    monkeypatch.setenv(gpu.MODE_ENV, "bogus")
    assert "CUDARECV_NCCL_MODE" in nccl_ranks_problem(2)
