"""TorchRL weight sync over cudarecv: :class:`CudarecvWeightSyncScheme`, the ``"cudarecv"`` backend.

TorchRL's collectors push policy weights to their workers through pluggable
weight-sync schemes. This one carries them with :class:`~cudarecv.WeightSender`
and :class:`~cudarecv.WeightReceiver` on a process group of its own (gloo, on a
store the trainer opens; the user's default group is never touched): one schema
handshake when the collector starts, then one consolidated transfer per
``update_policy_weights_()`` (through shared memory when a worker is on the
trainer's machine), versioned and bounded by ``timeout`` everywhere.

Versions stay whole. A worker's policy always holds one complete version: each
version lands in a buffer the policy does not use, then the policy's tensors are
switched to it between two of its forward calls (no copy, no forward sees half
of a version). In ``MultiAsyncCollector`` a batch may hold frames of two
consecutive versions (the switch happens between two steps of a rollout); each
frame is acted with one.

- ``sync=True`` (the default): ``update_policy_weights_()`` returns once every
  worker acts with the new version; a worker that died or stopped answering is
  named in the error within ``timeout``.
- ``sync=False``: ``update_policy_weights_()`` snapshots the weights and returns
  at once; each worker switches to the newest version as soon as it has landed,
  and a slow worker skips the ones it missed (the trainer never waits for it).

Importing this module registers the scheme with TorchRL, so
``WeightSyncScheme.from_backend("cudarecv", ...)`` finds it. It needs the
``torchrl`` extra (``pip install "cudarecv[torchrl]"``).

Example:
    >>> from cudarecv.torchrl import CudarecvWeightSyncScheme
    >>> collector = MultiSyncCollector([make_env, make_env], policy, frames_per_batch=200, total_frames=-1,
    ...                                weight_sync_schemes={"policy": CudarecvWeightSyncScheme()})
    >>> for batch in collector:
    ...     train(policy, batch)
    ...     collector.update_policy_weights_()  # every worker acts with the new weights from here on
"""

from __future__ import annotations

from .scheme import BACKEND, CudarecvWeightSyncScheme

__all__ = ["BACKEND", "CudarecvWeightSyncScheme"]
