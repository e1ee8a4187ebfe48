"""Updates staged beside the served model: each version is loaded and processed by vLLM's own code into *shadow*
layers while the engine goes on generating, and the engine pauses only to put the shadows' results in place.

vLLM's in-place reload (``vllm.model_executor.model_loader.reload``) restores each layer to its checkpoint
format, loads it with the model's own ``load_weights`` and weight loaders (fused q/k/v and gate/up, tensor-parallel
slices, padded vocabularies), processes it as loading did (``process_weights_after_loading``: on the CPU build each
linear layer's weight is repacked into a oneDNN handle, ``layer.cpu_linear``; quantized layers are converted)
and copies the result into the tensors the kernels read. The engine does none of it while it generates,
so the whole reload is the pause.

Here the same steps run on a shallow copy of the model (:func:`prepare`): every module copied with its own
parameter, buffer and child dicts (attributes shared), each layer that vLLM recorded for reloading restored to its
checkpoint format on the meta device (copies of vLLM's records, which are never touched), loaded through
``load_weights`` of the copy, and processed layer by layer as soon as its weights are in (vLLM's online processing).
Nothing the engine reads is written: the served layers keep their tensors and attributes. :meth:`Staged.apply` then,
at a step boundary (in ``update_weights``), copies each processed tensor into the served one (the kernels' own
storage, as vLLM's reload does) and sets the attributes processing made (the CPU build's repacked ``cpu_linear``)
on the served layer: a memory copy and a pointer swap per layer.

What it cannot place raises :class:`NotStaged` before anything is applied, where it can before anything is loaded
(tied weights, a quantized layer, whose processing may keep state on the method object its shadow shares, a layer
vLLM did not record, a torchao model, too little free GPU memory), else after loading (an attention layer with
weights of its own, e.g. KV-cache scales, a layer the version leaves out, processed tensors that differ in shape
from the served ones): the worker then falls back to vLLM's in-place reload in the pause, and says why. A staged
version holds one processed copy of every loaded layer until it is applied or dropped.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, cast

import torch

#: module attributes that are a module's own bookkeeping, never what processing makes
_MODULE_STATE = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}
)


class NotStaged(Exception):
    """This version cannot be staged: the worker loads it with vLLM's in-place reload instead (the message says
    why)."""


@dataclass
class _Layer:
    """A served layer and its staged shadow, processed."""

    served: torch.nn.Module
    shadow: torch.nn.Module
    name: str
    #: the shadow's attributes as copied (the served layer's then), before processing
    before: dict[str, Any]


@dataclass
class Staged:
    """One version, loaded and processed beside the served model; :meth:`apply` puts it in place."""

    layers: list[_Layer]
    prepare_s: float  # seconds the preparation took (the engine generated meanwhile)
    nbytes: int  # bytes apply() copies
    applied: bool = field(default=False)

    def apply(self) -> float:
        """Copy every processed tensor into the served layer's own and set the attributes processing made (at a step
        boundary: nothing generates meanwhile); seconds it took. Checked before anything is written (shapes,
        dtypes, devices): a mismatch raises :class:`NotStaged` with the model untouched."""
        if self.applied:
            raise NotStaged("this staged version was applied already")
        plans = [(layer, _placement(layer)) for layer in self.layers]  # (checks all first)
        started = time.perf_counter()
        with torch.no_grad():
            for layer, (tensors, attributes) in plans:
                for served, staged in tensors:
                    served.copy_(staged)
                for name, value in attributes.items():
                    if value is _MISSING:
                        vars(layer.served).pop(name, None)
                    else:
                        object.__setattr__(layer.served, name, value)
        self.applied = True
        self.drop()
        return time.perf_counter() - started

    def drop(self) -> None:
        """Let go of the shadows, their references to each other undone (a shadow's loaders are bound to it: left
        to the garbage collector, such cycles would be freed by a full collection, a pause of the engine's
        process that grows with its heap)."""
        from vllm.model_executor.model_loader.reload import layerwise

        _dismantle(
            [layer.shadow for layer in self.layers],
            [layer.served for layer in self.layers],
            layerwise,
        )
        self.layers = []


def _placement(
    layer: _Layer,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]:
    """What applying ``layer`` writes: (served tensor, processed tensor) pairs, and the attributes to set."""
    served_tensors = _tensors(layer.served)
    staged_tensors = _tensors(layer.shadow)
    if served_tensors.keys() != staged_tensors.keys():
        raise NotStaged(
            f"{layer.name}: processing made tensors {sorted(staged_tensors)}, the served layer has "
            f"{sorted(served_tensors)}"
        )
    pairs = []
    for name, served in served_tensors.items():
        staged = staged_tensors[name]
        if (served.shape, served.dtype, served.device) != (
            staged.shape,
            staged.dtype,
            staged.device,
        ):
            raise NotStaged(
                f"{layer.name}.{name}: processed as {tuple(staged.shape)} {staged.dtype} on {staged.device}, "
                f"served as {tuple(served.shape)} {served.dtype} on {served.device}"
            )
        if staged is not served:
            pairs.append((served.data, staged.data))
    shadow_state = vars(layer.shadow)
    attributes = {
        name: value
        for name, value in shadow_state.items()
        if name not in _MODULE_STATE and layer.before.get(name, _MISSING) is not value
    }
    # (what processing deleted from the shadow is deleted from the served layer too)
    attributes.update(
        {
            name: _MISSING
            for name in layer.before
            if name not in shadow_state and name not in _MODULE_STATE
        }
    )
    return pairs, attributes


_MISSING = object()


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {
        n: t for n, t in module._parameters.items() if t is not None
    }
    tensors.update({n: t for n, t in module._buffers.items() if t is not None})
    return tensors


#: the quantization methods whose processing touches only the layer it is given (the unquantized ones): a layer with
#: another keeps state on its method object, which the served layer shares with its shadow, so it is not staged
STATELESS_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})

#: the share of the GPU's free memory a staged version may take (the rest is the engine's)
GPU_HEADROOM = 0.8


def prepare(
    model: torch.nn.Module, model_config: Any, weights: Iterable[tuple[str, torch.Tensor]]
) -> Staged:
    """Load and process ``weights`` (checkpoint names and whole tensors, as ``load_weights`` takes them) into shadows
    of ``model``'s layers without touching the served model (see the module docstring); raises
    :class:`NotStaged` for what it cannot place, checked before anything is loaded where it can be. Runs beside
    the engine's steps (on the worker's taking thread); on a GPU it returns once its copies ran."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload import layerwise

    _check_stageable(model, layerwise)
    started = time.perf_counter()
    shadows: dict[torch.nn.Module, torch.nn.Module] = {}
    try:
        root = _shadow_tree(model, shadows)
        before = {shadow: dict(vars(shadow)) for shadow in shadows.values()}
        restored: list[tuple[str, torch.nn.Module, torch.nn.Module]] = []
        for name, served in model.named_modules(remove_duplicate=True):
            if not _tensors(served):
                continue  # (a container: its children are restored on their own)
            info = layerwise.LAYERWISE_INFO[served]  # (every module has one: _check_stageable)
            shadow = shadows[served]
            params, buffers = info.restore_metadata
            _restore_on_meta(shadow, served, params, buffers)
            layerwise.get_layerwise_info(shadow).restore_device = info.restore_device
            layerwise.initialize_online_processing(shadow)
            restored.append((name, served, shadow))
        with torch.no_grad(), disable_mtp_completeness_check():
            # (vLLM's model class: its own loader, on the shadows)
            cast(Any, root).load_weights(weights)
        layers = []
        for name, served, shadow in restored:
            info = layerwise.get_layerwise_info(shadow)
            if info.can_load() and info.load_numel == 0:
                if any(p is not None for p in shadow._parameters.values()):
                    # (vLLM's reload would keep the served tensors and warn; a version that leaves a layer out is
                    # not staged, so that a loader this module cannot follow never passes unnoticed)
                    raise NotStaged(f"{name}: nothing of this version loaded into its parameters")
                continue  # a layer of buffers that no checkpoint holds (rotary caches): the served layer stays
            if is_deferred_attention_layer(shadow):
                raise NotStaged(
                    f"{name}: an attention layer with weights of its own (vLLM processes those last)"
                )
            if info.can_load():
                # not every element loaded (padding vLLM declares): processed now, as vLLM's reload does
                with torch.no_grad():
                    layerwise._layerwise_process(shadow, info)
            layers.append(_Layer(served, shadow, name, before[shadow]))
        if not layers:
            raise NotStaged("load_weights loaded none of the model's layers")
        staged = Staged(layers, time.perf_counter() - started, 0)
        staged.nbytes = sum(t.nbytes for layer in layers for _, t in _placement(layer)[0])
        # (apply copies on the engine's stream: the copies made here, on this thread's, have run first)
        for device in {t.device for layer in layers for t in _tensors(layer.shadow).values()}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except BaseException:
        _dismantle(shadows.values(), shadows, layerwise)
        raise
    kept = {layer.shadow for layer in layers}
    _dismantle([shadow for shadow in shadows.values() if shadow not in kept], shadows, layerwise)
    return staged


