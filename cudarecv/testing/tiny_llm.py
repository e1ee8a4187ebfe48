"""A tiny Qwen2 causal LM for vLLM tests, benches and examples on a CPU: made locally (no download), saved as a
safetensors checkpoint vLLM can serve, and its greedy tokens from a plain transformers forward (the reference
a served engine's tokens are compared with)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import Qwen2ForCausalLM

#: the size the tests use: 0.56 M parameters
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def config(**sizes: int) -> Any:
    """A Qwen2 config of ``sizes`` (default :data:`TINY`): vocabulary 1024, untied embeddings."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=1024,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        **{**TINY, **sizes},
    )


def model(seed: int = 0, **sizes: int) -> Qwen2ForCausalLM:
    """A fresh model with random weights from ``seed``."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config(**sizes)).eval()


def save(path: str | Path, seed: int = 0, **sizes: int) -> str:
    """Save :func:`model` as a checkpoint folder vLLM serves (no tokenizer: serve it with
    ``skip_tokenizer_init=True`` and token-id prompts); returns the folder."""
    model(seed, **sizes).save_pretrained(str(path), safe_serialization=True)
    return str(path)


def greedy(module: torch.nn.Module, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The next ``tokens`` greedy tokens of each prompt, by a plain forward (what vLLM generates at
    temperature 0 from the same weights)."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(tokens):
                ids = torch.cat([ids, module(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            out.append(ids[0, len(prompt) :].tolist())
    return out
