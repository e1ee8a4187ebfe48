"""``verify=True``'s digest: BLAKE3-128, on the host (the ``blake3`` package) and on the GPU
(``cudarecv/kernels/blake3.cu``, whose logic is built and run on the host here)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch

from cudarecv.cuda import kernels as _kernels
from cudarecv.cuda.digest import (
    KERNEL_FILE,
    MAX_RUNS,
    digest,
    digest_parts_pending,
    plan,
    prepare,
    workspace_bytes,
)
from cudarecv.weights.wire import checksum

ROOT = Path(__file__).resolve().parents[1]
SIZES = [
    0,
    1,
    63,
    64,
    65,
    1023,
    1024,
    1025,
    2048,
    2049,
    3072,
    5000,
    1 << 16,
    (1 << 16) + 7,
    1 << 20,
    3_000_001,
]


def _random(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("n", SIZES)
def test_host_digest_is_blake3(n):
    data = _random(n)
    assert digest(data) == blake3.blake3(data.numpy().tobytes()).digest(16)
    assert checksum([data], data) == digest(data)
    # a leafwise version's messages, wherever each lies: the digest of their digests, in order
    scattered = [m.clone() for m in data.split(1000)]
    of_digests = blake3.blake3(b"".join(digest(m) for m in scattered)).digest(16)
    assert checksum(scattered) == (of_digests if len(scattered) > 1 else digest(data))
    if len(scattered) > 1:  # any byte, and where the messages are cut, counts
        assert checksum(list(data.split(999))) != checksum(scattered)


def test_every_single_bit_flip_is_caught():
    storage = _random(4096, seed=1)
    reference = checksum([storage], storage)
    flat = storage.numpy()
    missed = []
    for byte in range(flat.size):
        for bit in range(8):
            flat[byte] ^= 1 << bit
            if checksum([storage], storage) == reference:
                missed.append((byte, bit))
            flat[byte] ^= 1 << bit
    assert checksum([storage], storage) == reference
    assert not missed, (
        f"{len(missed)} of 32768 single-bit flips pass as verified, e.g. {missed[:3]}"
    )


def test_digest_refuses_what_is_not_bytes():
    with pytest.raises(ValueError, match="contiguous 1-d uint8"):
        digest(torch.zeros(4))


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """cudarecv/kernels/blake3.cu built for the host (tests/native/blake3_host.cpp replays the launches)."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++ or c++) to build the BLAKE3 kernels for the host")
    out = tmp_path_factory.mktemp("blake3") / "blake3_host.so"
    subprocess.run(
        [
            compiler,
            "-O2",
            "-shared",
            "-fPIC",
            f"-I{ROOT / 'cudarecv' / 'kernels'}",
            "-o",
            str(out),
            str(ROOT / "tests" / "native" / "blake3_host.cpp"),
        ],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(out))
    lib.blake3_host.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p]
    return lib


@pytest.mark.parametrize("n", SIZES)
def test_kernel_tree_matches_blake3(host_kernels, n):
    data = _random(n, seed=n).numpy().tobytes()
    out = ctypes.create_string_buffer(16)
    host_kernels.blake3_host(data, n, MAX_RUNS, out)
    assert out.raw == blake3.blake3(data).digest(16)


