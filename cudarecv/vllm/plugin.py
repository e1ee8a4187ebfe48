"""The ``"cudarecv"`` backend registered with vLLM, in every process that asks: vLLM's own processes (engine
core, workers, API server) through its ``vllm.general_plugins`` entry point, the trainer by importing
:mod:`cudarecv.vllm`. Registering twice is harmless."""

from __future__ import annotations

from .info import BACKEND


def register() -> None:
    """Register both sides of the backend (the worker's lazily: vLLM imports it when an engine is built)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, module, name in (
        (WeightTransferEngineFactory, "cudarecv.vllm.worker", "CudarecvWeightTransferEngine"),
        (WeightTransferTrainerFactory, "cudarecv.vllm.trainer", "CudarecvTrainerEngine"),
    ):
        if BACKEND not in factory._registry:
            factory.register_engine(BACKEND, module, name)
