"""``verify=True``'s digest: BLAKE3-128, on the host (the ``blake3`` package) and on the GPU
(``cudarecv/kernels/blake3.cu``, whose logic is built and run on the host here)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import blake3
import pytest
import torch

from cudarecv.cuda import kernels as _kernels
from cudarecv.cuda.digest import KERNEL_FILE, digest
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
    lib.blake3_host.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_char_p]
    return lib


@pytest.mark.parametrize("n", SIZES)
def test_kernel_tree_matches_blake3(host_kernels, n):
    data = _random(n, seed=n).numpy().tobytes()
    out = ctypes.create_string_buffer(16)
    host_kernels.blake3_host(data, n, out)
    assert out.raw == blake3.blake3(data).digest(16)


def test_kernel_compiles_with_nvrtc():
    try:
        from cupy.cuda import nvrtc  # noqa: F401
    except Exception as exc:  # cupy missing or unusable: nothing to compile with
        pytest.skip(f"cupy (with NVRTC) cannot be imported: {exc!r}")
    ptx = _kernels.compile_source(
        _kernels.kernel_source(KERNEL_FILE), KERNEL_FILE, arch=_kernels.oldest_arch()
    )
    assert ".entry blake3_chunks" in ptx and ".entry blake3_parents" in ptx
