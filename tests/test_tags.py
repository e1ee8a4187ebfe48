"""Pseudo-random p2p tags: bit-exact with tensordict's ``_int_generator``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from cudarecv.p2p.stock import int_generator as _int_generator

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # source checkout without pip install
    sys.path.insert(0, str(ROOT))

from cudarecv.cuda import kernels  # noqa: E402
from cudarecv.cuda import tag_kernel as _tag_kernel  # noqa: E402
from cudarecv.plan.tags import MAX_TAG, int_generator_many, tag_map, tag_sequence  # noqa: E402

LARGE_SEEDS = [
    2**32 - 1,
    2**32,
    2**33 + 7,
    2**63,
    2**64 - 1,
    2**64 + 5,
    2**100 + 3,
    2**128 - 1,
    2**128,
    2**160 + 9,
    2**300 + 1,
    12345678901234567890,
]


@pytest.fixture(scope="module")
def stock_map() -> list[int]:
    return [_int_generator(s) for s in range(MAX_TAG + 1)]


def stock_chain(init_tag: int, n: int) -> list[int]:
    """The tags tensordict's ``_send``/``_recv`` use with ``pseudo_rand=True``."""
    tag, out = init_tag - 1, []
    for _ in range(n):
        tag = _int_generator(tag + 1)
        out.append(tag)
    return out


def test_int_generator_many_whole_domain(stock_map: list[int]) -> None:
    got = int_generator_many(range(MAX_TAG + 1))
    assert got.dtype == np.int64
    assert got.tolist() == stock_map
    assert int_generator_many(np.arange(MAX_TAG + 1, dtype=np.uint32)).tolist() == stock_map


def test_int_generator_many_large_seeds() -> None:
    expected = [_int_generator(s) for s in LARGE_SEEDS]
    assert int_generator_many(LARGE_SEEDS).tolist() == expected
    # Mixed sizes in one call, and uint64 arrays.
    mixed = [0, *LARGE_SEEDS, 7]
    assert int_generator_many(mixed).tolist() == [_int_generator(s) for s in mixed]
    u64 = np.array([2**64 - 1, 2**63, 2**32, 5], dtype=np.uint64)
    assert int_generator_many(u64).tolist() == [_int_generator(int(s)) for s in u64]
    assert int_generator_many([]).shape == (0,)


def test_int_generator_many_rejects_bad_seeds() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        int_generator_many([3, -1])
    with pytest.raises(ValueError, match="non-negative"):
        int_generator_many(np.array([-2]))
    with pytest.raises(TypeError, match="integers"):
        int_generator_many([1.5])
    with pytest.raises(TypeError, match="integers"):
        int_generator_many(np.array([True]))


def test_tag_map(stock_map: list[int]) -> None:
    m = tag_map()
    assert m is tag_map()
    assert m.dtype == np.int64 and m.shape == (MAX_TAG + 1,)
    assert not m.flags.writeable
    assert m.tolist() == stock_map


@pytest.mark.parametrize("init_tag", [0, 1, 9999, 10000, 123456, 2**40])
@pytest.mark.parametrize("n", [0, 1, 500])
def test_tag_sequence_pseudo_rand_matches_stock(init_tag: int, n: int) -> None:
    got = tag_sequence(init_tag, n, pseudo_rand=True)
    assert got.dtype == np.int64
    assert got.tolist() == stock_chain(init_tag, n)


def test_tag_sequence_long_chain_tiles_cycle() -> None:
    n = 3000  # well past the cycle (~107 distinct tags from 0)
    for init_tag in (0, 2**70 + 1):
        assert tag_sequence(init_tag, n, pseudo_rand=True).tolist() == stock_chain(init_tag, n)
    seq = tag_sequence(0, 100_000, pseudo_rand=True)
    assert seq.shape == (100_000,) and seq.flags.writeable
    assert seq.min() >= 0 and seq.max() < MAX_TAG


@pytest.mark.parametrize("init_tag", [0, 7, -3, 2**40])
@pytest.mark.parametrize("n", [0, 1, 500])
def test_tag_sequence_sequential(init_tag: int, n: int) -> None:
    got = tag_sequence(init_tag, n)
    assert got.dtype == np.int64
    assert got.tolist() == list(range(init_tag, init_tag + n))


def test_tag_sequence_validation() -> None:
    with pytest.raises(TypeError, match="init_tag must be an int"):
        tag_sequence(True, 3)
    with pytest.raises(TypeError, match="init_tag must be an int"):
        tag_sequence(1.0, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="n must be an int"):
        tag_sequence(0, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be >= 0"):
        tag_sequence(0, -1)
    with pytest.raises(
        ValueError,
        match=r"init_tag must be >= 0 with pseudo_rand=True: numpy seeds are non-negative",
    ):
        tag_sequence(-1, 3, pseudo_rand=True)
    with pytest.raises(ValueError, match="outside int64"):
        tag_sequence(2**63, 1)
    # Stock tensordict fails the same way on a negative pseudo-random seed.
    with pytest.raises(ValueError):
        _int_generator(-1)


def test_nvrtc_compiles_kernel() -> None:
    try:
        from cupy.cuda import nvrtc  # noqa: F401
    except Exception as exc:  # cupy missing or unusable: nothing to compile with
        pytest.skip(f"cupy (with NVRTC) cannot be imported: {exc!r}")
    ptx = _tag_kernel.compile_ptx(arch=kernels.oldest_arch())
    assert ".entry int_generator_range" in ptx
    assert ".entry int_generator_seeds" in ptx


def test_nvrtc_error_carries_log(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        from cupy.cuda import nvrtc  # noqa: F401
    except Exception as exc:
        pytest.skip(f"cupy (with NVRTC) cannot be imported: {exc!r}")
    monkeypatch.setattr(
        _tag_kernel, "kernel_source", lambda: 'extern "C" __global__ void f(int *x) { x[0] = 1 }'
    )
    with pytest.raises(
        _tag_kernel.KernelCompileError, match=r"(?s)NVRTC failed to compile.*error: expected a"
    ):
        _tag_kernel.compile_ptx()


@pytest.mark.gpus(1)
def test_tag_map_gpu(request: pytest.FixtureRequest) -> None:
    try:
        plugin_active = request.config.getoption("cudarecv_gpus") is not None
    except ValueError:
        plugin_active = False
    if not plugin_active and not _tag_kernel.gpu_available():
        pytest.skip("no CUDA GPU visible to cupy (and the gpus marker plugin is not loaded)")
    assert _tag_kernel.gpu_available()
    got = _tag_kernel.tag_map_gpu()
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, tag_map())
    micros = _tag_kernel.time_tag_map_gpu(repeats=50)
    assert micros < 100, f"tag map kernel took {micros:.1f} us per launch"
