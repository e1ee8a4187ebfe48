"""Weight sync: a receiver's refusal reaches its sender. A receiver whose environment is invalid raises
``ArgumentError`` naming the variable and answers the handshake with it, so the sender raises
``ReceiverFailed`` naming it too, at once instead of after its timeout.
"""

from __future__ import annotations

import os

import pytest
import torch
from tensordict import TensorDict

import cudarecv


def bad_environment(rank, world, group, name, value):
    td = TensorDict(w=torch.zeros(64))
    if rank == 0:
        try:
            cudarecv.WeightSender(td, dst=1, timeout=60)
        except cudarecv.Error as error:
            return type(error).__name__, str(error)
        return "no error", ""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        cudarecv.WeightReceiver(src=0, timeout=60)
    except cudarecv.Error as error:
        return type(error).__name__, str(error)
    finally:  # (the rank's process runs the next tests)
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
    return "no error", ""


@pytest.mark.parametrize(
    "name, value", [("CUDARECV_TRANSPORT", "shm"), ("CUDARECV_DIRECT_READ", "maybe")]
)
def test_a_receivers_bad_environment_reaches_the_sender(cluster, name, value):
    (sent, said), (received, why) = cluster().run(bad_environment, args=(name, value), timeout=100)
    assert received == "ArgumentError" and name in why, (received, why)
    assert sent == "ReceiverFailed" and name in said and "rank 1" in said, (sent, said)
