"""How much of a bf16 model changes per optimizer step, and what a delta push would cost.

Builds a small ``Qwen2ForCausalLM`` from a ``transformers.Qwen2Config`` (random init, nothing
downloaded) and trains it the way an RL trainer does: a REINFORCE-like policy-gradient loss,
``-(advantage * logprob of the sampled tokens).mean()``, on random token batches with random
per-sequence advantages, with ``torch.optim.AdamW``. Variants, each at every ``--lr``:

- ``bf16``: parameters, gradients and AdamW's state in bf16, weight decay 0.0;
- ``bf16-wd0.01``: the same with weight decay 0.01;
- ``fp32-master``: parameters and AdamW in fp32; the pushed weights are the bf16 cast of them
  (what ``wire_dtype=torch.bfloat16`` sends).

After each step the pushed bf16 weights (the state dict in its order, flattened into one buffer of
2-byte words) are compared bit for bit with the previous step's (``view(torch.int16)``, ``!=``).
Per step it records the changed fraction of the elements and the size of the delta encoding
(:func:`encoded_bytes`) as a fraction of the full model's bytes. All variants start from the same
initial weights and see the same batches and advantages.

On a CPU without bf16 matrix units (AVX2) PyTorch's bf16 backward matmuls are ~50x slower than
fp32 ones, so by default the bf16 variants run the forward and backward in fp32 on an exact fp32
copy of the bf16 weights and round the gradients to bf16; AdamW then steps the bf16 parameters with
bf16 state, as in a bf16 trainer. Only the activations differ from a bf16 forward (fp32, not bf16).
``--bf16-compute`` runs the bf16 model's own forward and backward instead (slow on such a CPU).

Run::

    /work/venv-vllm/bin/python bench/delta_fraction.py --json delta.json
    /work/venv-vllm/bin/python bench/delta_fraction.py --bf16-compute --variants bf16 --steps 10

It prints a markdown table: per (variant, lr) the median/min/max changed fraction over steps
2..N, the median encoded size, and step 1 apart (Adam's first step is ``lr * sign(grad)`` for
every element with a gradient).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

BLOCK_RECORD_BYTES = 24
SPARSE_INDEX_BYTES = 4
DEFAULT_BLOCK_WORDS = 512 * 1024  # 1 MiB of 2-byte words
# name: (dtype of the trained parameters and AdamW state, weight decay)
VARIANTS = {
    "bf16": (torch.bfloat16, 0.0),
    "bf16-wd0.01": (torch.bfloat16, 0.01),
    "fp32-master": (torch.float32, 0.0),
}


def block_costs(changed_mask: torch.Tensor, word_bytes: int, block_words: int) -> torch.Tensor:
    """Per block of ``block_words`` words: the bytes of its full, sparse and bitmask encodings.

    Returns an int64 tensor ``[n_blocks, 3]`` (without the fixed block record). For a block of
    ``n`` words of which ``c`` changed: full ``n*W``, sparse ``c*(4+W)`` (index and value per
    changed word), bitmask ``ceil(n/8) + c*W``.
    """
    mask = changed_mask.reshape(-1).to(torch.bool)
    total = mask.numel()
    n_blocks = max(1, math.ceil(total / block_words))
    padded = torch.zeros(n_blocks * block_words, dtype=torch.int64)
    padded[:total] = mask.to(torch.int64)
    changed = padded.view(n_blocks, block_words).sum(dim=1)
    words = torch.full((n_blocks,), block_words, dtype=torch.int64)
    words[-1] = total - (n_blocks - 1) * block_words
    full = words * word_bytes
    sparse = changed * (SPARSE_INDEX_BYTES + word_bytes)
    bitmask = (words + 7) // 8 + changed * word_bytes
    return torch.stack([full, sparse, bitmask], dim=1)


def encoded_bytes(changed_mask: torch.Tensor, word_bytes: int, block_words: int) -> int:
    """Bytes of the delta encoding of a flat buffer whose changed words are ``changed_mask``.

    The buffer is cut into blocks of ``block_words`` words; each block costs the cheapest of its
    full, sparse and bitmask encodings (:func:`block_costs`) plus a 24-byte block record.
    """
    costs = block_costs(changed_mask, word_bytes, block_words)
    return int((costs.min(dim=1).values + BLOCK_RECORD_BYTES).sum())


def build_config(args: argparse.Namespace) -> Qwen2Config:
    """A small Qwen2 (untied embeddings, like Qwen2-7B), sized by the command line."""
    return Qwen2Config(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(512, args.seq),
        tie_word_embeddings=False,
    )


def pushed_words(model: torch.nn.Module) -> torch.Tensor:
    """The bf16 state dict, in its order, as one flat int16 buffer (a copy; shared tensors once)."""
    seen: set[int] = set()
    parts = []
    for tensor in model.state_dict().values():
        if not tensor.is_floating_point() or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        parts.append(tensor.detach().to(torch.bfloat16).reshape(-1).view(torch.int16))
    return torch.cat(parts)


def policy_gradient_loss(
    model: torch.nn.Module, tokens: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """REINFORCE: ``-(advantage * logprob of each sampled token).mean()`` (log-softmax in fp32)."""
    logits = model(input_ids=tokens).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    taken = logprobs.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return -(advantages.unsqueeze(1) * taken).mean()


def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``target``'s parameters := ``source``'s, cast to ``target``'s dtype (bf16 -> fp32 is exact)."""
    with torch.no_grad():
        for src, dst in zip(source.parameters(), target.parameters()):
            dst.copy_(src)


