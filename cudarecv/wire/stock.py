"""The stock tensordict wire: one message per leaf with its tag, or one consolidated message.

What goes over the wire here is byte for byte what tensordict 0.15.3 sends, so
either end can be a stock peer. A call's per-leaf messages are posted together: on NCCL as one batch
where :func:`~cudarecv.core.transport.nccl_batching` says (a stock peer posts one op per leaf: set
``CUDARECV_NCCL_BATCH=0`` on the cudarecv end), the consolidated message as a single op, as stock posts it;
memory the wire cannot touch is staged (:mod:`cudarecv.wire.staging`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ..core.protocol import Protocol
from ..core.transport import nccl_batching
from ..plan.plan import Plan
from .staging import Lane, recv_into, send_from

CONSOLIDATED_TAG = 0  # stock sends the consolidated storage with tag 0


def _full_staging(lane: Lane, plan: Plan) -> list[Tensor] | None:
    # gloo with CUDA leaves: every leaf's message lands in one pinned buffer
    if not lane.nccl and plan.device.type == "cuda":
        return plan.staging_parts("pinned")
    return None


def send_leaves(lane: Lane, plan: Plan, tags: Sequence[int]) -> Protocol:
    lane.batched = lane.nccl and nccl_batching(
        lane.link
    )  # (a leaf per message, as one batch where agreed)
    yield from send_from(lane, plan.tensors, tags, staging=_full_staging(lane, plan))
    return None


def recv_leaves(lane: Lane, plan: Plan, tags: Sequence[int], result: Any) -> Protocol:
    lane.batched = lane.nccl and nccl_batching(lane.link)
    yield from recv_into(lane, plan.tensors, tags, staging=_full_staging(lane, plan))
    return result


def send_storage(lane: Lane, storage: Tensor) -> Protocol:
    yield from send_from(lane, [storage], [CONSOLIDATED_TAG])
    return None


def recv_storage(lane: Lane, storage: Tensor, result: Any) -> Protocol:
    yield from recv_into(lane, [storage], [CONSOLIDATED_TAG])
    return result