def _check_stageable(model: torch.nn.Module, layerwise: Any) -> None:
    """Raise :class:`NotStaged` for a model this module cannot stage, before anything is loaded."""
    if getattr(model, "_do_torchao_reload", False):
        raise NotStaged("a torchao model: its reload re-quantizes the served model itself")
    owners: dict[int, str] = {}
    need = 0
    for name, served in model.named_modules(remove_duplicate=True):
        tensors = _tensors(served)
        if not tensors:
            continue
        label = name or type(model).__name__
        info = layerwise.LAYERWISE_INFO.get(served)
        if info is None:
            raise NotStaged(f"{label}: vLLM recorded no reload metadata for it")
        method = getattr(served, "quant_method", None)
        if method is not None and type(method).__name__ not in STATELESS_METHODS:
            raise NotStaged(
                f"{label}: its quantization method {type(method).__name__} keeps state that processing changes"
            )
        for key, tensor in tensors.items():
            other = owners.setdefault(id(tensor), f"{label}.{key}")
            if other != f"{label}.{key}":
                raise NotStaged(f"{label}.{key} is {other} (tied weights)")
        params, buffers = info.restore_metadata
        need += sum(t.numel() * t.element_size() for t in (*params.values(), *buffers.values()))
    devices = {t.device for t in model.parameters() if t.is_cuda}
    for device in devices:
        free, _ = torch.cuda.mem_get_info(device)
        if need > GPU_HEADROOM * free:
            raise NotStaged(
                f"a staged copy takes about {need / 1e9:.1f} GB, and {device} has {free / 1e9:.1f} GB free"
            )


