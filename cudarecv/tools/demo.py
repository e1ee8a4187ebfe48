"""``python -m cudarecv demo``: RL weight sync, a trainer pushing its policy to actors, with
cudarecv and with stock tensordict, side by side.

Usage::

    python -m cudarecv demo [--actors N] [--steps N] [--hidden N | --model-mib X] [--device cpu|cuda]
                            [--mode sync|latest] [--slow-actor RANK] [--slow-seconds S]
                            [--bucket-bytes SIZE] [--verify] [--delta] [--timeout S] [--seed N] [--quick]
                            [--hosts N [--link RATE]]

Starts one trainer (rank 0) and ``--actors`` actor processes (ranks 1..N) on
this machine (one :class:`~cudarecv.testing.launch.Cluster`): gloo on the CPU by
default; with ``--device cuda``, NCCL when every rank can have a GPU of its own
(and ``--mode sync``), else gloo with each process's weights in CUDA memory.
The same training runs twice on the same ranks:

- **cudarecv**: a :class:`~cudarecv.WeightSender` and one
  :class:`~cudarecv.WeightReceiver` per actor. ``--mode sync``: every version
  reaches every actor; the trainer starts each push (``push(wait=False)``) and
  finishes it while it computes the next step; each actor plays one episode per
  version, as stock's does, while the next one travels (the same work: actors
  that played more would take the CPU from the trainer). ``--mode latest``:
  ``push()`` snapshots the weights and returns; each actor asks for the newest
  version and plays one episode while it comes (the same work per version as
  stock's actor; the versions it skips, it never plays).
- **stock**: tensordict's own way: ``init_remote`` once, then
  ``send(consolidated=True)`` to each actor after every step, and
  ``recv(consolidated=True)`` on the actors (every version, in lockstep).

``--hosts N`` runs the trainer and the actors on N simulated hosts instead
(network namespaces with a ``--link`` each, default 1 Gbit/s: see
:mod:`cudarecv.testing.hosts`), launched there with torchrun and c10d
rendezvous; ``--actors`` is then N - 1 unless given (a multiple of N ranks).
Where namespaces cannot be made (not root) it says why and runs on this host.
Under torchrun (on real nodes: the same command each simulated host runs,
``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint
HOST0:29500 --rdzv-id demo -m cudarecv demo``) the demo is one rank of the
run; rank 0 prints the tables.

The task needs no data: a contextual bandit written in torch (one of a few arms
pays 1, chosen by a hidden rule shared by all ranks). The trainer trains a policy
MLP with REINFORCE; actors play episodes with the latest weights they hold.
``--slow-actor RANK`` makes that actor sleep ``--slow-seconds`` after every
version it takes (an actor busy elsewhere): in latest mode the trainer does not
notice; in lockstep it waits for it every step.

At the end two tables: the trainer's (steps per second, push times, reward) and
the actors' (pull latency, version lag, episodes, reward, checks), one row per
implementation, every column explained below them. Every actor must end with
exactly the trainer's final weights.

Exit status: 0 on success; 1 if a rank failed, a checksum failed or an actor's
final weights differ from the trainer's; 2 on bad arguments. Errors print as
``cudarecv demo: error: ...`` (see :mod:`cudarecv.tools.cli`); a bad option's
names its flag.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn

import cudarecv

from ..testing import hosts as sim
from ..testing import table
from ..testing.launch import Cluster, RankError
from . import report
from .cli import OptionError, error, int_at_least, positive_float, size_or_zero
from .console import available_memory, progress, tail, versions
from .transfer_ranks import format_size

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase
    from torch.distributed import Store

DEFAULTS: dict[str, Any] = dict(
    actors=2, steps=200, model_mib=4.0, bucket_bytes="1MiB", timeout=60.0, seed=0, slow_seconds=2.0
)
QUICK: dict[str, int] = dict(steps=40, hidden=64)
IMPLS: tuple[Impl, ...] = ("cudarecv", "stock")
#: the passes, in order: each implementation trains twice (A B B A), and each of its cells is over both. A pass's
#: speed depends on its place in the run (measured: the same two passes in the order cudarecv, stock read 1.00x
#: three times, in the order stock, cudarecv 1.09x and 1.13x), and the machine's speed drifts; in this order both
#: implementations get the same places, and a steady drift falls on both alike
PASSES: tuple[Impl, ...] = IMPLS + IMPLS[::-1]
OBS, ARMS, RULE_WIDTH = 16, 8, 32  # context size, arms, width of the hidden rule
BATCH, ACTOR_BATCH = 256, 64  # contexts per training step / per actor episode
ENV_SECONDS = 0.01  # what an episode waits for its environment, besides the policy's compute
VERSION_KEY = "cudarecv_demo/version"
PROCESS_BYTES = 400 << 20  # a rank's own footprint (torch imported, gloo), roughly
DONE_KEY = "cudarecv_demo/done"
TICK = 1.0  # seconds between progress refreshes: the demo is never silent for long
LINE_EVERY = (
    2.0  # seconds between progress lines without tqdm (each a line of its own, not a redrawn bar)
)
TRAINER_COLUMNS = (
    "impl",
    "steps/s",
    "vs stock",
    "push p50",
    "push p99",
    "push max",
    "reward first",
    "reward last",
)
ACTOR_COLUMNS = (
    "impl",
    "actor",
    "pulls",
    "episodes",
    "p50 ms",
    "p99 ms",
    "lag avg",
    "lag max",
    "reward",
    "checksum",
    "check",
)
LEFT = {"impl", "check"}
TRAINER_NOTES = (
    f"each implementation trains twice, in the order {', '.join(PASSES)} (a pass's place",
    "  in the run changes its speed: each gets the same places); every cell is over both passes",
    "steps/s: training steps per second of wall time, from the first push until every actor holds",
    "  the last version (every push included, the last one's end too); vs stock: steps/s / stock's",
    "push p50 / p99 / max: ms a step spent on weight sync (cudarecv sync: finishing the previous",
    "  push and starting this one; latest: the snapshot; stock: the send to every actor, in turn)",
    "reward first / last: the trainer's mean reward over its first and last 10% of steps",
    f"  (random play {1 / ARMS:.3f}, best 1.000)",
)
DELTA_NOTES = (
    "sent (--delta): the bytes a push took from the trainer, median, as a share of the version",
    "  to every actor (a patch of what changed to each actor on the wire; 0% for actors reading the",
    "  trainer's shared memory; stock sends the version to each). Adam moves every float32 weight",
    "  each step, so here each version goes whole: a patch pays where steps leave most words",
    "  unchanged (docs/delta.md)",
)
ACTOR_NOTES = (
    "actor: its rank (* the --slow-actor); pulls: versions it took (both passes); episodes: batches",
    f"  of contexts it played, {ENV_SECONDS * 1e3:g} ms each at least (sync and stock: one per version, the same",
    "  work; cudarecv's, in both modes, while the next version travels: actors that played more",
    "  would take the CPU from the trainer on a shared machine)",
    "p50 / p99 ms: pull latency, from when the version existed and the actor asked (whichever came",
    "  later) to when it landed in the actor's memory",
    "lag avg / max: versions the trainer was ahead at each episode (its latest push minus the one",
    "  played with)",
    "reward: the actor's mean reward per episode",
    "checksum: versions whose BLAKE3 checksum was verified, of all taken (--verify; stock has none)",
    "check: ok = final weights identical to the trainer's, and no checksum failed",
)


#: where the policy and its weights live; the process group's backend; which implementation runs
Device = Literal["cpu", "cuda"]
Backend = Literal["gloo", "nccl"]
Impl = Literal["cudarecv", "stock"]


@dataclass(frozen=True)
class Config:
    """Everything a rank needs (pickled to the spawned ranks)."""

    actors: int
    steps: int
    hidden: int
    device: Device
    backend: Backend
    bucket_bytes: int | None
    verify: bool
    timeout: float
    seed: int
    threads: int
    mode: cudarecv.Mode = "sync"  # cudarecv's mode
    impl: Impl = "cudarecv"  # which implementation this pass runs
    slow_actor: int | None = None
    slow_seconds: float = 2.0
    kill_actor: int | None = None
    network: str = "loopback"  # where the ranks run, for the tables
    delta: bool = False  # cudarecv sends each actor on the wire what changed (WeightSender's delta)
    round: int = 0  # which of this implementation's passes this is (PASSES)

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
        self.gen = torch.Generator(device).manual_seed(
            seed * 1000 + stream + 1
        )  # the contexts: one stream per rank

    def contexts(self, batch: int) -> torch.Tensor:
        return torch.randn(batch, OBS, generator=self.gen, device=self.a.device)

    def rewards(self, contexts: torch.Tensor, arms: torch.Tensor) -> torch.Tensor:
        best = (torch.tanh(contexts @ self.a) @ self.b).argmax(-1)
        return (arms == best).float()


def make_policy(hidden: int, device: Any = None) -> nn.Sequential:
    """The policy MLP: context -> hidden -> hidden -> arm logits."""
    return nn.Sequential(
        nn.Linear(OBS, hidden, device=device),
        nn.Tanh(),
        nn.Linear(hidden, hidden, device=device),
        nn.Tanh(),
        nn.Linear(hidden, ARMS, device=device),
    )


def param_count(hidden: int) -> int:
    return OBS * hidden + hidden + hidden * hidden + hidden + hidden * ARMS + ARMS


def hidden_for(mib: float) -> int:
    """The hidden width whose float32 parameters take about ``mib`` MiB."""
    target = mib * (1 << 20) / 4
    b = OBS + ARMS + 2
    return max(1, round((-b + math.sqrt(b * b + 4 * (target - ARMS))) / 2))


def _meta(device: torch.device | str) -> TensorDict:
    from tensordict import TensorDict

    return TensorDict(
        {
            "t_push": torch.zeros((), dtype=torch.float64, device=device),
            "version": torch.zeros((), dtype=torch.int64, device=device),
            "step": torch.zeros((), dtype=torch.int64, device=device),
            "last": torch.zeros((), dtype=torch.int64, device=device),
        },
        batch_size=[],
    )


def weights_td(policy: nn.Module, meta: TensorDict) -> TensorDict:
    """What is pushed: the policy's parameters (shared, not copied) and the ``meta`` leaves."""
    from tensordict import TensorDict

    return TensorDict({"policy": TensorDict.from_module(policy), "meta": meta}, batch_size=[])


