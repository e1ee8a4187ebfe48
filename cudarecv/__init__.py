"""cudarecv: weight sync for RL, and TensorDict point-to-point transfers over torch.distributed, at wire speed.

Weight sync: a trainer pushes its policy's weights every step, each actor pulls the newest complete, checked
version. The structure travels once (a handshake); every version is then one transfer of bytes, over the wire,
shared memory or CUDA IPC on one machine, or a relay chain across hosts. Mode ``"sync"`` (every actor gets every
version) or ``"latest"`` (a push never waits; each pull gets the newest).

- :class:`WeightSender` / :class:`WeightReceiver`: the ranks of a process group.
- :class:`ElasticSender` / :class:`ElasticReceiver`: actors join and leave at any time through a store, by the
  sender's name (no process group shared by all; a restarted trainer is joined again).
- :class:`ShardedSender` / :class:`ShardedReceiver`: an FSDP2 trainer's DTensor shards, every rank sending what
  it holds, into receivers of any layout (whole, tensor-parallel, or the slices each wants).
- ``Mode``, ``Fanout``, ``TransportPolicy``: the ``Literal`` types of the options ``mode``, ``fanout``, ``transport``.
- Integrations: a TorchRL weight-sync scheme (:mod:`cudarecv.torchrl`) and a vLLM weight-transfer backend
  (:mod:`cudarecv.vllm`).

Example:
    >>> sender = cudarecv.WeightSender(TensorDict.from_module(policy), dst=[1, 2], mode="latest")
    >>> sender.push()                                   # trainer, every step
    >>> receiver = cudarecv.WeightReceiver(src=0, expect=policy)
    >>> receiver.pull(); receiver.load_into(policy)     # each actor, when it likes

Drop-in, wire-compatible versions of tensordict's ``isend/irecv/send/recv``, with cached plans, a native fast
wire (``bucket_bytes``) and fast pseudo-random tags:

    >>> cudarecv.irecv(td, src=0)                       # as td.irecv(src=0)
    >>> cudarecv.recv(td, src=0, bucket_bytes=1 << 20)  # fast wire, both ends
    >>> with cudarecv.installed():                      # or make them the methods
    ...     td.recv(src=0)

The names below load their module on first use, so ``import cudarecv`` (and the pytest plugin it ships) does
not import torch until something needs it.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

# the library's logger stays silent unless the application configures it (see cudarecv.core.log)
logging.getLogger("cudarecv").addHandler(logging.NullHandler())

__version__ = "0.1.0"

_EXPORTS = {
    "irecv": ".p2p.calls",
    "isend": ".p2p.calls",
    "recv": ".p2p.calls",
    "send": ".p2p.calls",
    "Transfer": ".core.transfer",
    "install": ".p2p.install",
    "installed": ".p2p.install",
    "is_installed": ".p2p.install",
    "uninstall": ".p2p.install",
    "tag_sequence": ".plan.tags",
    "WeightSender": ".weights.sender",
    "WeightReceiver": ".weights.receiver",
    "ElasticSender": ".weights.membership.elastic_sender",
    "ElasticReceiver": ".weights.membership.elastic_receiver",
    "ShardedSender": ".weights.sharded.sharded_sender",
    "ShardedReceiver": ".weights.sharded.sharded_receiver",
    "Mode": ".weights.options",
    "Fanout": ".weights.options",
    "TransportPolicy": ".weights.options",
    "Error": ".core.errors",
    "ArgumentError": ".core.errors",
    "ArgumentTypeError": ".core.errors",
    "UsageError": ".core.errors",
    "WaitTimeout": ".core.errors",
    "MismatchError": ".core.errors",
    "HeaderError": ".core.errors",
    "SchemaError": ".core.errors",
    "PushHeaderError": ".core.errors",
    "ChecksumError": ".core.errors",
    "LinkError": ".core.errors",
    "OutOfStepError": ".core.errors",
    "PeerError": ".core.errors",
    "TransferTimeout": ".core.errors",
    "BrokenError": ".core.errors",
    "KernelCompileError": ".core.errors",
    "SenderClosed": ".core.errors",
    "SenderFenced": ".core.errors",
    "StoreError": ".core.errors",
    "StoreRecordError": ".core.errors",
    "ReceiverFailed": ".core.errors",
    "RelayLost": ".core.errors",
}
__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BrokenError",
    "ChecksumError",
    "ElasticReceiver",
    "ElasticSender",
    "Error",
    "Fanout",
    "HeaderError",
    "KernelCompileError",
    "LinkError",
    "MismatchError",
    "Mode",
    "OutOfStepError",
    "PeerError",
    "PushHeaderError",
    "ReceiverFailed",
    "RelayLost",
    "SchemaError",
    "SenderClosed",
    "SenderFenced",
    "ShardedReceiver",
    "ShardedSender",
    "StoreError",
    "StoreRecordError",
    "Transfer",
    "TransferTimeout",
    "TransportPolicy",
    "UsageError",
    "WaitTimeout",
    "WeightReceiver",
    "WeightSender",
    "install",
    "installed",
    "irecv",
    "is_installed",
    "isend",
    "recv",
    "send",
    "tag_sequence",
    "uninstall",
]

if TYPE_CHECKING:
    from .core.errors import (
        ArgumentError,
        ArgumentTypeError,
        BrokenError,
        ChecksumError,
        Error,
        HeaderError,
        KernelCompileError,
        LinkError,
        MismatchError,
        OutOfStepError,
        PeerError,
        PushHeaderError,
        ReceiverFailed,
        RelayLost,
        SchemaError,
        SenderClosed,
        SenderFenced,
        StoreError,
        StoreRecordError,
        TransferTimeout,
        UsageError,
        WaitTimeout,
    )
    from .core.transfer import Transfer
    from .p2p.calls import irecv, isend, recv, send
    from .p2p.install import install, installed, is_installed, uninstall
    from .plan.tags import tag_sequence
    from .weights.membership.elastic_receiver import ElasticReceiver
    from .weights.membership.elastic_sender import ElasticSender
    from .weights.options import Fanout, Mode, TransportPolicy
    from .weights.receiver import WeightReceiver
    from .weights.sender import WeightSender
    from .weights.sharded.sharded_receiver import ShardedReceiver
    from .weights.sharded.sharded_sender import ShardedSender


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cudarecv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
