"""A trainer in a process of its own for tests/test_vllm.py: it drives the test's engine through a client that
forwards each call to the test process (as HTTPVLLMWeightSyncClient forwards to ``vllm serve``), sends one version,
then is killed (SIGKILL) during the next: ``mid-send`` with one weight of it written into the shared snapshot
(the engine has been asked nothing yet: it generates on), ``after-start`` once the version landed on the worker and
the engine started the update, before it is asked to load it.

    python tests/vllm_trainer.py <the test's listener port> <authkey hex> mid-send|after-start
    python tests/vllm_trainer.py <a vllm serve's URL> after-start      (HTTPVLLMWeightSyncClient)
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Client
from typing import Any

import torch


class Forwarding:
    """vLLM's weight-sync client protocol, each call answered by the test process."""

    def __init__(self, port: int, key: bytes, die_after_start: bool) -> None:
        self._port, self._key, self.die_after_start = port, key, die_after_start

    def _call(self, name: str, *args: Any) -> None:
        with Client(
            ("127.0.0.1", self._port), authkey=self._key
        ) as conn:  # (a connection per call: calls overlap)
            conn.send((name, args))
            assert (
                conn.recv() == "taken"
            )  # (the test process has the call: a death from here on is the engine's)
            error = conn.recv()
        if error is not None:
            raise RuntimeError(f"the engine's {name} failed: {error}")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")
        if self.die_after_start:
            os.kill(os.getpid(), signal.SIGKILL)

    def update_weights(self, update_info: dict) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)


def http(url: str) -> Any:
    """vLLM's HTTP client to ``url``, killed (SIGKILL) once the engine started an update if told so."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    class Dying(HTTPVLLMWeightSyncClient):
        die_after_start = False

        def start_weight_update(self) -> None:
            super().start_weight_update()
            if self.die_after_start:
                os.kill(os.getpid(), signal.SIGKILL)

    return Dying(url)


def main() -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource

    from cudarecv.testing import tiny_llm
    from cudarecv.vllm import CudarecvTrainerEngine, CudarecvTrainerInitInfo
    from cudarecv.weights import snapshots

    when = sys.argv[-1]
    if sys.argv[1].startswith("http"):
        client = http(sys.argv[1])
    else:
        client = Forwarding(int(sys.argv[1]), bytes.fromhex(sys.argv[2]), die_after_start=False)
    model = tiny_llm.model(seed=11)
    trainer = CudarecvTrainerEngine.trainer_init(
        CudarecvTrainerInitInfo(timeout=30.0), client=client, source=ModuleSource(model)
    )
    trainer.send_weights()
    print("sent 1", flush=True)
    run = snapshots.CopyTable.run

    def copy_then_die(table: Any, start: int, stop: int) -> None:
        run(table, start, min(stop, start + 1))
        os.kill(
            os.getpid(), signal.SIGKILL
        )  # one leaf of version 2 written into the shared snapshot

    snapshots.CopyTable.run = copy_then_die  # type: ignore[method-assign]
    client.die_after_start = when == "after-start"
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    trainer.send_weights()


if __name__ == "__main__":
    main()