def digest(td: TensorDictBase) -> str:
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


def _store() -> Store:
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


def _tqdm() -> Any:
    """tqdm's bar class, or None where tqdm (the ``tools`` extra) is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class _Bar:
    """The trainer's progress on stderr, refreshed every :data:`TICK` s by a thread of its own, so its clock
    moves even while a step waits (a lockstep send to a slow actor).

    A tqdm bar where tqdm is installed (the ``tools`` extra); else, so that the demo runs from a plain
    install, a plain line every :data:`LINE_EVERY` s and one at the end (:meth:`line`).
    """

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc = total, desc
        self.count, self.postfix = (
            0,
            dict[str, Any](),
        )  # (read by the thread: each update replaces them whole)
        self.started = time.monotonic()
        tqdm = _tqdm()
        if tqdm is None:
            self.bar = None
            progress(self.line())
        else:
            self.bar = tqdm(
                total=total,
                desc=desc,
                unit="step",
                file=sys.stderr,
                mininterval=TICK,
                dynamic_ncols=True,
                leave=True,
            )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True, name="cudarecv-demo-bar")
        self._thread.start()

    def line(self) -> str:
        """The plain progress line: ``trainer (stock): 12/40 steps in 3 s, reward=0.401, version=13``."""
        text = f"{self.desc}: {self.count}/{self.total} steps in {time.monotonic() - self.started:.0f} s"
        return text + "".join(f", {key}={value}" for key, value in self.postfix.items())

    def _tick(self) -> None:
        every = TICK if self.bar is not None else LINE_EVERY
        while not self._stop.wait(every):
            if self.bar is not None:
                self.bar.refresh()
            else:
                progress(self.line())

    def update(self, **postfix: str) -> None:
        self.count, self.postfix = self.count + 1, postfix
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.bar is not None:
            self.bar.close()
        else:
            progress(self.line())


class _Pushed:
    """What the trainer pushes, and how it stamps each version.

    On the CPU the sender reads the policy's parameters themselves (it copies
    them into its storage inside ``push()``). On a GPU that copy runs later, on
    the push's stream, while the next optimizer step already writes the
    parameters on the trainer's stream: there the sender reads a snapshot,
    refreshed on the trainer's stream once the previous push is out on the GPU.
    """

    def __init__(self, policy: nn.Module, device: torch.device, key: str) -> None:
        from tensordict import TensorDict

        self.key = key
        self.params = TensorDict.from_module(policy)
        self.meta = _meta(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.td = (
            weights_td(policy, self.meta)
            if self.stream is None
            else TensorDict(
                {"policy": self.params.detach().clone(), "meta": self.meta}, batch_size=[]
            )
        )

    def stamp(self, store: Store, version: int, step: int, last: bool) -> None:
        """Stamp the next version (the store says it is the trainer's latest)."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(
                self.stream
            )  # the previous push has read the snapshot
            with torch.no_grad():
                self.td["policy"].update_(self.params)
        self.meta["version"].fill_(version)
        self.meta["step"].fill_(step)
        self.meta["last"].fill_(int(last))
        store.set(self.key, str(version))
        self.meta["t_push"].fill_(time.time())


