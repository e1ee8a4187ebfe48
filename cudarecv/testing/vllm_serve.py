"""``vllm serve`` as cudarecv's tests and benchmarks start it: one engine of a local checkpoint in processes of its
own, with the ``"cudarecv"`` weight-transfer backend and the weight-sync endpoints (``VLLM_SERVER_DEV_MODE=1``), and
a bounded wait for it to answer ``/health``.

Example:
    >>> with Served(path, log_path) as server:        # on this machine, a free port of 127.0.0.1
    ...     requests.post(f"{server.url}/v1/completions", ...)
    >>> server = Served(path, log_path, host="127.100.0.2", port=8000, popen=lambda argv, **kw: hosts.popen(2, argv, **kw))
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

#: the environment every engine runs with here: a small KV cache, no network, vLLM's processes
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # (the weight-sync endpoints: /init_weight_transfer_engine, /update_weights...)
}

#: seconds an engine may take to answer ``/health`` (30-60 s on 2 quiet cores; several at once take longer)
START_TIMEOUT = 600.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def argv(path: str, host: str, port: int, max_model_len: int = 256) -> list[str]:
    """The command of one engine of the float32 checkpoint at ``path`` (no tokenizer: token ids in and out).
    (vllm-cpu 0.32's ``vllm serve`` looks up the version of a "vllm" distribution and fails: its server module.)"""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", path, "--host", host, "--port", str(port), "--dtype", "float32"),
        *("--enforce-eager", "--skip-tokenizer-init", "--max-model-len", str(max_model_len)),
        *("--max-num-seqs", "4", "--seed", "0", "--generation-config", "vllm"),
        *("--weight-transfer-config", '{"backend": "cudarecv"}'),
    ]


def wait_healthy(
    url: str, alive: Callable[[], bool], tail: Callable[[], str], timeout: float = START_TIMEOUT
) -> None:
    """Wait until the engine at ``url`` answers ``/health`` (bounded); ``alive`` says whether its process runs."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"vllm serve at {url} exited before it answered: {tail()}")
        with contextlib.suppress(requests.ConnectionError, requests.Timeout):
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)  # (a poll of the server's readiness, bounded by the deadline)
    raise TimeoutError(f"vllm serve at {url} did not answer /health within {timeout:g} s: {tail()}")


class Served:
    """One ``vllm serve`` engine: started by the constructor (``popen`` starts it elsewhere, e.g. in a simulated
    host), stopped by :meth:`stop` (SIGINT, then SIGKILL of its process group) or :meth:`kill` (SIGKILL at once)."""

    def __init__(
        self,
        path: str,
        log: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        max_model_len: int = 256,
        env: dict[str, str] | None = None,
        popen: Callable[..., subprocess.Popen] | None = None,
    ) -> None:
        self.path, self.host = path, host
        self.port = free_port(host) if port is None else port
        self.url = f"http://{host}:{self.port}"
        self._log: IO[str] = open(log, "w+")  # noqa: SIM115 - the server's, closed by stop()
        start: Callable[..., subprocess.Popen] = popen or subprocess.Popen
        command: Sequence[str] = argv(path, host, self.port, max_model_len)
        self.process = start(
            command,
            env={**os.environ, **ENV, **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            **({} if popen else {"start_new_session": True}),
        )

    def tail(self, chars: int = 3000) -> str:
        self._log.flush()
        with open(self._log.name) as log:
            return log.read()[-chars:]

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> Served:
        """Wait (bounded) until it answers ``/health`` (only from where its address is reachable)."""
        wait_healthy(self.url, lambda: self.process.poll() is None, self.tail, timeout)
        return self

    def kill(self) -> None:
        """SIGKILL its whole process group at once (its engine core and workers too), as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        """SIGINT (it shuts its engine down, then itself), SIGKILL of its group after 90 s; its log closed."""
        try:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)
                try:
                    self.process.wait(90)
                except subprocess.TimeoutExpired:
                    self.kill()
            with contextlib.suppress(ProcessLookupError):  # (what it left behind in its group)
                os.killpg(self.process.pid, signal.SIGKILL)
        finally:
            self._log.close()

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def greedy_tokens(url: str, model: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy tokens of ``prompts`` from the engine's completions endpoint (token ids in, token ids out)."""
    import requests

    answer = requests.post(
        f"{url}/v1/completions",
        timeout=120,
        json={
            "model": model,
            "prompt": prompts,
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    answer.raise_for_status()
    choices = sorted(answer.json()["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]