@pytest.mark.parametrize("max_runs", [1, 2, 3, 5, 8, 128, 129, 300])
@pytest.mark.parametrize(
    "n",
    [
        1024,
        2048,
        3072,
        5000,
        7 * 1024,
        8 * 1024,
        8 * 1024 + 1,
        33_000,
        1 << 17,
        (1 << 17) + 1,
        300_000,
        1 << 20,
    ],
)
def test_kernel_blocks_and_runs_match_blake3(host_kernels, n, max_runs):
    """A block's runs merged in shared memory, runs of ``per`` chunks a thread (past ``max_runs`` runs): one block
    (which writes the root) or several, a last block or run shorter than the others, every run length."""
    data = _random(n, seed=n + max_runs).numpy().tobytes()
    chunks, per, blocks = plan(n, max_runs)
    runs = -(-chunks // per)
    assert (
        runs <= max_runs
        and per & (per - 1) == 0
        and (per == 1 or -(-chunks // (per // 2)) > max_runs)
    )
    assert blocks == -(-runs // 128)
    out = ctypes.create_string_buffer(16)
    host_kernels.blake3_host(data, n, max_runs, out)
    assert out.raw == blake3.blake3(data).digest(16), (n, max_runs, per)


def test_workspace_is_bounded_whatever_the_size():
    """(Issue 47, item 8: two levels of one chaining value per 1024-byte chunk, 48 bytes a KiB: 4.7% of the bytes
    hashed, 48 MiB for 1 GiB.) One chaining value per block of 128 runs is kept between launches, 48 bytes per
    128 KiB, and at most 1.5 MiB whatever the size."""
    bound = 48 * MAX_RUNS // 128
    assert bound == 3 << 19  # 1.5 MiB
    for n in (0, 1024, 1 << 20, 1 << 30, 80 << 30, 1 << 40, 1 << 50):
        assert workspace_bytes(n) <= bound, n
    assert workspace_bytes(1 << 30) == 48 * 8192  # 384 KiB for 1 GiB (the old layout: 48 MiB)
    assert workspace_bytes(128 << 10) == 0  # one block: its root straight into the result


def test_host_parts_digest_at_once_and_in_order():
    """Messages in host memory: the pending digest is done at once (nothing to wait for) and equals the sync one."""
    parts = [_random(n, seed=n) for n in (5, 4096, 1)]
    pending = digest_parts_pending(parts)
    assert pending.work.is_completed() and pending.work.wait()
    want = blake3.blake3(b"".join(blake3.blake3(p.numpy().tobytes()).digest(16) for p in parts))
    assert pending.value() == want.digest(16) == checksum(parts)
    assert digest_parts_pending([parts[0]]).value() == digest(parts[0])
    assert digest_parts_pending([]).value() == blake3.blake3(b"").digest(16)


def test_prepare_compiles_the_kernels_once_per_device(monkeypatch):
    """``prepare`` (a receiver's construction) builds both kernels of blake3.cu on a CUDA device, once; on the CPU
    (hashed by the blake3 package) nothing. The GPU test checks the real compile (tests/test_gpu_digest_tags.py)."""
    built = []
    monkeypatch.setattr(_kernels, "gpu_available", lambda: True)
    monkeypatch.setattr(
        _kernels, "function", lambda name, kernel, device: built.append((name, kernel, device))
    )
    assert prepare(torch.device("cpu")) is False and prepare("cpu") is False and built == []
    assert prepare(torch.device("cuda", 1)) is True
    assert built == [(KERNEL_FILE, "blake3_blocks", 1), (KERNEL_FILE, "blake3_parents", 1)]

    def broken(name, kernel, device):
        raise RuntimeError("NVRTC is broken here")

    monkeypatch.setattr(
        _kernels, "function", broken
    )  # logged, not raised: raised by a digest that needs it
    assert prepare(torch.device("cuda", 0)) is False


def test_kernel_compiles_with_nvrtc():
    try:
        from cupy.cuda import nvrtc  # noqa: F401
    except Exception as exc:  # cupy missing or unusable: nothing to compile with
        pytest.skip(f"cupy (with NVRTC) cannot be imported: {exc!r}")
    ptx = _kernels.compile_source(
        _kernels.kernel_source(KERNEL_FILE), KERNEL_FILE, arch=_kernels.oldest_arch()
    )
    assert ".entry blake3_blocks" in ptx and ".entry blake3_parents" in ptx


class _FakeCupy(types.ModuleType):
    """What cudarecv.cuda.digest uses of cupy, on the host: arrays are numpy views of the (CPU) tensors, and a
    kernel launch runs every thread of its grid through the host build of blake3.cu (``host_kernels``)."""

    uint8 = np.uint8

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__("cupy")
        self.lib, self.launches = lib, []
        nothing = contextlib.nullcontext
        self.cuda = types.SimpleNamespace(
            Device=lambda i: nothing(), ExternalStream=lambda s: nothing()
        )

    def asarray(self, tensor: torch.Tensor) -> np.ndarray:
        return tensor.numpy()

    def zeros(self, n: int, dtype: object) -> np.ndarray:
        return np.zeros(n, dtype=np.uint8)

    def kernel(self, name: str):
        def launch(grid, block, args):
            assert block == (128,), block  # (BLAKE3_THREADS)
            self.launches.append((name, grid[0]))
            c = [
                a.ctypes.data_as(ctypes.c_void_p)
                if isinstance(a, np.ndarray)
                else ctypes.c_uint64(int(a))
                for a in args
            ]
            # a block of blake3_blocks runs whole (its threads in turn); blake3_parents, thread by thread
            count = grid[0] if name == "blake3_blocks" else grid[0] * block[0]
            getattr(self.lib, f"launch_{name.removeprefix('blake3_')}")(ctypes.c_uint64(count), *c)

        return launch


@pytest.mark.parametrize("max_runs", [1, 3, 64, 200, MAX_RUNS])
def test_device_launches_replayed_on_the_host(host_kernels, monkeypatch, max_runs):
    """cudarecv.cuda.digest's device path (no GPU here: a fake cupy runs its launches through the host build of
    the kernels, a stand-in CUDA its streams): every message's digest lands in its slot of one result vector, the
    chaining values in one workspace reused message after message; no ``.cpu()``, one event for the whole list
    (issue 47, item 8: one launch sequence and one ``.cpu()`` per message before)."""
    from cudarecv.cuda import digest as d

    fake = _FakeCupy(host_kernels)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(d, "MAX_RUNS", max_runs)
    monkeypatch.setattr(d, "_on_device", lambda part, gpu: True)
    monkeypatch.setattr(_kernels, "function", lambda name, kernel, device: fake.kernel(kernel))
    # CUDA stood in for by the CPU: one stream, events that have fired, page-locked memory as plain memory
    stream = types.SimpleNamespace(cuda_stream=0)
    event = types.SimpleNamespace(synchronize=lambda: None, query=lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda s=None: contextlib.nullcontext())
    monkeypatch.setattr(d.streams, "record", lambda s: event)
    parts = [_random(n, seed=n) for n in (0, 1, 1024, 5000, 1 << 16, 3 * 1024 + 1, 400_000)]
    want = blake3.blake3(b"".join(blake3.blake3(p.numpy().tobytes()).digest(16) for p in parts))
    cpu_calls, allocations = [], []
    real_cpu, real_empty = torch.Tensor.cpu, torch.empty

    def counting_empty(*args, pin_memory=False, **kwargs):
        allocations.append(args)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(
        torch.Tensor, "cpu", lambda self, *a, **k: cpu_calls.append(1) or real_cpu(self)
    )
    monkeypatch.setattr(torch, "empty", counting_empty)
    pending = d.digest_parts_pending(parts)
    made = list(allocations)
    assert pending.work.wait()
    assert pending.value() == want.digest(16)
    for part in parts:  # one message: its own digest
        assert d.digest_parts_pending([part]).value() == blake3.blake3(
            part.numpy().tobytes()
        ).digest(16)
    assert cpu_calls == [], cpu_calls
    # the result vector, two workspace levels, the host copy of the results: whatever the number of messages
    assert len(made) == 4, made
    assert sum(1 for name, _ in fake.launches if name == "blake3_blocks") == 2 * len(parts)


def test_a_gpu_receiver_prepares_the_kernels_when_it_is_made(monkeypatch):
    """(Issue 47, item 8: the kernels were compiled by the first digest, inside the first pull that checked one,
    within its timeout.) A receiver's puller on a CUDA device prepares them at construction; on the CPU, not.
    (No GPU here: the puller is made with its device named only; tests/test_gpu_digest_tags.py counts the real
    compiles.)"""
    from cudarecv.cuda import digest as d
    from cudarecv.weights.pulling import Puller
    from cudarecv.weights.schema import Schema

    prepared = []
    monkeypatch.setattr(d, "prepare", lambda device: prepared.append(device) or True)
    schema = Schema.of([("w",)], [torch.zeros(8)])
    slots = types.SimpleNamespace(own=[])
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        Puller(schema, 1 << 20, "sync", device, slots, None, [], False, None, None, None)  # type: ignore[arg-type]
    assert prepared == [torch.device("cuda", 0)]
