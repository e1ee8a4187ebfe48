"""Host copies (cudarecv.core.host_copy): the native copy (streaming or not) and its memmove fallback give the same bytes."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

import cudarecv
from cudarecv.core import host_copy as _host_copy
from cudarecv.core import tuned
from cudarecv.core.host_copy import CopyTable, copy, copy_bytes
from cudarecv.samehost import policy

# around the streaming threshold (256 KiB), its 64-byte alignment and its 16 KiB blocks
SIZES = [
    0,
    1,
    63,
    64,
    4095,
    (256 << 10) - 1,
    256 << 10,
    (256 << 10) + 1,
    (1 << 20) + 16385,
    3 << 20,
]


@pytest.fixture(params=["native stream", "native memcpy", "memmove"])
def implementation(request, monkeypatch):
    if request.param.startswith("native"):
        if not _host_copy.NATIVE:
            pytest.skip(_host_copy.WHY_NOT_NATIVE)
        monkeypatch.setenv(_host_copy.ENV, request.param.split()[1])
        monkeypatch.setattr(
            _host_copy, "STREAMING", None
        )  # chosen again at the next large copy, as told
        yield request.param
        _host_copy._LIB.cudarecv_copy_streaming(0)
        _host_copy.STREAMING = None
    else:
        monkeypatch.setattr(_host_copy, "_LIB", None)
        yield request.param


@pytest.mark.parametrize("shift", [0, 1, 37])
@pytest.mark.parametrize("size", SIZES)
def test_copy_gives_the_same_bytes_and_nothing_past_them(implementation, size, shift):
    src = torch.randint(0, 256, (size + 128,), dtype=torch.uint8)
    dst = torch.full((size + 128,), 0xAB, dtype=torch.uint8)
    copy(dst.data_ptr() + 3, src.data_ptr() + shift, size)
    assert torch.equal(dst[3 : 3 + size], src[shift : shift + size])
    assert bool(
        (dst[:3] == 0xAB).all() and (dst[3 + size :] == 0xAB).all()
    )  # nothing outside is written


def test_copy_bytes_between_tensors(implementation):
    src = torch.arange(300_000, dtype=torch.float32)
    dst = torch.zeros_like(src)
    copy_bytes(dst, src)
    assert torch.equal(dst, src)


def test_a_table_copies_its_runs_of_rows_both_ways(implementation):
    leaves = [torch.randint(1, 256, (n,), dtype=torch.uint8) for n in (5, 8192, 300_000, 1, 70_000)]
    staging = torch.zeros(sum(t.numel() for t in leaves), dtype=torch.uint8)
    rows, at = [], 0
    for t in leaves:
        rows.append((staging.data_ptr() + at, t.data_ptr(), t.numel()))
        at += t.numel()
    pack = CopyTable(rows)
    pack.run(0, 2)
    pack.run(2, len(rows))
    assert torch.equal(staging, torch.cat(leaves))
    originals = [t.clone() for t in leaves]
    for t in leaves:
        t.zero_()
    pack.reversed().run(1, 4)  # rows 1..3 only, back into the leaves
    assert [torch.equal(t, o) for t, o in zip(leaves, originals)] == [
        False,
        True,
        True,
        True,
        False,
    ]


@pytest.fixture
def untuned(tmp_path, monkeypatch):
    """No tune file (an empty cache directory), read afresh."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tuned, "_entry", None)


def test_streaming_is_chosen_once_as_told_or_by_default(monkeypatch, untuned):
    if not _host_copy.NATIVE:
        pytest.skip(_host_copy.WHY_NOT_NATIVE)
    src, dst = torch.ones(1 << 20, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
    with open("/proc/cpuinfo") as f:
        avx2 = " avx2 " in f.read().replace("\n", " ")  # streaming is for AVX2 machines only
    try:
        default = avx2 and _host_copy.DEFAULT_HOST_COPY == "stream"
        for told, expect in [
            ("stream", avx2),
            ("memcpy", False),
            ("auto", default),
        ]:  # auto, untuned: the default
            monkeypatch.setenv(_host_copy.ENV, told)
            monkeypatch.setattr(_host_copy, "STREAMING", None)
            copy_bytes(dst[:100], src[:100])  # a small copy chooses nothing
            assert _host_copy.STREAMING is None
            copy_bytes(dst, src)
            assert torch.equal(dst, src) and _host_copy.STREAMING is expect
            dst.zero_()
        monkeypatch.setenv(_host_copy.ENV, "fastest")
        monkeypatch.setattr(_host_copy, "STREAMING", None)
        with pytest.raises(cudarecv.ArgumentError, match="CUDARECV_HOST_COPY"):
            copy_bytes(dst, src)
    finally:
        _host_copy._LIB.cudarecv_copy_streaming(0)
        _host_copy.STREAMING = None


def test_the_direct_read_is_chosen_as_told_or_by_default(monkeypatch, untuned):
    monkeypatch.setattr(_host_copy, "DIRECT_PAYS", None)
    for told, expect in [("on", True), ("off", False)]:
        monkeypatch.setenv(_host_copy.DIRECT_ENV, told)
        assert _host_copy.direct_read_pays() == _host_copy.DirectRead(
            leaves=expect, storages=expect
        )
        assert _host_copy.DIRECT_PAYS is None  # told: read again at each offer
    monkeypatch.delenv(_host_copy.DIRECT_ENV)
    assert _host_copy.direct_read_pays() is _host_copy.DIRECT_PAYS == _host_copy.DEFAULT_DIRECT_READ
    other = _host_copy.DirectRead(True, True)
    monkeypatch.setattr(_host_copy, "DIRECT_PAYS", other)  # kept, never chosen again
    assert _host_copy.direct_read_pays() is other
    monkeypatch.setenv(_host_copy.DIRECT_ENV, "always")
    with pytest.raises(cudarecv.ArgumentError, match="CUDARECV_DIRECT_READ"):
        policy.allowed("auto")  # checked before a transfer sends anything


def test_a_direct_read_stops_at_the_first_region_not_mapped():
    if _host_copy.may_read_process(os.getpid()) is not None:
        pytest.skip(_host_copy.may_read_process(os.getpid()))
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    local = np.array([[dst.data_ptr(), 32], [dst.data_ptr() + 32, 32]], dtype=np.uint64)
    remote = np.array([[src.data_ptr(), 32], [8, 32]], dtype=np.uint64)  # (address 8: never mapped)
    assert _host_copy.read_process(os.getpid(), local, remote) == 32
    assert dst[:32].equal(src[:32]) and not dst[32:].any()
    remote[0, 0] = 8  # the first region: no bytes at all, not an error
    assert _host_copy.read_process(os.getpid(), local, remote) == 0


@pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine"
)
def test_native_copies_are_built_where_a_compiler_is():
    assert _host_copy.NATIVE, _host_copy.WHY_NOT_NATIVE


def test_a_native_build_older_than_the_source_is_not_used_and_says_rebuild(monkeypatch):
    """A build that lacks a function this source calls (the package updated without its build step) falls back
    to memmove with a reason naming what is missing, instead of failing ``import cudarecv``."""
    if _host_copy._LIB is None:
        pytest.skip(f"no native build here: {_host_copy.WHY_NOT_NATIVE}")

    class Older:
        def __getattr__(self, name: str):
            if name == "cudarecv_bump":
                raise AttributeError(name)
            return getattr(_host_copy._LIB, name)

    monkeypatch.setattr(_host_copy.ctypes, "CDLL", lambda path: Older())
    lib, why = _host_copy._load()
    assert lib is None and why is not None
    assert "cudarecv_bump" in why and "rebuild" in why
