"""``python -m cudarecv demo``: RL weight sync, a trainer pushing a policy to actors every step.

Usage::

    python -m cudarecv demo [--actors N] [--steps N] [--hidden N | --model-mib X] [--device cpu|cuda]
                            [--bucket-bytes SIZE] [--verify] [--timeout S] [--seed N] [--quick]

Starts one trainer (rank 0) and ``--actors`` actor processes (ranks 1..N) on
this machine (one :class:`~cudarecv.testing.launch.Cluster`): gloo on the CPU by
default; with ``--device cuda``, NCCL when every rank can have a GPU of its
own, else gloo with each process's weights in CUDA memory.

The task needs no data: a contextual bandit written in torch. Each context is
a random vector; one of a few arms pays 1, chosen by a hidden random rule
shared by all ranks (the seed), the others 0. The trainer trains a policy MLP
with REINFORCE on its own batches and, after every optimizer step, pushes the
weights to all actors with a :class:`~cudarecv.WeightSender` (``push(wait=False)``:
the push goes on in a helper thread while the trainer computes the next step,
and is finished before the next push). The pushed tensordict is the policy's
parameters plus a small ``meta`` sub-tensordict: the version, the step, a
``last`` flag and the trainer's ``time.time()`` at push start.

Each actor holds a :class:`~cudarecv.WeightReceiver` and always acts with the
latest version it has: it starts the next pull without blocking
(``pull(wait=False)``, which the receiver's own thread finishes) and, until
``done()``, plays episodes with the current weights (zero-copy: under
``receiver.reading()``, ``torch.func.functional_call`` on the received views).
Per pull it records the latency (``time.time()`` in a done-callback, which runs
as the version is published, minus the trainer's stamp: the same host clock),
the version lag of every episode (the trainer's latest pushed version, which it
sets in the default group's store before each push, minus the version acted
with) and, with ``--verify``, whether the checksum held.

At the end the program prints an nccl-tests style table, one row per actor,
plus the trainer's reward over its first and last 10% of steps (it must go up:
random play scores 1/arms), and checks that every actor ended with exactly the
trainer's final weights.

Exit status: 0 on success; 1 if a rank failed, a checksum failed or an actor's
final weights differ from the trainer's; 2 on bad arguments. Errors print as
``cudarecv demo: error: ...`` (see :mod:`cudarecv.tools.cli`); a bad option's
names its flag.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import cudarecv

from ..testing.launch import Cluster, RankError
from . import report, table
from .cli import OptionError, error, int_at_least, positive_float, size_or_zero
from .console import available_memory, progress, tail, versions
from .transfer_ranks import format_size

DEFAULTS = dict(actors=2, steps=200, model_mib=4.0, bucket_bytes="1MiB", timeout=60.0, seed=0)
QUICK = dict(steps=40, hidden=64)
OBS, ARMS, RULE_WIDTH = 16, 8, 32  # context size, arms, width of the hidden rule
BATCH, ACTOR_BATCH = 256, 64  # contexts per training step / per actor episode
VERSION_KEY = "cudarecv_demo/version"
PROCESS_BYTES = 400 << 20  # a rank's own footprint (torch imported, gloo), roughly
NOTE = ("latency = actor's time.time() when a version landed - trainer's time.time() at push start; "
        "GB/s = pushed bytes / p50 latency / 1e9")
LAG_NOTE = "lag = trainer's latest pushed version - the version the actor acted with, per episode"
CHECK_NOTE = "check = final weights identical to the trainer's, and no checksum failure (checksums: with --verify)"
COLUMNS = ("actor", "device", "pulls", "episodes", "p50 (ms)", "p99 (ms)", "GB/s", "lag mean", "lag max",
           "checksums", "reward", "last 10%", "check")
LEFT = {"device", "check"}


@dataclass(frozen=True)
class Config:
    """Everything a rank needs (pickled to the spawned ranks)."""

    actors: int
    steps: int
    hidden: int
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    bucket_bytes: int | None
    verify: bool
    timeout: float
    seed: int
    threads: int
    kill_actor: int | None = None

    @property
    def world(self) -> int:
        return self.actors + 1

    @property
    def lr(self) -> float:
        return 1e-2 * min(1.0, 64 / self.hidden)


# --------------------------------------------------------------------------- task and policy


class Bandit:
    """Batched contextual bandit: contexts ~ N(0, I); arm ``argmax(tanh(x A) B)`` pays 1, the others 0."""

    def __init__(self, seed: int, device: torch.device, stream: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)  # the rule: the same on every rank
        self.a = torch.randn(OBS, RULE_WIDTH, generator=g).to(device)
        self.b = torch.randn(RULE_WIDTH, ARMS, generator=g).to(device)
        self.gen = torch.Generator(device).manual_seed(seed * 1000 + stream + 1)  # the contexts: one stream per rank

    def contexts(self, batch: int) -> torch.Tensor:
        return torch.randn(batch, OBS, generator=self.gen, device=self.a.device)

    def rewards(self, contexts: torch.Tensor, arms: torch.Tensor) -> torch.Tensor:
        best = (torch.tanh(contexts @ self.a) @ self.b).argmax(-1)
        return (arms == best).float()


def make_policy(hidden: int, device: Any = None) -> nn.Sequential:
    """The policy MLP: context -> hidden -> hidden -> arm logits."""
    return nn.Sequential(nn.Linear(OBS, hidden, device=device), nn.Tanh(), nn.Linear(hidden, hidden, device=device),
                         nn.Tanh(), nn.Linear(hidden, ARMS, device=device))


def param_count(hidden: int) -> int:
    return OBS * hidden + hidden + hidden * hidden + hidden + hidden * ARMS + ARMS


def hidden_for(mib: float) -> int:
    """The hidden width whose float32 parameters take about ``mib`` MiB."""
    target = mib * (1 << 20) / 4
    b = OBS + ARMS + 2
    return max(1, round((-b + math.sqrt(b * b + 4 * (target - ARMS))) / 2))


def _meta(device: Any) -> Any:
    from tensordict import TensorDict

    return TensorDict({"t_push": torch.zeros((), dtype=torch.float64, device=device),
                       "version": torch.zeros((), dtype=torch.int64, device=device),
                       "step": torch.zeros((), dtype=torch.int64, device=device),
                       "last": torch.zeros((), dtype=torch.int64, device=device)}, batch_size=[])


def weights_td(policy: nn.Module, meta: Any) -> Any:
    """What is pushed: the policy's parameters (shared, not copied) and the ``meta`` leaves."""
    from tensordict import TensorDict

    return TensorDict({"policy": TensorDict.from_module(policy), "meta": meta}, batch_size=[])


