"""The trainer of bench_vllm.py's fleet benchmark, run inside simulated host 0 (``vllm serve`` engines on the other
hosts, each behind its own shaped link): each route's ``rounds`` updates, timed here, written to ``out`` as JSON.

    python bench/vllm_fleet_trainer.py <this host's address> <url,url,...> <checkpoint> <out.json> <rounds>

Routes, one after the other on the same engines:

- ``cudarecv fleet, 1 engine`` and ``cudarecv fleet, N engines``: a fleet trainer of the first engine, then of all;
- ``safetensors reload, N engines``: the trainer saves the model once to a folder every host reads (here a local
  disk; on a cluster, a shared filesystem) and each engine reloads it (``collective_rpc("reload_weights")``), all
  at once.

After each route's last update every engine it updated must generate as the trainer's weights (greedy tokens).
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
import torch
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from cudarecv.testing import tiny_llm
from cudarecv.testing.vllm_serve import greedy_tokens, wait_healthy
from cudarecv.vllm import CudarecvTrainerEngine, CudarecvTrainerInitInfo

PROMPTS = [[5, 6, 7, 8], [100, 200, 300]]
TOKENS = 4


def main(host: str, urls: list[str], path: str, out: str, rounds: int) -> None:
    for url in urls:
        wait_healthy(url, lambda: True, lambda: "(an engine of another host)", timeout=900)
    sizes = json.loads((Path(path) / "config.json").read_text())
    model = tiny_llm.model(
        seed=1,
        **{
            k: sizes[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
            )
        },
    )
    generator = torch.Generator().manual_seed(0)
    routes: list[dict[str, Any]] = []

    def step() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=generator))

    def run(route: str, engines: list[str], update: Callable[[], object]) -> None:
        seconds = []
        for _ in range(rounds):
            step()
            started = time.perf_counter()
            update()
            seconds.append(time.perf_counter() - started)
        want = tiny_llm.greedy(model, PROMPTS, TOKENS)
        ok = all(greedy_tokens(url, path, PROMPTS, TOKENS) == want for url in engines)
        routes.append({"route": route, "engines": len(engines), "seconds": seconds, "ok": ok})
        print(route, len(engines), [round(s, 2) for s in seconds], ok, flush=True)

    def cudarecv(route: str, client: Any, engines: list[str]) -> None:
        trainer = CudarecvTrainerEngine.trainer_init(
            CudarecvTrainerInitInfo(host=host, timeout=300.0),
            client=client,
            source=ModuleSource(model),
        )
        try:
            run(route, engines, trainer.send_weights)
            if trainer.fleet:
                lost = [s for s in trainer.engines if s.state != "joined"]
                assert not lost, lost
        finally:
            trainer.shutdown()

    cudarecv("cudarecv fleet", [HTTPVLLMWeightSyncClient(urls[0])], urls[:1])
    cudarecv("cudarecv fleet", [HTTPVLLMWeightSyncClient(url) for url in urls], urls)

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="fleet-step-", dir=Path(out).parent) as folder:

        def reload_all() -> None:
            save_file(
                {k: v.contiguous() for k, v in model.state_dict().items()},
                str(Path(folder) / "model.safetensors"),
            )
            errors: list[BaseException] = []

            def reload(url: str) -> None:
                try:
                    requests.post(
                        f"{url}/collective_rpc",
                        json={"method": "reload_weights", "kwargs": {"weights_path": folder}},
                        timeout=300,
                    ).raise_for_status()
                except BaseException as error:  # noqa: BLE001 - raised below, on the caller's thread
                    errors.append(error)

            threads = [threading.Thread(target=reload, args=(url,)) for url in urls]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(330)
            if errors:
                raise errors[0]

        run("safetensors reload", urls, reload_all)
    Path(out).write_text(json.dumps({"routes": routes}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4], int(sys.argv[5]))
