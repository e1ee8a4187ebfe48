"""The trainer of tests/test_vllm.py's fleet test, run inside simulated host 0: one ``CudarecvTrainerEngine`` fed
to the ``vllm serve`` engines at ``urls`` (each on a host of its own), driven step by step by the test over this
process's stdin and stdout.

    python tests/vllm_fleet.py <this host's address> <url,url,...> <checkpoint path>

It says ``kill`` (the test SIGKILLs the second engine and answers ``killed``), ``restart`` (the test starts it again
and answers ``restarted``), and last ``report {json}``: per update, how long ``send_weights`` took, each engine's
state and version, and whether each joined engine generates as the trainer's weights.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from cudarecv.testing import tiny_llm
from cudarecv.testing.vllm_serve import greedy_tokens, wait_healthy
from cudarecv.vllm import CudarecvTrainerEngine, CudarecvTrainerInitInfo

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42]]
TOKENS = 8


def say(line: str) -> None:
    print(line, flush=True)


def hear(expected: str) -> None:
    line = (
        sys.stdin.readline().strip()
    )  # (the test answers within its own bounded wait, or kills this process)
    if line != expected:
        raise SystemExit(f"expected {expected!r} from the test, got {line!r}")


def healthy(url: str) -> None:
    wait_healthy(url, lambda: True, lambda: "(an engine of another host)", timeout=900)


def main(host: str, urls: list[str], path: str) -> None:
    for url in urls:
        healthy(url)
    model = tiny_llm.model(seed=31)
    trainer = CudarecvTrainerEngine.trainer_init(
        CudarecvTrainerInitInfo(host=host, timeout=60.0, join_wait=60.0),
        client=[HTTPVLLMWeightSyncClient(url) for url in urls],
        source=ModuleSource(model),
    )
    generator = torch.Generator().manual_seed(0)
    steps = []

    def step() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=generator))
        started = time.perf_counter()
        version = trainer.send_weights()
        took = time.perf_counter() - started
        want = tiny_llm.greedy(model, PROMPTS, TOKENS)
        engines = {s.engine: s for s in trainer.engines}
        steps.append(
            {
                "version": version,
                "seconds": took,
                "states": {url: engines[url].state for url in urls},
                "versions": {url: engines[url].version for url in urls},
                "why": {url: engines[url].why for url in urls},
                "loaded": {
                    url: sorted(loaded.how for loaded in engines[url].loaded.values())
                    for url in urls
                },
                "as_trainer": {
                    url: greedy_tokens(url, path, PROMPTS, TOKENS) == want
                    for url in urls
                    if engines[url].state == "joined"
                },
            }
        )

    relay: list[str] = []
    try:
        step()  # every engine
        relay = [r["transport"] for r in trainer.sender.receivers if r["state"] == "served"]
        say("kill")
        hear("killed")
        step()  # the killed one lost, the others updated
        say("restart")
        hear("restarted")
        healthy(urls[1])
        step()  # the restarted one joins and takes this very update
    finally:
        trainer.shutdown()
    say("report " + json.dumps({"steps": steps, "relay": relay}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), sys.argv[3])