def copy_grads(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``target``'s gradients := ``source``'s, rounded to ``target``'s dtype."""
    for src, dst in zip(source.parameters(), target.parameters()):
        dst.grad = None if src.grad is None else src.grad.to(dst.dtype)


@dataclass
class Step:
    step: int
    loss: float
    changed: int
    changed_frac: float
    encoded_bytes: int
    encoded_frac: float


@dataclass
class Run:
    variant: str
    lr: float
    weight_decay: float
    master_dtype: str
    compute_dtype: str
    elements: int
    full_bytes: int
    seconds: float
    steps: list[Step]


def train(
    initial: dict[str, torch.Tensor],
    config: Qwen2Config,
    variant: str,
    master_dtype: torch.dtype,
    lr: float,
    weight_decay: float,
    args: argparse.Namespace,
) -> Run:
    """``args.steps`` AdamW steps from ``initial``; after each, the diff of the pushed bf16 words."""
    model = Qwen2ForCausalLM(config)
    model.load_state_dict(initial)
    model.to(master_dtype).train()
    compute = model
    if master_dtype != torch.float32 and not args.bf16_compute:
        compute = copy.deepcopy(model).float()  # fp32 forward/backward of the bf16 weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    data = torch.Generator().manual_seed(args.seed + 1)  # same batches for every run
    previous = pushed_words(model)
    full_bytes = previous.numel() * 2
    steps = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=data)
        advantages = torch.randn(args.batch, generator=data)
        optimizer.zero_grad(set_to_none=True)
        if compute is not model:
            copy_weights(model, compute)
            compute.zero_grad(set_to_none=True)
        loss = policy_gradient_loss(compute, tokens, advantages)
        loss.backward()
        if compute is not model:
            copy_grads(compute, model)
        optimizer.step()
        current = pushed_words(model)
        changed = current != previous
        size = encoded_bytes(changed, 2, args.block_words)
        count = int(changed.sum())
        steps.append(
            Step(step, loss.item(), count, count / changed.numel(), size, size / full_bytes)
        )
        previous = current
    return Run(
        variant,
        lr,
        weight_decay,
        str(master_dtype).removeprefix("torch."),
        str(next(compute.parameters()).dtype).removeprefix("torch."),
        previous.numel(),
        full_bytes,
        time.perf_counter() - start,
        steps,
    )


def percent(x: float) -> str:
    return f"{100 * x:.3g}%"


def table(runs: list[Run]) -> str:
    """The markdown table: steps 2..N summarized, step 1 apart."""
    lines = [
        "| variant | fwd/bwd | lr | changed median (2..N) | min | max | encoded median (2..N) | step 1 changed | step 1 encoded |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        later = run.steps[1:] or run.steps
        fracs = [s.changed_frac for s in later]
        sizes = [s.encoded_frac for s in later]
        first = run.steps[0]
        lines.append(
            f"| {run.variant} | {run.compute_dtype} | {run.lr:g} | {percent(statistics.median(fracs))} "
            f"| {percent(min(fracs))} | {percent(max(fracs))} "
            f"| {percent(statistics.median(sizes))} "
            f"| {percent(first.changed_frac)} | {percent(first.encoded_frac)} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=0, help="default 4 * hidden")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, action="append", help="repeatable; default 1e-6, 1e-5")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS)} (default all)",
    )
    parser.add_argument(
        "--bf16-compute",
        action="store_true",
        help="bf16 variants: the bf16 model's own forward/backward (default: fp32 on a copy)",
    )
    parser.add_argument("--block-words", type=int, default=DEFAULT_BLOCK_WORDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the per-step numbers here")
    args = parser.parse_args()
    args.lr = args.lr or [1e-6, 1e-5]
    args.variants = [v.strip() for v in args.variants.split(",")]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    return args


def main() -> None:
    args = parse_args()
    config = build_config(args)
    torch.manual_seed(args.seed)
    initial = copy.deepcopy(Qwen2ForCausalLM(config).state_dict())
    n_params = sum(t.numel() for t in initial.values())
    print(
        f"Qwen2ForCausalLM hidden={config.hidden_size} intermediate={config.intermediate_size} "
        f"layers={config.num_hidden_layers} heads={config.num_attention_heads}/"
        f"{config.num_key_value_heads} vocab={config.vocab_size}: {n_params / 1e6:.2f} M parameters; "
        f"batch {args.batch} x seq {args.seq}, {args.steps} steps, block {args.block_words} words"
    )
    runs = []
    for name in args.variants:
        dtype, decay = VARIANTS[name]
        for lr in args.lr:
            run = train(initial, config, name, dtype, lr, decay, args)
            print(
                f"  {name} lr={lr:g}: {run.seconds:.1f} s, loss {run.steps[0].loss:.4f} -> "
                f"{run.steps[-1].loss:.4f}",
                flush=True,
            )
            runs.append(run)
    print()
    print(table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"config": config.to_dict(), "args": vars(args), "runs": [asdict(r) for r in runs]},
                f,
                indent=1,
                default=str,
            )


if __name__ == "__main__":
    main()