def digest(td: Any) -> str:
    """A hash of the leaves' bytes, in key order."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(td.keys(True, True), key=lambda k: (k,) if isinstance(k, str) else k):
        t = td.get(key).detach().cpu().contiguous()
        h.update(repr(key).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- ranks


def demo_rank(rank: int, world_size: int, group: Any, cfg: Config) -> dict[str, Any]:
    """The Cluster entry point: rank 0 trains, the others act."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed * 1000 + rank)  # the actors' sampling (the trainer reseeds)
    device = _device(rank, cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return _trainer(cfg, device) if rank == 0 else _actor(rank, cfg, device)


def _device(rank: int, cfg: Config) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def _store() -> Any:
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def _train_step(policy: nn.Module, opt: torch.optim.Optimizer, env: Bandit) -> float:
    """One REINFORCE step (mean-reward baseline) on a fresh batch; returns the batch's mean reward."""
    x = env.contexts(BATCH)
    dist = torch.distributions.Categorical(logits=policy(x))
    arms = dist.sample()
    r = env.rewards(x, arms)
    loss = -((r - r.mean()) * dist.log_prob(arms)).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(r.mean())


class _Progress:
    """A tqdm bar on stderr, or a line every 10% when tqdm is not installed."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.done, self.desc = total, 0, desc
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, mininterval=0.5,
                            dynamic_ncols=True, leave=True)

    def update(self, **postfix: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif self.done == self.total or self.done % max(1, self.total // 10) == 0:
            info = " ".join(f"{k}={v}" for k, v in postfix.items())
            print(f"{self.desc}: {self.done}/{self.total} {info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Pushed:
    """What the trainer pushes, and how it stamps and starts each version.

    On the CPU the sender reads the policy's parameters themselves (it copies
    them into its storage inside ``push()``). On a GPU that copy runs later, on
    the push's stream, while the next optimizer step already writes the
    parameters on the trainer's stream: there the sender reads a snapshot,
    refreshed on the trainer's stream once the previous push is out on the GPU.
    """

    def __init__(self, policy: nn.Module, device: torch.device) -> None:
        from tensordict import TensorDict

        self.params = TensorDict.from_module(policy)
        self.meta = _meta(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.td = weights_td(policy, self.meta) if self.stream is None else TensorDict(
            {"policy": self.params.detach().clone(), "meta": self.meta}, batch_size=[])

    def start(self, sender: Any, store: Any, step: int, last: bool) -> list[Any]:
        """Stamp and start the push of the next version (the store says it is the trainer's latest)."""
        version = sender.version + 1
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)  # the previous push has read the snapshot
            with torch.no_grad():
                self.td["policy"].update_(self.params)
        self.meta["version"].fill_(version)
        self.meta["step"].fill_(step)
        self.meta["last"].fill_(int(last))
        store.set(VERSION_KEY, str(version))
        self.meta["t_push"].fill_(time.time())
        return sender.push(wait=False)


