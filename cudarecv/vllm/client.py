"""The trainer's handle on the engine: vLLM's weight-sync clients as they are (``HTTPVLLMWeightSyncClient`` for
``vllm serve``, ``RayVLLMWeightSyncClient``), and the in-process ``LLM`` object, whose methods take request
objects rather than the plain dicts the clients take."""

from __future__ import annotations

from typing import Any

from .. import ArgumentError

_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


class LLMClient:
    """vLLM's weight-sync client protocol over an ``LLM`` (or ``AsyncLLM``-less, offline) engine object.

    Example:
        >>> client = LLMClient(LLM(model=path, weight_transfer_config={"backend": "cudarecv"}))
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


def as_client(client: Any) -> Any:
    """``client`` as a weight-sync client: an ``LLM`` object is wrapped in :class:`LLMClient`."""
    from vllm import LLM

    if isinstance(client, LLM):
        return LLMClient(client)
    missing = [name for name in _METHODS if not callable(getattr(client, name, None))]
    if missing:
        raise ArgumentError(f"`client` must be vLLM's LLM object or a weight-sync client (HTTPVLLMWeightSyncClient, "
                            f"RayVLLMWeightSyncClient); {type(client).__name__} has no {', '.join(missing)}")
    return client
