"""Shared fixtures: one pair of gloo ranks over loopback for the whole session."""

from __future__ import annotations

import pytest

from cudarecv._launch import Cluster


@pytest.fixture(scope="session")
def cluster():
    """Two spawned ranks (default gloo group + a standalone ProcessGroupGloo).

    A failing call closes the cluster; the next test that needs it starts a new one.
    """
    holder: dict[str, Cluster] = {}

    def get() -> Cluster:
        current = holder.get("c")
        if current is None or current._closed:
            current = holder["c"] = Cluster(2, pg_timeout=20.0)
        return current

    yield get
    if "c" in holder:
        holder["c"].close()