class _Background:
    """Run ``finish()`` (a push's waits, bounded by ``--timeout``) in a helper thread.

    ``WeightSender.push(wait=False)`` posts what it can and returns; the rest
    happens inside the transfers' ``wait()``: gloo works report completion only
    there, and a gloo push of CUDA weights copies through staging buffers step
    by step. The trainer finishes each push here while it computes the next
    step, and touches the transfers again only after :meth:`result` has joined.
    """

    def __init__(self, finish: Callable[[], Any], device: torch.device) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(finish, device), daemon=True,
                                        name="cudarecv-demo-transfer")
        self._thread.start()

    def _run(self, finish: Callable[[], Any], device: torch.device) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            self.value = finish()
        except BaseException as error:  # noqa: BLE001 - handed to the caller by result()
            self.error = error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Any:
        """What ``finish()`` returned; raises what it raised."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.value


def _pushing(transfers: list[Any], ranks: list[int], version: int, timeout: float,
             device: torch.device) -> _Background:
    """Finish a push to every actor in the background (bounded by ``timeout`` in all)."""
    def finish() -> None:
        deadline = time.monotonic() + timeout
        for rank, transfer in zip(ranks, transfers):
            try:
                transfer.wait(max(deadline - time.monotonic(), 1e-3))
            except Exception as error:  # re-raised naming the actor
                raise RuntimeError(f"the push of version {version} to actor rank {rank} failed: "
                                   f"{error}") from error
    return _Background(finish, device)


def _finish(push: _Background) -> float:
    """Wait for the push in flight to be out; return the seconds the trainer waited."""
    start = time.perf_counter()
    push.result()
    return time.perf_counter() - start


def _trainer(cfg: Config, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    policy = make_policy(cfg.hidden, device)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    env = Bandit(cfg.seed, device)
    store = _store()
    ranks = list(range(1, cfg.world))
    pushed = _Pushed(policy, device)
    sender = cudarecv.WeightSender(pushed.td, dst=ranks, bucket_bytes=cfg.bucket_bytes, timeout=cfg.timeout,
                          verify=cfg.verify, stream=pushed.stream)
    rewards: list[float] = []
    waits: list[float] = []
    bar = _Progress(cfg.steps, "trainer")

    def push(step: int) -> _Background:
        transfers = pushed.start(sender, store, step=step, last=step == cfg.steps)
        return _pushing(transfers, ranks, sender.version, cfg.timeout, device)

    try:
        in_flight = push(0)  # version 1: the initial weights
        for step in range(1, cfg.steps + 1):
            rewards.append(_train_step(policy, opt, env))  # the previous push goes on meanwhile
            waits.append(_finish(in_flight))
            in_flight = push(step)
            recent = rewards[-max(1, cfg.steps // 10):]
            bar.update(reward=f"{sum(recent) / len(recent):.3f}", version=str(sender.version))
        waits.append(_finish(in_flight))
    finally:
        bar.close()
        sender.close()
    return dict(role="trainer", rewards=rewards, waits=waits, versions=sender.version, bytes=sender.schema.total,
                leaves=len(sender.schema.leaves), digest=digest(pushed.params))


@dataclass
class _ActorStats:
    latencies: list[float]
    lags: list[int]
    rewards: list[float]
    verified: int = 0
    bad: int = 0


def _act(policy: nn.Module, params: dict[str, torch.Tensor], env: Bandit) -> float:
    """One episode (a batch of contexts) with the given weights; its mean reward."""
    x = env.contexts(ACTOR_BATCH)
    with torch.no_grad():
        logits = torch.func.functional_call(policy, params, (x,))
    arms = torch.distributions.Categorical(logits=logits).sample()
    return float(env.rewards(x, arms).mean())


def _actor(rank: int, cfg: Config, device: torch.device) -> dict[str, Any]:
    skeleton = make_policy(cfg.hidden, "meta")  # structure only: the weights are the receiver's views
    receiver = cudarecv.WeightReceiver(src=0, device=device, expect=weights_td(skeleton, _meta("meta")),
                              timeout=cfg.timeout)
    env = Bandit(cfg.seed, device, stream=rank)
    store = _store()
    stats = _ActorStats([], [], [])
    views: dict[int, tuple[Any, dict[str, torch.Tensor]]] = {}  # per receiver storage: its meta and params
    try:
        while True:
            transfer = receiver.pull(wait=False)  # the receiver's thread finishes it
            landed: list[float] = []
            transfer.add_done_callback(lambda _, at=landed: at.append(time.time()))  # runs as it is published
            while receiver.version > 0 and not transfer.done():  # act with what we have meanwhile
                _episode(receiver, skeleton, env, store, stats, views)
            try:
                transfer.wait(cfg.timeout)
            except cudarecv.ChecksumError:
                stats.bad += 1
                continue
            stats.verified += int(cfg.verify)
            meta = receiver.td["meta"]
            stats.latencies.append(landed[0] - float(meta["t_push"]))
            if cfg.kill_actor == rank and int(meta["step"]) >= cfg.steps // 2:
                os._exit(3)  # --kill-actor: die abruptly, as a crashed actor would
            if int(meta["last"]):
                break
    finally:
        receiver.close()
    return dict(role="actor", rank=rank, device=str(device), pulls=len(stats.latencies) + stats.bad,
                latencies=stats.latencies, lags=stats.lags, rewards=stats.rewards, verified=stats.verified,
                bad=stats.bad, version=receiver.version, bytes=receiver.schema.total,
                digest=digest(receiver.td["policy"]))


def _episode(receiver: Any, skeleton: nn.Module, env: Bandit, store: Any, stats: _ActorStats,
             views: dict[int, tuple[Any, dict[str, torch.Tensor]]]) -> None:
    """Play one episode with the latest version; record its reward and version lag."""
    with receiver.reading() as td:  # the version acted with stays put meanwhile
        if id(td) not in views:
            views[id(td)] = (td["meta"], td["policy"].flatten_keys(".").to_dict())
        meta, params = views[id(td)]
        acted = int(meta["version"])
        lag = int(store.get(VERSION_KEY)) - acted  # the trainer sets it before pushing: never negative
        reward = _act(skeleton, params, env)
    stats.lags.append(lag)
    stats.rewards.append(reward)


# --------------------------------------------------------------------------- results


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _tenth(values: list[float], last: bool) -> float | None:
    n = max(1, len(values) // 10)
    return _mean(values[-n:] if last else values[:n])


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def actor_cells(actor: dict[str, Any], trainer: dict[str, Any], verify: bool) -> dict[str, str]:
    """One table row: cells keyed by column."""
    lat = actor["latencies"]
    p50 = percentile(lat, 50) if lat else None
    ok = actor["bad"] == 0 and actor["digest"] == trainer["digest"] and actor["version"] == trainer["versions"]
    return {
        "actor": str(actor["rank"]),
        "device": actor["device"],
        "pulls": str(actor["pulls"]),
        "episodes": str(len(actor["rewards"])),
        "p50 (ms)": _fmt(None if p50 is None else p50 * 1e3, ".2f"),
        "p99 (ms)": _fmt(percentile(lat, 99) * 1e3 if lat else None, ".2f"),
        "GB/s": _fmt(actor["bytes"] / p50 / 1e9 if p50 and p50 > 0 else None, ".3f"),
        "lag mean": _fmt(_mean(actor["lags"]), ".2f"),
        "lag max": str(max(actor["lags"])) if actor["lags"] else "-",
        "checksums": f"{actor['verified']}/{actor['pulls']}" if verify else "off",
        "reward": _fmt(_mean(actor["rewards"]), ".3f"),
        "last 10%": _fmt(_tenth(actor["rewards"], last=True), ".3f"),
        "check": "ok" if ok else ("FAIL: checksum" if actor["bad"] else "FAIL: weights differ"),
    }


def format_table(cells: list[dict[str, str]], header: list[str]) -> str:
    """Fixed-width table, comment lines prefixed with '#' (nccl-tests style)."""
    return table.text(COLUMNS, {None: cells}, left=LEFT, notes=header)


def _describe(cfg: Config, trainer: dict[str, Any]) -> list[str]:
    where = "cpu" if cfg.device == "cpu" else f"cuda ({torch.cuda.device_count()} GPU(s))"
    bucket = "one message" if cfg.bucket_bytes is None else f"{format_size(cfg.bucket_bytes)} messages"
    actors = "1 actor (rank 1)" if cfg.actors == 1 else f"{cfg.actors} actors (ranks 1-{cfg.actors})"
    return [
        f"cudarecv demo: trainer (rank 0) -> {actors}; {cfg.backend} loopback, weights on {where}",
        (f"policy: MLP {OBS}-{cfg.hidden}-{cfg.hidden}-{ARMS}, {param_count(cfg.hidden):,} float32 params; "
         f"pushed {report.human_bytes(trainer['bytes'])} per version ({trainer['leaves']} leaves with meta) in "
         f"{bucket}; checksums {'on' if cfg.verify else 'off'}; {trainer['versions']} versions"),
        f"{versions()}",
        NOTE,
        LAG_NOTE,
        CHECK_NOTE,
    ]


def _summary(cfg: Config, trainer: dict[str, Any]) -> list[str]:
    rewards, waits = trainer["rewards"], trainer["waits"]
    first, last = _tenth(rewards, last=False), _tenth(rewards, last=True)
    return [
        (f"# trainer reward: first 10% {first:.3f} -> last 10% {last:.3f} ({cfg.steps} steps of {BATCH} contexts; "
         f"random play {1 / ARMS:.3f}, best 1.000)"),
        (f"# trainer waited for the previous push: p50 {percentile(waits, 50) * 1e3:.2f} ms, "
         f"max {max(waits) * 1e3:.2f} ms per step"),
    ]


# --------------------------------------------------------------------------- CLI


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand."""
    p = subparsers.add_parser(
        "demo", help="RL weight sync: a trainer pushes its policy to local actors every step",
        description=__doc__.splitlines()[0],
    )
    d, q = DEFAULTS, QUICK
    p.add_argument("--actors", type=int_at_least(1), metavar="N", default=d["actors"],
                   help=f"actor processes (default {d['actors']})")
    p.add_argument("--steps", type=int_at_least(1), metavar="N",
                   help=f"training steps, one push each (default {d['steps']}; --quick {q['steps']})")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--hidden", type=int_at_least(1), metavar="N",
                      help=f"hidden width of the policy MLP (--quick {q['hidden']})")
    size.add_argument("--model-mib", type=positive_float, metavar="X",
                      help=f"policy size: about X MiB of float32 parameters (default {d['model_mib']:g})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the weights live (cuda: NCCL if every rank gets its own GPU, else gloo)")
    p.add_argument("--bucket-bytes", type=size_or_zero, metavar="SIZE", default=d["bucket_bytes"],
                   help=f"bytes per message, e.g. 1MiB; 0 = one message (default {d['bucket_bytes']})")
    p.add_argument("--verify", action="store_true", help="send and check a checksum with every push")
    p.add_argument("--timeout", type=positive_float, metavar="S", default=d["timeout"],
                   help=f"seconds any wait may take before the demo gives up (default {d['timeout']:g})")
    p.add_argument("--seed", type=int, default=d["seed"], help=f"seed of the task and the policy (default {d['seed']})")
    p.add_argument("--quick", action="store_true", help="tiny and fast (a few seconds), for a smoke test")
    p.add_argument("--kill-actor", type=int, metavar="RANK",
                   help="make that actor die abruptly halfway through (shows how a failure ends the demo)")
    p.set_defaults(func=run)
    return p