class _CudarecvPush:
    """Weight sync with cudarecv: sync (start a push, finish it during the next step) or latest."""

    def __init__(
        self, cfg: Config, policy: nn.Module, device: torch.device, ranks: list[int]
    ) -> None:
        self.cfg, self.device, self.ranks = cfg, device, ranks
        self.pushed = _Pushed(policy, device, _version_key(cfg))
        self.sender = cudarecv.WeightSender(
            self.pushed.td,
            dst=ranks,
            bucket_bytes=cfg.bucket_bytes,
            timeout=cfg.timeout,
            verify=cfg.verify,
            stream=self.pushed.stream,
            mode=cfg.mode,
            delta=cfg.delta,
        )
        self.in_flight: _InFlight | None = None
        #: the bytes each push's payloads took from the trainer (all actors; 0: shared memory, a header alone)
        self.sent: list[int] = []
        self.bytes, self.leaves = self.sender.schema.total, len(self.sender.schema.leaves)
        self.fanout, self.bucket_bytes = self.sender.fanout, self.sender.bucket_bytes

    def push(self, store: Store, step: int, last: bool) -> float:
        """Push the next version; return the seconds the trainer spent on it."""
        start = time.perf_counter()
        if self.in_flight is not None:
            self.in_flight.result()  # the previous push must be out before the storage is reused
        if self.sender.version:
            self.sent.append(sum(self.sender.payload_bytes.values()))  # (the previous push's)
        version = self.sender.version + 1
        self.pushed.stamp(store, version, step, last)
        if self.cfg.mode == "latest":
            self.sender.push()  # a snapshot: the actors take it when they are ready
        else:
            transfers = cast(list[cudarecv.Transfer], self.sender.push(wait=False))
            self.in_flight = _InFlight(transfers, self.ranks, version, self.cfg.timeout)
        return time.perf_counter() - start

    def finish(self, store: Store) -> None:
        if self.in_flight is not None:
            self.in_flight.result()
        self.sent.append(sum(self.sender.payload_bytes.values()))
        _wait_done(
            store, self.cfg, len(self.ranks)
        )  # latest: the actors take the last version first

    def close(self) -> None:
        """Close the sender (after the push in flight, if any, has ended: each of its waits is bounded)."""
        if self.in_flight is not None:
            self.in_flight.join()
        self.sender.close()

    @property
    def version(self) -> int:
        return self.sender.version


class _StockPush:
    """Weight sync as stock tensordict does it: init_remote once, then send(consolidated=True)."""

    def __init__(
        self, cfg: Config, policy: nn.Module, device: torch.device, ranks: list[int]
    ) -> None:
        self.ranks, self.cfg = ranks, cfg
        self.params = TensorDict_from_module(policy)
        self.td = weights_td(policy, _meta(device)).consolidate(
            metadata=True
        )  # a copy: stamped and refreshed
        for rank in ranks:
            self.td.init_remote(dst=rank)
        self.version = 0
        self.bytes, self.leaves = (
            self.td._consolidated["storage"].numel(),
            len(list(self.td.keys(True, True))),
        )
        self.fanout, self.bucket_bytes = "star", None  # one send per actor, in turn, of one message
        self.sent: list[
            int
        ] = []  # the bytes each push took from the trainer: the version to each actor

    def push(self, store: Store, step: int, last: bool) -> float:
        start = time.perf_counter()
        self.version += 1
        with torch.no_grad():
            self.td["policy"].update_(self.params)
        meta = self.td["meta"]
        meta["version"].fill_(self.version)
        meta["step"].fill_(step)
        meta["last"].fill_(int(last))
        store.set(_version_key(self.cfg), str(self.version))
        meta["t_push"].fill_(time.time())
        for rank in self.ranks:  # every actor, in turn: each send waits for its receiver
            self.td.send(dst=rank, consolidated=True)
        self.sent.append(self.bytes * len(self.ranks))
        return time.perf_counter() - start

    def finish(self, store: Store) -> None:
        _wait_done(store, self.cfg, len(self.ranks))

    def close(self) -> None:
        """Nothing to release: stock's sends end before they return."""


def TensorDict_from_module(policy: nn.Module) -> Any:  # noqa: N802 - the tensordict constructor it wraps
    from tensordict import TensorDict

    return TensorDict.from_module(policy)


def _done_key(cfg: Config) -> str:
    return f"{DONE_KEY}/{cfg.impl}/{cfg.mode}/{cfg.round}"


def _version_key(cfg: Config) -> str:
    """Where the trainer keeps the version it pushed last (this pass's own key)."""
    return f"{VERSION_KEY}/{cfg.impl}/{cfg.mode}/{cfg.round}"


def _wait_done(store: Store, cfg: Config, actors: int) -> None:
    """Wait (bounded by ``--timeout``) until every actor holds the last version."""
    deadline = time.monotonic() + cfg.timeout
    while store.add(_done_key(cfg), 0) < actors:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the actors did not all take the last version within {cfg.timeout:g} s"
            )
        time.sleep(0.01)


