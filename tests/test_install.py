"""install()/uninstall()/installed(): cudarecv as the methods of every tensordict and tensorclass."""

from __future__ import annotations

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

import cudarecv
from cudarecv.p2p.stock import Stock
from tdfactory import STRUCTURES, make, same

NAMES = ("isend", "irecv", "send", "recv")


@pytest.fixture(autouse=True)
def _restore():
    yield
    cudarecv.uninstall()


def test_install_is_idempotent_and_reversible():
    before = {n: vars(TensorDictBase).get(n) for n in NAMES}
    assert not cudarecv.is_installed()
    cudarecv.install()
    cudarecv.install()
    assert cudarecv.is_installed()
    for name in NAMES:
        method = getattr(TensorDict, name)
        assert getattr(method, "__cudarecv__", False) and method.__wrapped__ is getattr(
            cudarecv, name
        )
        assert getattr(LazyStackedTensorDict, name) is method
    cudarecv.uninstall()
    cudarecv.uninstall()
    assert not cudarecv.is_installed()
    assert {n: vars(TensorDictBase).get(n) for n in NAMES} == before
    for name in NAMES:
        assert getattr(TensorDict, name) is getattr(Stock, name)


def test_stock_stays_stock_while_installed():
    with cudarecv.installed():
        for name in NAMES:
            assert not getattr(getattr(Stock, name), "__cudarecv__", False), name
            assert getattr(TensorDict, name).__stock__ is getattr(Stock, name)


def test_installed_context_manager_restores_previous_state():
    with cudarecv.installed():
        assert cudarecv.is_installed()
    assert not cudarecv.is_installed()
    cudarecv.install()
    with cudarecv.installed():
        pass
    assert cudarecv.is_installed()


def methods_roundtrip(rank, world, group, bucket_bytes):
    """With install(), the plain tensordict/tensorclass methods go through cudarecv (fast wire works)."""
    cudarecv.install()
    try:
        ok = {}
        for structure in STRUCTURES:
            td = make(structure, 4.0 if rank == 0 else 0.0)
            if rank == 0:
                td.send(dst=1, bucket_bytes=bucket_bytes)
                [work] = td.isend(1, bucket_bytes=bucket_bytes, init_tag=100, return_early=True)
                work.wait()
            else:
                td.recv(src=0, bucket_bytes=bucket_bytes)
                first = same(td, make(structure, 4.0))
                td.apply_(torch.zeros_like)
                for f in td.irecv(
                    0, bucket_bytes=bucket_bytes, init_tag=100, return_premature=True
                ):
                    f.wait()
                ok[structure] = first and same(td, make(structure, 4.0))
        return ok
    finally:
        cudarecv.uninstall()


@pytest.mark.parametrize("bucket_bytes", [None, 24])
def test_methods_route_through_cudarecv(cluster, bucket_bytes):
    _, ok = cluster().run(methods_roundtrip, args=(bucket_bytes,))
    assert ok and all(ok.values()), ok


def test_tensorclass_method_is_cudarecv():
    tc = make("tensorclass", 0.0)
    cudarecv.install()
    with pytest.raises(ValueError, match="`bucket_bytes` must be a positive int"):
        tc.irecv(src=0, bucket_bytes=0)  # a stock method would not know bucket_bytes


def test_public_api_resolves():
    import cudarecv as package

    assert sorted(package.__all__) == sorted(package._EXPORTS)
    for name in package.__all__:
        assert getattr(package, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr(package, "nope")  # noqa: B009 - the attribute access is what is tested