def make_config(args: argparse.Namespace) -> Config:
    """Check the options across each other (argparse checked each alone); raises OptionError naming the flag."""
    steps = args.steps if args.steps is not None else (QUICK if args.quick else DEFAULTS)["steps"]
    if args.hidden is not None:
        hidden = args.hidden
    elif args.model_mib is not None:
        hidden = hidden_for(args.model_mib)
    else:
        hidden = QUICK["hidden"] if args.quick else hidden_for(DEFAULTS["model_mib"])
    bucket = args.bucket_bytes or None  # 0: one message
    if args.kill_actor is not None and not 1 <= args.kill_actor <= args.actors:
        raise OptionError(f"must be an actor's rank, 1..{args.actors} (--actors {args.actors}), "
                          f"got {args.kill_actor}", "--kill-actor")
    backend = "gloo"
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise OptionError("cuda, but no CUDA device is visible: use --device cpu", "--device")
        backend = "nccl" if gpus >= args.actors + 1 else "gloo"
    threads = max(1, (os.cpu_count() or 1) // (args.actors + 1))
    cfg = Config(actors=args.actors, steps=steps, hidden=hidden, device=args.device, backend=backend,
                 bucket_bytes=bucket, verify=args.verify, timeout=float(args.timeout), seed=args.seed,
                 threads=threads, kill_actor=args.kill_actor)
    _check_memory(cfg)
    return cfg


def _check_memory(cfg: Config) -> None:
    """Refuse models whose copies would not fit: the trainer holds the parameters, their
    gradients, Adam's two moments and the sender's storage; each actor two storages."""
    model = param_count(cfg.hidden) * 4
    on_host = cfg.device == "cpu"
    need = cfg.world * PROCESS_BYTES + (model * (5 + 2 * cfg.actors) if on_host else 4 * model)
    available = available_memory()
    if available is not None and need > 0.8 * available:
        raise OptionError(
            f"a {model / 1e9:.2f} GB policy with {cfg.actors} actor(s) needs about {need / 1e9:.1f} GB of memory, "
            f"but {available / 1e9:.1f} GB is available: lower --model-mib / --hidden or --actors"
        )


def _run_timeout(cfg: Config) -> float:
    """A bound on the whole run (each wait inside is bounded by ``--timeout`` already)."""
    model = param_count(cfg.hidden) * 4
    per_step = 2.0 + model * cfg.actors / 50e6 + model / 20e6  # generous: 50 MB/s pushes, slow training
    return 2 * cfg.timeout + cfg.steps * per_step


def run(args: argparse.Namespace) -> int:
    """Start the ranks, train and sync, print the table; 0 if every check passed."""
    try:
        cfg = make_config(args)
    except OptionError as exc:
        error("demo", str(exc))
        return 2
    model = param_count(cfg.hidden) * 4
    progress(f"cudarecv demo: starting a trainer and {cfg.actors} actor(s) ({cfg.backend}, weights on "
              f"{cfg.device}); policy hidden {cfg.hidden}, {report.human_bytes(model)}; {cfg.steps} steps")
    t_start = time.perf_counter()
    try:
        with Cluster(cfg.world, backend=cfg.backend, pg_timeout=cfg.timeout,
                     start_timeout=max(120.0, cfg.timeout)) as cluster:
            results = cluster.run(demo_rank, args=(cfg,), timeout=_run_timeout(cfg))
    except RankError as exc:
        error("demo", _explain(exc))
        return 1
    except KeyboardInterrupt:
        error("demo", "interrupted")
        return 130
    trainer, actors = results[0], results[1:]
    cells = [actor_cells(a, trainer, cfg.verify) for a in actors]
    sys.stdout.write(format_table(cells, _describe(cfg, trainer)))
    lines = _summary(cfg, trainer)
    failed = [c["actor"] for c in cells if c["check"] != "ok"]
    elapsed = time.perf_counter() - t_start
    if failed:
        lines.append(f"# checks: actor(s) {', '.join(failed)} FAILED ({elapsed:.1f} s)")
    else:
        lines.append(f"# checks: all {cfg.actors} actor(s) hold the trainer's final weights, version "
                     f"{trainer['versions']} ({elapsed:.1f} s)")
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    return 1 if failed else 0


def _explain(exc: Exception) -> str:
    """A rank's failure: which role, what it raised (last line), then the end of its traceback."""
    text = str(exc).strip()
    raised = re.search(r"rank (\d+) raised:", text)
    if raised is None:  # died or timed out: Cluster's one-line message
        return f"{text} (rank 0 is the trainer, the others are actors)"
    rank = int(raised.group(1))
    role = "the trainer (rank 0)" if rank == 0 else f"actor rank {rank}"
    where = "\n".join("    " + line for line in tail(text, 10).splitlines()[1:-1])
    return f"{role} raised: {text.splitlines()[-1]}\n{where}"