@dataclass
class _InFlight:
    """A push started with ``push(wait=False)``: one transfer per actor (bounded by ``--timeout``), on its way while
    the trainer computes the next step. The trainer waits for them, on its own thread, only before the next push:
    by then the actors have answered, and the wait takes each answer there (an actor reading the trainer's shared
    memory: nothing of the sender ran meanwhile; on the wire, the sender's thread for that actor drove it)."""

    transfers: list[cudarecv.Transfer]
    ranks: list[int]
    version: int
    timeout: float

    def result(self) -> None:
        """Wait for every actor's transfer (bounded by ``timeout`` in all); raises naming the actor that failed."""
        deadline = time.monotonic() + self.timeout
        for rank, transfer in zip(self.ranks, self.transfers):
            try:
                transfer.wait(max(deadline - time.monotonic(), 1e-3))
            except Exception as error:  # re-raised naming the actor
                raise RuntimeError(
                    f"the push of version {self.version} to actor rank {rank} failed: {error}"
                ) from error

    def join(self) -> None:
        """Wait for the end, whatever it was (before closing the sender)."""
        with contextlib.suppress(Exception):
            self.result()


def _trainer(cfg: Config, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    policy = make_policy(cfg.hidden, device)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    env = Bandit(cfg.seed, device)
    store = _store()
    store.set(_version_key(cfg), "0")  # the actors read it from their first episode on
    ranks = list(range(1, cfg.world))
    rewards: list[float] = []
    pushes: list[float] = []
    push = _CudarecvPush if cfg.impl == "cudarecv" else _StockPush
    # the bar first: it ticks from the handshake on
    with (
        closing(_Bar(cfg.steps, f"trainer ({_label(cfg, cfg.impl)})")) as bar,
        closing(push(cfg, policy, device, ranks)) as sync,
    ):
        started = time.perf_counter()
        pushes.append(sync.push(store, step=0, last=False))  # version 1: the initial weights
        for step in range(1, cfg.steps + 1):
            rewards.append(_train_step(policy, opt, env))
            pushes.append(sync.push(store, step=step, last=step == cfg.steps))
            recent = rewards[-max(1, cfg.steps // 10) :]
            bar.update(reward=f"{sum(recent) / len(recent):.3f}", version=str(sync.version))
        sync.finish(store)
        seconds = (
            time.perf_counter() - started
        )  # every actor holds the last version: each impl's whole cost
    return dict(
        role="trainer",
        impl=cfg.impl,
        rewards=rewards,
        pushes=pushes,
        seconds=seconds,
        versions=sync.version,
        bytes=sync.bytes,
        leaves=sync.leaves,
        fanout=sync.fanout,
        bucket_bytes=sync.bucket_bytes,
        sent=sync.sent,
        digest=digest(TensorDict_from_module(policy)),
    )


@dataclass
class _ActorStats:
    latencies: list[float]
    lags: list[int]
    rewards: list[float]
    verified: int = 0
    bad: int = 0


def _act(policy: nn.Module, params: dict[str, torch.Tensor], env: Bandit) -> float:
    """One episode (a batch of contexts) with the given weights; its mean reward. The episode
    also waits :data:`ENV_SECONDS`, for an environment's own time: actors that played flat out
    would take the CPU from a trainer on the same machine."""
    x = env.contexts(ACTOR_BATCH)
    with torch.no_grad():
        logits = torch.func.functional_call(policy, params, (x,))
    arms = torch.distributions.Categorical(logits=logits).sample()
    time.sleep(ENV_SECONDS)
    return float(env.rewards(x, arms).mean())


def _actor(rank: int, cfg: Config, device: torch.device) -> dict[str, Any]:
    skeleton = make_policy(cfg.hidden, "meta")  # structure only: the weights are the received views
    env = Bandit(cfg.seed, device, stream=rank)
    store = _store()
    stats = _ActorStats([], [], [])
    run = _cudarecv_actor if cfg.impl == "cudarecv" else _stock_actor
    version, nbytes, final = run(rank, cfg, device, skeleton, env, store, stats)
    store.add(_done_key(cfg), 1)
    return dict(
        role="actor",
        impl=cfg.impl,
        rank=rank,
        device=str(device),
        pulls=len(stats.latencies) + stats.bad,
        latencies=stats.latencies,
        lags=stats.lags,
        rewards=stats.rewards,
        verified=stats.verified,
        bad=stats.bad,
        version=version,
        bytes=nbytes,
        digest=final,
    )


def _between_pulls(rank: int, cfg: Config, meta: Any) -> None:
    if cfg.kill_actor == rank and int(meta["step"]) >= cfg.steps // 2:
        os.kill(os.getpid(), signal.SIGKILL)  # --kill-actor: die abruptly, as a crashed actor would
    if cfg.slow_actor == rank:
        time.sleep(cfg.slow_seconds)  # --slow-actor: busy elsewhere between pulls


def _stamping(at: list[float]) -> Callable[[object], None]:
    """A done-callback that appends the time it runs at to ``at`` (this pull's own list)."""
    return lambda _: at.append(time.time())


def _cudarecv_actor(
    rank: int,
    cfg: Config,
    device: torch.device,
    skeleton: nn.Module,
    env: Bandit,
    store: Store,
    stats: _ActorStats,
) -> tuple[int, int, str]:
    receiver = cudarecv.WeightReceiver(
        src=0,
        device=device,
        expect=weights_td(skeleton, _meta("meta")),
        timeout=cfg.timeout,
        zero_copy=device.type
        == "cpu",  # on the trainer's host: play with the weights where they lie
    )
    views: dict[
        int, tuple[Any, dict[str, torch.Tensor]]
    ] = {}  # per receiver storage: its meta and params
    try:
        while True:
            asked = time.time()
            # the receiver's thread finishes it
            transfer = cast(cudarecv.Transfer, receiver.pull(wait=False))
            landed: list[float] = []
            transfer.add_done_callback(_stamping(landed))  # runs as it is published
            if receiver.version > 0:  # one episode with what it has meanwhile, as stock's actor
                _episode(receiver, skeleton, env, store, _version_key(cfg), stats, views)
            try:
                transfer.wait(cfg.timeout)
            except cudarecv.ChecksumError:
                stats.bad += 1
                continue
            stats.verified += int(cfg.verify)
            meta = receiver.td["meta"]
            stats.latencies.append(landed[0] - max(float(meta["t_push"]), asked))
            if int(meta["last"]):
                break
            _between_pulls(rank, cfg, meta)
    finally:
        receiver.close()
    return receiver.version, receiver.schema.total, digest(receiver.td["policy"])


def _stock_actor(
    rank: int,
    cfg: Config,
    device: torch.device,
    skeleton: nn.Module,
    env: Bandit,
    store: Store,
    stats: _ActorStats,
) -> tuple[int, int, str]:
    from tensordict import TensorDict

    td = TensorDict.from_remote_init(src=0, device=device)
    params = td["policy"].flatten_keys(".").to_dict()  # version 0 came with init_remote
    while True:
        meta = td["meta"]
        if int(meta["last"]):
            break
        _between_pulls(rank, cfg, meta)
        stats.rewards.append(_act(skeleton, params, env))  # one episode per version: recv blocks
        stats.lags.append(int(store.get(_version_key(cfg))) - int(meta["version"]))
        asked = time.time()
        td.recv(src=0, consolidated=True)
        stats.latencies.append(time.time() - max(float(td["meta", "t_push"]), asked))
    return int(td["meta", "version"]), td._consolidated["storage"].numel(), digest(td["policy"])


def _episode(
    receiver: Any,
    skeleton: nn.Module,
    env: Bandit,
    store: Store,
    key: str,
    stats: _ActorStats,
    views: dict[int, tuple[Any, dict[str, torch.Tensor]]],
) -> None:
    """Play one episode with the latest version; record its reward and version lag."""
    with receiver.reading() as td:  # the version acted with stays put meanwhile
        if id(td) not in views:
            views[id(td)] = (td["meta"], td["policy"].flatten_keys(".").to_dict())
        meta, params = views[id(td)]
        acted = int(meta["version"])
        lag = int(store.get(key)) - acted  # the trainer sets it before pushing: never negative
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


def _label(cfg: Config, impl: str) -> str:
    return "stock" if impl == "stock" else f"cudarecv {cfg.mode}"


def trainer_cells(cfg: Config, trainer: dict[str, Any], stock: dict[str, Any]) -> dict[str, str]:
    """One row of the trainer's table: cells keyed by column (``stock``: the stock run's trainer, the
    reference of ``vs stock``)."""
    pushes = trainer["pushes"]
    return {
        "impl": _label(cfg, trainer["impl"]),
        "steps/s": _fmt(trainer.get("steps", cfg.steps) / trainer["seconds"], ".1f"),
        "vs stock": _fmt(stock["seconds"] / trainer["seconds"], ".2f") + "x",
        "push p50": _fmt(percentile(pushes, 50) * 1e3, ".2f"),
        "push p99": _fmt(percentile(pushes, 99) * 1e3, ".2f"),
        "push max": _fmt(max(pushes) * 1e3, ".2f"),
        "reward first": _fmt(_tenth(trainer["rewards"], last=False), ".3f"),
        "reward last": _fmt(_tenth(trainer["rewards"], last=True), ".3f"),
        **({"sent": _sent(cfg, trainer)} if cfg.delta else {}),
    }


def _sent(cfg: Config, trainer: dict[str, Any]) -> str:
    """The bytes a push took from the trainer, median, as a share of the version to every actor (stock sends
    the version to each)."""
    return f"{percentile(trainer['sent'], 50) / (trainer['bytes'] * cfg.actors):.0%}"


def actor_cells(cfg: Config, actor: dict[str, Any], trainer: dict[str, Any]) -> dict[str, str]:
    """One row of the actors' table: cells keyed by column."""
    lat = actor["latencies"]
    ok = (
        actor["bad"] == 0
        and actor["digest"] == trainer["digest"]
        and actor["version"] == trainer["versions"]
    )
    checked = (
        f"{actor['verified']}/{actor['pulls']}"
        if cfg.verify and actor["impl"] == "cudarecv"
        else "off"
    )
    return {
        "impl": _label(cfg, actor["impl"]),
        "actor": str(actor["rank"]) + ("*" if cfg.slow_actor == actor["rank"] else ""),
        "pulls": str(actor["pulls"]),
        "episodes": str(len(actor["rewards"])),
        "p50 ms": _fmt(percentile(lat, 50) * 1e3 if lat else None, ".2f"),
        "p99 ms": _fmt(percentile(lat, 99) * 1e3 if lat else None, ".2f"),
        "lag avg": _fmt(_mean(actor["lags"]), ".2f"),
        "lag max": str(max(actor["lags"])) if actor["lags"] else "-",
        "reward": _fmt(_mean(actor["rewards"]), ".3f"),
        "checksum": checked if actor["impl"] == "cudarecv" else "-",
        "check": "ok" if ok else ("FAIL: checksum" if actor["bad"] else "FAIL: weights differ"),
    }


def _describe(cfg: Config, trainer: dict[str, Any]) -> list[str]:
    where = "cpu" if cfg.device == "cpu" else f"cuda ({torch.cuda.device_count()} GPU(s))"
    bucket_bytes = trainer.get("bucket_bytes", cfg.bucket_bytes)
    bucket = (
        "one message"
        if bucket_bytes is None or bucket_bytes >= trainer["bytes"]
        else f"{format_size(bucket_bytes)} messages"
    )
    actors = (
        "1 actor (rank 1)" if cfg.actors == 1 else f"{cfg.actors} actors (ranks 1-{cfg.actors})"
    )
    slow = (
        []
        if cfg.slow_actor is None
        else [
            f"slow actor: rank {cfg.slow_actor} sleeps {cfg.slow_seconds:g} s "
            "after every version it takes"
        ]
    )
    return [
        f"cudarecv demo: trainer (rank 0) -> {actors}; {cfg.backend} {cfg.network}, weights on {where}"
        if cfg.network == "loopback"
        else f"cudarecv demo: trainer (rank 0) -> {actors}; {cfg.backend}, weights on {where}",
        *([] if cfg.network == "loopback" else [f"ranks: {cfg.network}"]),
        *slow,
        (
            f"policy: MLP {OBS}-{cfg.hidden}-{cfg.hidden}-{ARMS}, {param_count(cfg.hidden):,} float32 params, "
            f"{report.human_bytes(trainer['bytes'])} per version"
        ),
        f"cudarecv: mode {cfg.mode}, fan-out {trainer.get('fanout', 'star')}, {bucket}, "
        f"checksums {'on' if cfg.verify else 'off'}",
        f"stock: init_remote, then send/recv(consolidated=True); {trainer['versions']} versions each",
        versions(),
    ]


def report_text(cfg: Config, trainers: list[dict[str, Any]], actors: list[dict[str, Any]]) -> str:
    """Both tables with their notes, every line within 100 columns."""
    by_impl = {t["impl"]: t for t in trainers}
    out = table.text(
        TRAINER_COLUMNS + (("sent",) if cfg.delta else ()),
        {None: [trainer_cells(cfg, t, by_impl["stock"]) for t in trainers]},
        left=LEFT,
        notes=_describe(cfg, trainers[0]),
    )
    notes = TRAINER_NOTES + (DELTA_NOTES if cfg.delta else ())
    out += "#\n" + "".join(f"# {note}\n" for note in notes)
    out += table.text(
        ACTOR_COLUMNS, {None: [actor_cells(cfg, a, by_impl[a["impl"]]) for a in actors]}, left=LEFT
    )
    out += "#\n" + "".join(f"# {note}\n" for note in ACTOR_NOTES)
    return out


# --------------------------------------------------------------------------- CLI


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand."""
    p = subparsers.add_parser(  # its description: cli.main's, from this module's docstring
        "demo",
        help="RL weight sync: a trainer pushes its policy to local actors, cudarecv vs stock",
    )
    d, q = DEFAULTS, QUICK
    p.add_argument(
        "--actors",
        type=int_at_least(1),
        metavar="N",
        help=f"actor processes (default {d['actors']}; with --hosts N or under torchrun: the ranks - 1)",
    )
    p.add_argument(
        "--steps",
        type=int_at_least(1),
        metavar="N",
        help=f"training steps, one push each (default {d['steps']}; --quick {q['steps']})",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--hidden",
        type=int_at_least(1),
        metavar="N",
        help=f"hidden width of the policy MLP (--quick {q['hidden']})",
    )
    size.add_argument(
        "--model-mib",
        type=positive_float,
        metavar="X",
        help=f"policy size: about X MiB of float32 parameters (default {d['model_mib']:g})",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the weights live (cuda: NCCL if every rank gets its own GPU, else gloo)",
    )
    p.add_argument(
        "--mode",
        choices=("sync", "latest"),
        default="sync",
        help="cudarecv's mode: every version to every actor, or the newest when each is ready",
    )
    p.add_argument(
        "--slow-actor", type=int, metavar="RANK", help="make that actor sleep after every pull"
    )
    p.add_argument(
        "--slow-seconds",
        type=positive_float,
        metavar="S",
        default=d["slow_seconds"],
        help=f"how long --slow-actor sleeps after each pull (default {d['slow_seconds']:g})",
    )
    p.add_argument(
        "--bucket-bytes",
        type=size_or_zero,
        metavar="SIZE",
        default=d["bucket_bytes"],
        help=f"bytes per message, e.g. 1MiB; 0 = cudarecv's default (default {d['bucket_bytes']})",
    )
    p.add_argument(
        "--verify", action="store_true", help="send and check a checksum with every push"
    )
    p.add_argument(
        "--delta",
        action="store_true",
        help="cudarecv sends each actor on the wire only what changed (with --hosts), and the tables "
        "say how much a push sent",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        metavar="S",
        default=d["timeout"],
        help=f"seconds any wait may take before the demo gives up (default {d['timeout']:g})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=d["seed"],
        help=f"seed of the task and the policy (default {d['seed']})",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny and fast (a few seconds), for a smoke test"
    )
    p.add_argument(
        "--kill-actor",
        type=int,
        metavar="RANK",
        help="make that actor die abruptly halfway through (shows how a failure ends the demo)",
    )
    p.add_argument(
        "--hosts",
        type=int_at_least(2),
        metavar="N",
        help="run the ranks on N simulated hosts (network namespaces, torchrun; needs root)",
    )
    p.add_argument(
        "--link",
        metavar="RATE",
        default="1gbit",
        type=_link,
        help="with --hosts: each host's link speed each way, as tc writes it (default 1gbit)",
    )
    p.set_defaults(func=run)
    return p


def _link(text: str) -> str:
    if not sim.is_rate(text):
        raise argparse.ArgumentTypeError(
            f"not a link rate: {text!r}; write it as tc does, like 1gbit or 100mbit"
        )
    return text


def _actor_rank(value: int | None, actors: int, flag: str) -> None:
    if value is not None and not 1 <= value <= actors:
        raise OptionError(
            f"must be an actor's rank, 1..{actors} (--actors {actors}), got {value}", flag
        )


def make_config(args: argparse.Namespace) -> Config:
    """Check the options across each other (argparse checked each alone); raises OptionError naming the flag."""
    steps = args.steps if args.steps is not None else (QUICK if args.quick else DEFAULTS)["steps"]
    world = _torchrun_world()
    if world is not None or args.hosts is not None:
        ranks = world if world is not None else args.hosts
        if args.actors is None:
            args.actors = ranks - 1
        if (args.actors + 1) % ranks if world is None else args.actors + 1 != ranks:
            flag = "--hosts" if world is None else "--actors"
            raise OptionError(
                f"{args.actors} actors and a trainer are {args.actors + 1} ranks, which "
                + (
                    f"{ranks} hosts cannot share evenly"
                    if world is None
                    else f"is not this torchrun run's {ranks}"
                ),
                flag,
            )
        if args.device != "cpu" and args.hosts is not None:
            raise OptionError(
                "simulated hosts are for the CPU path: on GPU nodes run the demo under torchrun",
                "--device",
            )
    elif args.actors is None:
        args.actors = DEFAULTS["actors"]
    if args.hidden is not None:
        hidden = args.hidden
    elif args.model_mib is not None:
        hidden = hidden_for(args.model_mib)
    else:
        hidden = QUICK["hidden"] if args.quick else hidden_for(DEFAULTS["model_mib"])
    bucket = args.bucket_bytes or None  # 0: the WeightSender's default
    _actor_rank(args.kill_actor, args.actors, "--kill-actor")
    _actor_rank(args.slow_actor, args.actors, "--slow-actor")
    backend: Backend = "gloo"
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise OptionError("cuda, but no CUDA device is visible: use --device cpu", "--device")
        backend = "nccl" if gpus >= args.actors + 1 and args.mode == "sync" else "gloo"
    threads = max(1, (os.cpu_count() or 1) // (args.actors + 1))
    network = "loopback"
    if world is not None:
        nodes = os.environ.get("GROUP_WORLD_SIZE", "?")
        link = os.environ.get("CUDARECV_LINK")
        network = (
            f"{nodes} simulated hosts ({link} links)" if link else f"{nodes} nodes"
        ) + ", launched with torchrun"
    cfg = Config(
        actors=args.actors,
        steps=steps,
        hidden=hidden,
        device=args.device,
        backend=backend,
        bucket_bytes=bucket,
        verify=args.verify,
        timeout=float(args.timeout),
        seed=args.seed,
        threads=threads,
        mode=args.mode,
        slow_actor=args.slow_actor,
        slow_seconds=float(args.slow_seconds),
        kill_actor=args.kill_actor,
        network=network,
        delta=args.delta,
    )
    _check_memory(cfg)
    return cfg


def _check_memory(cfg: Config) -> None:
    """Refuse models whose copies would not fit: the trainer holds the parameters, their
    gradients, Adam's two moments, the sender's storages and stock's consolidated copy; each
    actor two storages."""
    model = param_count(cfg.hidden) * 4
    on_host = cfg.device == "cpu"
    snapshots = 1 if cfg.mode == "sync" else cfg.actors + 2
    need = cfg.world * PROCESS_BYTES + (
        model * (5 + snapshots + 2 * cfg.actors) if on_host else 5 * model
    )
    available = available_memory()
    if available is not None and need > 0.8 * available:
        raise OptionError(
            f"a {model / 1e9:.2f} GB policy with {cfg.actors} actor(s) needs about {need / 1e9:.1f} GB of memory, "
            f"but {available / 1e9:.1f} GB is available: lower --model-mib / --hidden or --actors"
        )


def _run_timeout(cfg: Config) -> float:
    """A bound on one pass (each wait inside is bounded by ``--timeout`` already)."""
    model = param_count(cfg.hidden) * 4
    per_step = (
        2.0 + model * cfg.actors / 50e6 + model / 20e6
    )  # generous: 50 MB/s pushes, slow training
    if cfg.slow_actor is not None:
        per_step += cfg.slow_seconds  # lockstep waits for the slow actor every step
    return 2 * cfg.timeout + cfg.steps * per_step


class _Heartbeat:
    """A progress line now, and another every 2 s while ``what`` lasts (never a silent stretch)."""

    def __init__(self, what: str) -> None:
        self.what, self.started = what, time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, daemon=True, name="cudarecv-demo-heartbeat"
        )

    def _beat(self) -> None:
        while not self._stop.wait(2.0):
            progress(f"cudarecv demo: {self.what} ({time.monotonic() - self.started:.0f} s)")

    def __enter__(self) -> _Heartbeat:
        progress(f"cudarecv demo: {self.what}")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _torchrun_world() -> int | None:
    """The world size when this process is a rank that torchrun started, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def run(args: argparse.Namespace) -> int:
    """Start the ranks, train and sync with each implementation, print the tables; 0 if every check passed."""
    if args.hosts is not None and _torchrun_world() is None:
        try:
            cfg = make_config(args)  # also sets --actors from --hosts
        except OptionError as exc:
            error("demo", str(exc))
            return 2
        reason = sim.unavailable()
        if reason is None:
            return _run_hosts(args, cfg)
        progress(
            f"cudarecv demo: --hosts {args.hosts} needs network namespaces ({reason}); "
            "running every rank on this host instead"
        )
        args.hosts = None
    try:
        cfg = make_config(args)
    except OptionError as exc:
        error("demo", str(exc))
        return 2
    if _torchrun_world() is not None:
        return _run_rank(cfg)
    t_start = time.perf_counter()
    training = threading.Event()  # set once a pass started: the trainer's bar may be on the screen
    try:
        trainers, actors = _train(cfg, training)
    except RankError as exc:  # the failed call has stopped every rank
        error("demo", _explain(exc))
        return 1
    except (
        KeyboardInterrupt
    ):  # every rank is gone already (_train); only the parent says so, in one line
        if training.is_set() and _tqdm() is not None:
            print(
                file=sys.stderr
            )  # below the trainer's bar, which a killed trainer leaves without a newline
        error("demo", "interrupted")
        return 130
    return _finish(cfg, trainers, actors, time.perf_counter() - t_start)


def _train(cfg: Config, training: threading.Event) -> tuple[list[dict], list[dict]]:
    """Start the ranks, run a pass with each implementation, stop the ranks; the trainers' results and the
    actors', in rank order. Sets ``training`` once a pass starts.

    Ctrl-C (``KeyboardInterrupt``, the parent's alone: the ranks run in a session of their own) at any
    moment kills every rank at once, wherever it is (starting, connecting, in a pass, leaving): they print
    nothing, and the exception goes on to the caller. A failed pass raises :class:`RankError` with every
    rank stopped.
    """
    model = param_count(cfg.hidden) * 4
    trainers: list[dict] = []
    actors: list[dict] = []
    cluster: Cluster | None = None
    try:
        with _Heartbeat(
            f"starting a trainer and {cfg.actors} actor(s) ({cfg.backend}, weights on {cfg.device}; "
            f"policy {report.human_bytes(model)}, {cfg.steps} steps)"
        ):
            cluster = Cluster(
                cfg.world,
                backend=cfg.backend,
                pg_timeout=cfg.timeout,
                start_timeout=max(120.0, cfg.timeout),
            )
        passes = []
        for impl, turn in _passes():
            progress(f"cudarecv demo: training with {_label(cfg, impl)}{_pass_of(turn)}")
            training.set()
            passes.append(
                cluster.run(
                    demo_rank,
                    args=(replace(cfg, impl=impl, round=turn),),
                    timeout=_run_timeout(cfg),
                )
            )
        trainers, actors = combined(passes)
        with _Heartbeat("stopping the ranks"):
            cluster.close()  # each rank leaves and must exit normally (else RankError)
    except BaseException:
        if cluster is not None:
            cluster.kill()  # (already done by an interrupted or failed call: then nothing is left to do)
        raise
    return trainers, actors


def _passes() -> list[tuple[Impl, int]]:
    """The passes in :data:`PASSES` order, each with its round: which of its implementation's passes it is."""
    return [(impl, PASSES[:i].count(impl)) for i, impl in enumerate(PASSES)]


def _pass_of(turn: int) -> str:
    return f" (pass {turn + 1} of 2)"


def combined(passes: list[list[dict[str, Any]]]) -> tuple[list[dict], list[dict]]:
    """Each implementation's passes (in :data:`PASSES` order: each the results of every rank, the trainer's first)
    as one trainer and one row per actor, in :data:`IMPLS` and rank order: its time the sum of its passes', its
    pushes, pulls and episodes those of every pass; an actor holds the trainer's weights if it did in every pass."""
    trainers, actors = [], []
    for impl in IMPLS:
        mine = [results for kind, results in zip(PASSES, passes) if kind == impl]
        first = mine[0][0]
        trainers.append(
            {
                **first,
                "seconds": sum(results[0]["seconds"] for results in mine),
                "steps": sum(len(results[0]["rewards"]) for results in mine),
                "pushes": [p for results in mine for p in results[0]["pushes"]],
                "sent": [b for results in mine for b in results[0].get("sent", [])],
            }
        )
        for rank in range(1, len(mine[0])):
            rows = [(results[0], results[rank]) for results in mine]
            held = all(
                a["digest"] == t["digest"] and a["version"] == t["versions"] for t, a in rows
            )
            actor = rows[0][1]
            actors.append(
                {
                    **actor,
                    **{
                        key: [v for _, a in rows for v in a[key]]
                        for key in ("latencies", "lags", "rewards")
                    },
                    **{key: sum(a[key] for _, a in rows) for key in ("pulls", "verified", "bad")},
                    # (the check compares it with the first pass's trainer: the same weights, if it held them each time)
                    "digest": actor["digest"] if held else None,
                }
            )
    return trainers, actors


def _finish(cfg: Config, trainers: list[dict], actors: list[dict], elapsed: float) -> int:
    """Print the tables and the checks line; 1 if a check failed."""
    text = report_text(cfg, trainers, actors)
    rows = [actor_cells(cfg, a, {t["impl"]: t for t in trainers}[a["impl"]]) for a in actors]
    failed = [f"{r['impl']} actor {r['actor']}" for r in rows if r["check"] != "ok"]
    if failed:
        text += f"# checks: {', '.join(failed)} FAILED ({elapsed:.1f} s)\n"
    else:
        text += (
            f"# checks: every actor holds the trainer's final weights, version {trainers[0]['versions']}, "
            f"with both ({elapsed:.1f} s)\n"
        )
    sys.stdout.write(text)
    sys.stdout.flush()
    return 1 if failed else 0


def _run_rank(cfg: Config) -> int:
    """Under torchrun: this process is one rank; rank 0 gathers every rank's results and prints the tables."""
    from datetime import timedelta

    import torch.distributed as dist

    started = time.perf_counter()
    if cfg.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(cfg.backend, timeout=timedelta(seconds=max(cfg.timeout, 60.0)))
    try:
        rank = dist.get_rank()
        if rank == 0:
            progress(
                f"cudarecv demo: a trainer and {cfg.actors} actor(s) under torchrun, {cfg.world} ranks"
            )
        mine = []
        for impl, turn in _passes():
            if rank == 0:
                progress(f"cudarecv demo: training with {_label(cfg, impl)}{_pass_of(turn)}")
            mine.append(demo_rank(rank, cfg.world, None, replace(cfg, impl=impl, round=turn)))
            dist.barrier()
        every: list[Any] = [None] * cfg.world if rank == 0 else []
        dist.gather_object(mine, every if rank == 0 else None, dst=0)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    trainers, actors = combined(
        [[every[r][i] for r in range(cfg.world)] for i in range(len(PASSES))]
    )
    return _finish(cfg, trainers, actors, time.perf_counter() - started)


def _run_hosts(args: argparse.Namespace, cfg: Config) -> int:
    """``--hosts N``: the same demo under torchrun on N simulated hosts (this process only launches).
    Ctrl-C stops every rank on every host at once (they print nothing more), then returns 130."""
    argv = [
        "cudarecv",
        "demo",
        "--actors",
        str(cfg.actors),
        "--steps",
        str(cfg.steps),
        "--hidden",
        str(cfg.hidden),
        "--mode",
        cfg.mode,
        "--bucket-bytes",
        str(cfg.bucket_bytes or 0),
        "--timeout",
        str(cfg.timeout),
        "--seed",
        str(cfg.seed),
        "--slow-seconds",
        str(cfg.slow_seconds),
    ]
    argv += ["--verify"] if cfg.verify else []
    argv += ["--delta"] if cfg.delta else []
    for flag, value in (("--slow-actor", cfg.slow_actor), ("--kill-actor", cfg.kill_actor)):
        argv += [flag, str(value)] if value is not None else []
    try:
        with sim.SimulatedHosts(args.hosts, rate=args.link) as hosts:
            progress(
                f"cudarecv demo: {args.hosts} simulated hosts ({args.link} links, 127.100.0.1-{args.hosts}), "
                f"{cfg.world // args.hosts} rank(s) each, launched with torchrun"
            )
            procs = hosts.torchrun(
                "-m",
                argv,
                nproc_per_node=cfg.world // args.hosts,
                env={"TORCH_CPP_LOG_LEVEL": "ERROR", "CUDARECV_LINK": args.link},
            )
            hosts.wait(
                procs, timeout=len(PASSES) * _run_timeout(cfg) + 120
            )  # a failed host ends the run at once
    except sim.HostsError as exc:  # (the others' torchrun would wait 300 s in its exit barrier)
        error("demo", str(exc))
        return 1
    except KeyboardInterrupt:  # the hosts are closed: every process on them is gone
        print(file=sys.stderr)  # below the trainer's bar, which ends without a newline
        error("demo", "interrupted")
        return 130
    return 0


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
