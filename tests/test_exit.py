"""Ranks exit normally, and the test kit says when one does not (cudarecv/testing/launch.py)."""

from __future__ import annotations

import atexit
import os
import signal
import threading

import pytest

from cudarecv.testing.launch import Cluster, RankError, RankExit


def abort_at_exit(rank, world, group, who):
    """Rank ``who`` aborts during interpreter shutdown, as a C++ thread's ``std::terminate`` would."""
    if rank == who:
        atexit.register(os.abort)
    return rank


def hang_at_exit(rank, world, group, who):
    """Rank ``who`` leaves a non-daemon thread running, which interpreter shutdown waits for."""
    if rank == who:
        threading.Thread(
            target=threading.Event().wait, args=(120,), name="test-hang-at-exit"
        ).start()
    return rank


def raise_and_abort_at_exit(rank, world, group):
    if rank == 1:
        atexit.register(os.abort)
        raise ValueError("the call fails on rank 1")
    return rank


def killed(rank, world, group):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_an_abort_at_exit_fails_close_naming_the_rank_and_signal():
    cluster = Cluster(2, pg_timeout=20.0)
    assert cluster.run(abort_at_exit, args=(1,)) == [0, 1]  # the call itself went well
    with pytest.raises(RankError, match=r"rank 1 was killed by SIGABRT \(signal 6\)") as caught:
        cluster.close()
    assert "rank 0" not in str(caught.value)
    cluster.close()  # closed once: a second close has nothing to say


def test_a_rank_that_does_not_exit_is_killed_and_named():
    cluster = Cluster(2, pg_timeout=20.0, exit_timeout=5.0)
    cluster.run(hang_at_exit, args=(0,))
    with pytest.raises(RankError, match=r"rank 0 did not exit within 5 s \(killed\)"):
        cluster.close()


def test_a_failed_call_notes_how_the_ranks_exited():
    cluster = Cluster(2, pg_timeout=20.0)
    with pytest.raises(RankError, match="rank 1 raised") as caught:
        cluster.run(raise_and_abort_at_exit)
    assert "ValueError: the call fails on rank 1" in str(caught.value)
    assert str(caught.value).splitlines()[-1] == "at exit: rank 1 was killed by SIGABRT (signal 6)"


def test_a_rank_killed_on_purpose_is_its_result_and_the_others_exit_normally():
    cluster = Cluster(2, pg_timeout=20.0)
    results = cluster.run(killed, may_die={1})
    assert results[0] == 0 and isinstance(results[1], RankExit) and results[1] == -signal.SIGKILL
    cluster.close()  # already closed by run(), which checked rank 0's exit
