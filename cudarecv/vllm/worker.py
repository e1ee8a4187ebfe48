"""The vLLM worker's side: :class:`CudarecvWeightTransferEngine`, one per worker process, a
:class:`~cudarecv.WeightReceiver` on a gloo group of its own with the trainer.

A version is received whole (every leaf, checked) into the receiver's own buffers before the model is touched:
only then are the weights loaded (vLLM's layer-wise reload, inside ``update_weights``). A transfer that fails
or times out leaves the model serving the previous version."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from .. import UsageError, WeightReceiver
from .info import CudarecvInitInfo, CudarecvUpdateInfo
from .rendezvous import group_of, member_key, seconds

log = logging.getLogger("cudarecv")


class CudarecvWeightTransferEngine(WeightTransferEngine[CudarecvInitInfo, CudarecvUpdateInfo]):
    """vLLM's ``"cudarecv"`` weight-transfer backend, worker side (vLLM builds it; see :mod:`cudarecv.vllm`)."""

    init_info_cls = CudarecvInitInfo
    update_info_cls = CudarecvUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._receiver: WeightReceiver | None = None
        self._group: Any = None
        self._store: Any = None

    # -- the handshake -------------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: CudarecvInitInfo) -> None:
        """Join the trainer's group and take its schema, checked against this engine's checkpoint."""
        self.shutdown()  # (a trainer that connects again replaces the last one)
        workers, index = self.parallel_config.world_size, self.parallel_config.rank  # (one engine: TP x PP workers)
        dtype = self.model_config.dtype
        try:
            self._store = dist.TCPStore(init_info.host, init_info.port, is_master=False,
                                        timeout=seconds(init_info.timeout))
            self._store.set(member_key(init_info.session, index), json.dumps(
                {"workers": workers, "dtype": str(dtype).removeprefix("torch."), "host": socket.gethostname()}))
            self._group = group_of(self._store, init_info.session, index + 1, workers + 1, init_info.timeout)
            expect = expected_weights(self.model_config.model, dtype)
            if expect is None:
                log.warning("vLLM worker %d: no local safetensors checkpoint at %r to check the trainer's weights "
                            "against; taking them as the trainer names them", index, self.model_config.model)
            self._receiver = WeightReceiver(group=self._group, group_src=0, device=self.device, expect=expect,
                                            timeout=init_info.timeout, transport=init_info.transport)
        except BaseException:
            self.shutdown()
            raise
        log.info("vLLM worker %d joined the trainer's weight sync (%s)", index, self._receiver.transport)

    # -- an update -----------------------------------------------------------------------------------------
    def start_weight_update(self) -> None:
        """Nothing yet: the model is touched only once a whole version has arrived (``receive_weights``)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load one version (the base class's, without its device-wide sync on a CPU engine)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: CudarecvUpdateInfo) -> None:
        """Pull the version the trainer pushes (whole and checked, or an error and the model untouched), then
        load it into the model."""
        if self._receiver is None:
            raise UsageError("the cudarecv weight transfer is not initialized: the trainer calls "
                             "init_weight_transfer_engine first")
        version = self._receiver.pull()
        if version != update_info.version:
            raise UsageError(f"the trainer announced version {update_info.version}, but version {version} arrived")
        load(self.model, self.model_config, self._receiver.td)

    def finish_weight_update(self) -> None:
        """Nothing left: ``receive_weights`` loaded the version whole."""

    def shutdown(self) -> None:
        """Close the receiver and let the group and the store go (the engine keeps serving)."""
        receiver, self._receiver = self._receiver, None
        try:
            if receiver is not None:
                receiver.close()
        finally:
            self._group = self._store = None


def load(model: torch.nn.Module, model_config: Any, weights: TensorDict) -> None:
    """Load ``weights`` (checkpoint names, nested on ``.``) into a served ``model`` with vLLM's layer-wise reload
    (which repacks each layer as loading did)."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    with disable_mtp_completeness_check():
        model.load_weights(list(weights.flatten_keys(".").items()))
    finalize_layerwise_reload(model, model_config)


def expected_weights(model: str, dtype: torch.dtype) -> TensorDict | None:
    """The weights the engine loaded, as ``expect`` (meta tensors of ``dtype``, nested on ``.``): names and
    shapes from the headers of its safetensors checkpoint; None if ``model`` is no local folder with one."""
    from safetensors import safe_open

    files = sorted(Path(model).glob("*.safetensors")) if Path(model).is_dir() else []
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = f.get_slice(name).get_shape()
    return TensorDict({name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in shapes.items()},
                      batch_size=[]).unflatten_keys(".")