def _dismantle(
    shadows: Iterable[torch.nn.Module], served: Iterable[torch.nn.Module], layerwise: Any
) -> None:
    """Let go of ``shadows``: their entries in vLLM's reload state, and the references between them and their
    tensors' loaders undone (cycles that only a full collection would free); a tensor of a ``served`` module
    is never touched."""
    kept = {id(t) for module in served for t in _tensors(module).values()}
    for shadow in shadows:
        layerwise.LAYERWISE_INFO.pop(shadow, None)
        for tensor in _tensors(shadow).values():
            if id(tensor) not in kept:
                tensor.__dict__.clear()
        vars(shadow).clear()


def _shadow_tree(
    module: torch.nn.Module, shadows: dict[torch.nn.Module, torch.nn.Module]
) -> torch.nn.Module:
    """A shallow copy of ``module`` and its children (one copy per module, shared ones shared): attributes are the
    served ones, the dicts of parameters, buffers and children its own."""
    if module in shadows:
        return shadows[module]
    shadow = copy.copy(module)
    shadows[module] = shadow
    object.__setattr__(shadow, "_parameters", dict(module._parameters))
    object.__setattr__(shadow, "_buffers", dict(module._buffers))
    object.__setattr__(
        shadow, "_non_persistent_buffers_set", set(module._non_persistent_buffers_set)
    )
    object.__setattr__(
        shadow,
        "_modules",
        {
            n: (None if child is None else _shadow_tree(child, shadows))
            for n, child in module._modules.items()
        },
    )
    return shadow


def _restore_on_meta(
    shadow: torch.nn.Module,
    served: torch.nn.Module,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
) -> None:
    """``shadow``'s tensors as vLLM recorded them before processing (meta tensors with their loaders, bound to
    ``shadow``): copies of the records, which vLLM's own reload of the served layer uses. The tensors vLLM never
    records (``bias``, built after the others; expert maps) would be the served ones, which the loaders write in
    place: the shadow gets private copies of those."""
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS, to_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    def restore_layer_refs(record: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        # a record's loaders are bound to a sentinel, or to the served layer once vLLM's reload restored it; that
        # reload also left its wrapper (bound to the served layer's reload state) on the record: unwrapped here
        # (vLLM's parameter classes keep it as `_weight_loader` behind a property)
        loader = getattr(record, "weight_loader", None)
        if getattr(loader, "__name__", None) == "online_process_loader":
            record.weight_loader = layerwise._get_original_loader(record)  # type: ignore[attr-defined]
        for key, value in record.__dict__.items():
            if isinstance(value, MethodType) and (
                value.__self__ is layer_ref_sentinel or value.__self__ is served
            ):
                record.__dict__[key] = value.__func__.__get__(layer)
        return record

    # (a module vLLM records nothing of, e.g. one of SKIP_MODULES or of SKIP_TENSORS alone, keeps its tensors:
    # private copies, below)
    recorded = list(_tensors(shadow)) + list(params) + list(buffers) if params or buffers else []
    for name in recorded:
        if name not in SKIP_TENSORS and hasattr(shadow, name):
            delattr(shadow, name)
    for name, record in params.items():
        if name not in SKIP_TENSORS:
            shadow.register_parameter(
                name, cast(torch.nn.Parameter, restore_layer_refs(to_meta_tensor(record), shadow))
            )
    for name, record in buffers.items():
        if name not in SKIP_TENSORS:
            shadow.register_buffer(
                name,
                restore_layer_refs(to_meta_tensor(record), shadow),
                persistent=name not in shadow._non_persistent_buffers_set,
            )
    served_tensors = {id(t) for t in _tensors(served).values()}
    kinds: tuple[dict[str, Any], ...] = (shadow._parameters, shadow._buffers)
    for kind in kinds:
        for name, tensor in kind.items():
            if tensor is not None and id(tensor) in served_tensors:
                kind[name] = restore_layer_refs(_private_copy(tensor), shadow)


def _private_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` with its own storage, class and attributes (a loader's, say), as vLLM's
    ``materialize_meta_tensor`` makes one."""
    copied = tensor.detach().clone()
    copied.__class__ = tensor.__class__
    copied.__dict__ = tensor.__dict__.copy()
    return copied
