"""What a tensor-parallel vLLM worker loads of each checkpoint tensor: the slices its weight loaders read (the
``want`` of its :class:`~cudarecv.WeightReceiver`), so that each worker receives only those.

vLLM's loaders take whole checkpoint tensors and cut them themselves: column-parallel layers (q/k/v, gate/up)
read a block of rows, row-parallel ones (o_proj, down_proj) a block of columns, the vocabulary-parallel
embedding and head a block of the padded vocabulary, and k/v heads fewer than the ranks are replicated. This map
says the same per architecture, with vLLM's own helpers where it has them; a name it does not know is taken whole
(the loaders cut it as from a checkpoint). Architectures mapped: the Qwen2 family (``Qwen2ForCausalLM``).

Example:
    >>> want = worker_slices(hf_config, "Qwen2ForCausalLM", shapes, tp_rank=1, tp_size=2)
    >>> want["model.layers.0.mlp.down_proj.weight"]    # the second half of its columns
    (slice(None, None, None), slice(128, 256, None))
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

ARCHITECTURES = ("Qwen2ForCausalLM",)
_COLUMN = re.compile(r"\.mlp\.(gate|up)_proj\.weight$")
_ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_HEADS = re.compile(r"\.self_attn\.([qkv])_proj\.(weight|bias)$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def worker_slices(
    config: Any, architecture: str, shapes: Mapping[str, Sequence[int]], tp_rank: int, tp_size: int
) -> dict[str, tuple[slice, ...]] | None:
    """The slices tensor-parallel rank ``tp_rank`` of ``tp_size`` loads of each checkpoint tensor (``shapes``:
    name -> whole shape), for the names it cuts; None where the architecture is not mapped (or ``tp_size`` is 1):
    the worker then receives every tensor whole."""
    if tp_size == 1 or architecture not in ARCHITECTURES:
        return None
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        pad_vocab_size,
        vocab_range_from_global_vocab_size,
    )

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_size = config.hidden_size // heads  # (as vLLM's Qwen2 attention sizes its heads)
    want: dict[str, tuple[slice, ...]] = {}
    for name, shape in shapes.items():
        if name in _VOCAB:
            start, end = vocab_range_from_global_vocab_size(
                pad_vocab_size(shape[0]), tp_rank, tp_size
            )
            if (
                start < shape[0]
            ):  # (a rank whose rows are all padding takes the tensor whole, and reads none of it)
                want[name] = (slice(start, min(end, shape[0])),)
        elif found := _HEADS.search(name):
            if found.group(1) == "q":
                per, index = heads // tp_size, tp_rank
            elif (
                tp_size >= kv_heads
            ):  # one k/v head per rank, each replicated on tp_size // kv_heads ranks
                per, index = 1, tp_rank // (tp_size // kv_heads)
            else:
                per, index = kv_heads // tp_size, tp_rank
            want[name] = (slice(index * per * head_size, (index + 1) * per * head_size),)
        elif _COLUMN.search(name):
            part = shape[0] // tp_size
            want[name] = (slice(tp_rank * part, (tp_rank + 1) * part),)
        elif _ROW.search(name):
            part = shape[1] // tp_size
            want[name] = (slice(None), slice(tp_rank * part, (tp_rank + 1) * part))
    return want


def whole_leaves(
    weights: Mapping[str, Any],
    shapes: Mapping[str, Sequence[int]],
    want: Mapping[str, tuple[slice, ...]] | None,
) -> Any:
    """``weights`` (name -> tensor, the slices ``want`` says where it names one) as vLLM's loaders take them: each
    sliced one put where it lies in a tensor of its whole shape (the rest left unwritten: the loaders read only
    this slice), made as the loaders ask for it (vLLM's layer-wise reload keeps a layer's until the layer is
    whole: one layer's whole tensors at a time)."""
    import torch

    for name, tensor in weights.items():
        index = None if want is None else want.get(name)
        if index is None:
            yield name, tensor
            continue
        whole = torch.empty(tuple(shapes[name]), dtype=tensor.dtype, device=tensor.device)
        whole[index].copy_(tensor)
        yield name, whole
