"""Shared fixtures: one pair of gloo ranks over loopback for the whole session."""

from __future__ import annotations

import pytest

from cudarecv.testing.launch import Ranks


@pytest.fixture(scope="session")
def cluster():
    """Two spawned ranks (default gloo group + a standalone ProcessGroupGloo).

    A failing call closes the cluster; the next test that needs it starts a new one.
    """
    ranks = Ranks(2, pg_timeout=20.0)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def four():
    """Four spawned ranks (a trainer and three actors), restarted after a failure closed them."""
    ranks = Ranks(4, pg_timeout=30.0)
    yield ranks
    ranks.close()
