"""The trainer's handle on the engine: vLLM's weight-sync clients as they are (``HTTPVLLMWeightSyncClient`` for
``vllm serve``, ``RayVLLMWeightSyncClient``), and the in-process ``LLM`` object, whose methods take request
objects rather than the plain dicts the clients take."""

from __future__ import annotations

from typing import Any

from .. import ArgumentError, ReceiverFailed

_METHODS = (
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
)


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

    def pause(self, mode: str) -> bool:
        """Nothing to pause: an ``LLM`` object generates and updates on its caller's thread, never at once."""
        return False

    def resume(self) -> None:
        """(Nothing was paused.)"""


class SpokenClient:
    """A weight-sync client whose errors say what the engine said: ``HTTPVLLMWeightSyncClient`` raises
    ``requests.HTTPError`` ("500 Server Error"), with the engine's own message only in the response's body; here
    such an error becomes :class:`~cudarecv.ReceiverFailed` with that message (the HTTP error its cause)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.client, name)
        if name not in _METHODS + ("shutdown_weight_transfer_engine",):
            return call

        def spoken(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            except Exception as error:
                said = engine_message(error)
                if said is None:
                    raise
                raise ReceiverFailed(f"the vLLM engine refused {name}: {said}") from error

        return spoken

    def pause(self, mode: str) -> bool:
        """Pause the engine's scheduler in vLLM's pause ``mode`` (``"keep"``: requests in flight are frozen, none
        aborted; ``"wait"``: they finish first; ``"abort"``), so that no step runs until :meth:`resume`:
        ``POST /pause?mode=...`` of ``vllm serve``, ``pause_generation`` of each Ray actor. Whether it paused
        (False: a client this module does not know how to pause)."""
        client = self.client
        base_url = getattr(client, "base_url", None)
        handles = getattr(client, "handles", None)
        if isinstance(base_url, str):
            _post(client, "pause", {"mode": mode})
            return True
        if isinstance(handles, list):
            import ray

            ray.get([h.pause_generation.remote(mode=mode) for h in handles])
            return True
        return False

    def resume(self) -> None:
        """Undo :meth:`pause` (also harmless on an engine that is not paused)."""
        client = self.client
        if isinstance(getattr(client, "base_url", None), str):
            _post(client, "resume", None)
        elif isinstance(getattr(client, "handles", None), list):
            import ray

            ray.get([h.resume_generation.remote() for h in client.handles])


def _post(client: Any, path: str, params: dict[str, str] | None) -> None:
    """A POST of ``vllm serve``'s control endpoints (``/pause``, ``/resume``), bounded by the client's timeout; the
    engine's words on an error, as for the weight-sync calls."""
    import requests

    answer = requests.post(
        f"{client.base_url.rstrip('/')}/{path}", params=params, timeout=client.timeout
    )
    try:
        answer.raise_for_status()
    except requests.HTTPError as error:
        raise ReceiverFailed(f"the vLLM engine refused {path}: {engine_message(error)}") from error


def engine_message(error: BaseException) -> str | None:
    """The engine's own words in an HTTP error's response (vLLM's ``{"error": {"message": ...}}``, else the body),
    or None for an error with no response."""
    response = getattr(error, "response", None)
    if response is None:
        return None
    status = getattr(response, "status_code", "?")
    try:
        said = response.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - not vLLM's JSON error: the body as it is
        said = getattr(response, "text", "") or str(error)
    return f"HTTP {status}: {said}"


def as_client(client: Any) -> Any:
    """``client`` as a weight-sync client: an ``LLM`` object is wrapped in :class:`LLMClient`, any other client in
    :class:`SpokenClient` (its errors then carry the engine's words)."""
    from vllm import LLM

    if isinstance(client, LLM):
        return LLMClient(client)
    missing = [name for name in _METHODS if not callable(getattr(client, name, None))]
    if missing:
        raise ArgumentError(
            f"`client` must be vLLM's LLM object or a weight-sync client (HTTPVLLMWeightSyncClient, "
            f"RayVLLMWeightSyncClient); {type(client).__name__} has no {', '.join(missing)}"
        )
    return SpokenClient(client)
