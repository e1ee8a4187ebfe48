"""What a cudarecv weight transfer is set up with: the trainer's settings (:class:`CudarecvTrainerInitInfo`), what
travels to each vLLM worker at ``init_weight_transfer_engine`` (:class:`CudarecvInitInfo`) and with each update
(:class:`CudarecvUpdateInfo`). The worker's two go through vLLM's RPC (msgspec, or JSON over HTTP): plain values."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .. import ArgumentError, Mode, TransportPolicy, WeightSender

#: vLLM's ``pause_generation`` modes (``vllm.v1.engine.PauseMode``)
PauseMode = Literal["keep", "wait", "abort"]

#: The name of the backend, on both sides: ``weight_transfer_config={"backend": BACKEND}``.
BACKEND = "cudarecv"


@dataclass
class CudarecvTrainerInitInfo(TrainerInitInfo):
    """The trainer's settings; every field has a default that works for a trainer and an engine on one machine.

    Args:
        host: the address of the trainer's store, which the engine's workers connect to (the trainer's address
            when the engine runs on another machine).
        port: the store's port (0: any free one).
        timeout: seconds any step may take: the workers joining, one update, a worker's answer.
        mode: ``"sync"`` (``send_weights()`` returns once every worker loaded the version) or ``"latest"``
            (the same for the engine, the sender keeps a spare snapshot so a slow worker never holds up a push).
        verify: send a BLAKE3 digest with every version; a worker refuses a corrupted one.
        bucket_bytes: bytes per payload message on the wire (None: cudarecv's choice).
        transport: ``"auto"`` (shared memory with workers on the trainer's machine) or ``"wire"``.
        dtype: the dtype the weights travel and load in (None: the engine's, which its workers report).
        delta: each update goes to a worker on the wire as the words that changed since the version it holds
            (see :class:`~cudarecv.WeightSender`'s ``delta``), diffed in ``dtype``; the worker patches its copy
            and loads the whole version (a tensor-parallel engine's workers: their slices).
        staged: each worker loads and processes every version beside the served model as soon as it lands, while
            the engine goes on generating (:mod:`cudarecv.vllm.staged`); the engine then pauses only to copy the
            result into place. Costs one processed copy of the model per worker; False: vLLM's in-place reload in
            the pause, as a disk reload.
        pause: whether and how the engine's scheduler is paused around each update (vLLM's ``pause_generation``
            mode, for ``vllm serve`` and Ray actors; an ``LLM`` object never generates during an update). None
            (the default) does not pause: the update's calls run between two steps, as vLLM's RPCs do, no
            request is aborted, and a step may run between the new weights and their ``weight_version`` (its
            outputs then carry the previous number). ``"keep"`` freezes the requests in flight, which go on with
            the new weights, and no step runs between the new weights and their number, so every output
            carries the version that produced it (the pause then lasts its five calls to the engine, 0.5-1 s on
            a busy 2-core machine instead of 0.2-0.25 s); ``"wait"`` lets them finish with the old weights
            first (no request spans two versions); ``"abort"`` aborts them.
        join_wait: (a fleet's) seconds ``trainer_init``, once one engine joined, and each ``send_weights`` wait for
            the joins of the other engines before they go on (an engine that is down answers at once; one that is
            up joins in about a second; a join still under way then goes on, and its engine takes a later update).
        rank: this trainer rank (vLLM's field); rank 0 sends, the others only take part in the source's collectives.

    Example:
        >>> info = CudarecvTrainerInitInfo(rank=0)
        >>> trainer = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ModuleSource(model))
    """

    backend: ClassVar[str] = BACKEND
    host: str = "127.0.0.1"
    port: int = 0
    timeout: float = 120.0
    mode: Mode = "sync"
    verify: bool = True
    bucket_bytes: int | None = None
    transport: TransportPolicy = "auto"
    dtype: str | None = None
    delta: bool = False
    staged: bool = True
    pause: PauseMode | None = None
    join_wait: float = 10.0
    rank: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ArgumentError(
                f"`rank` must be this trainer rank, an int >= 0 (0 sends), got {self.rank!r}"
            )
        if not isinstance(self.host, str) or not self.host:
            raise ArgumentError(
                f"`host` must be the address of the trainer's machine, got {self.host!r}"
            )
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port < 65536
        ):
            raise ArgumentError(
                f"`port` must be a port number (0: any free one), got {self.port!r}"
            )
        if self.dtype is not None:
            dtype_of(self.dtype, "dtype")
        if not isinstance(self.staged, bool):
            raise ArgumentError(f"`staged` must be True or False, got {self.staged!r}")
        if (
            isinstance(self.join_wait, bool)
            or not isinstance(self.join_wait, (int, float))
            or not 0 <= self.join_wait < math.inf
        ):
            raise ArgumentError(
                f"`join_wait` must be seconds, a number >= 0 (a fleet's wait for joins), got {self.join_wait!r}"
            )
        if self.pause not in (None, "keep", "wait", "abort"):
            raise ArgumentError(
                f'`pause` must be "keep", "wait", "abort" (vLLM\'s pause modes) or None, got {self.pause!r}'
            )
        self.timeout = WeightSender.check_options(
            timeout=self.timeout,
            transport=self.transport,
            mode=self.mode,
            bucket_bytes=self.bucket_bytes,
            verify=self.verify,
            delta=self.delta,
        )["timeout"]


@dataclass
class CudarecvInitInfo(WeightTransferInitInfo):
    """What each worker is told at ``init_weight_transfer_engine``: where the trainer's store is and how to
    receive (the trainer's settings, checked there)."""

    host: str
    port: int
    session: str
    timeout: float
    transport: str = "auto"
    staged: bool = True
    #: the trainer's fleet sender to join through the store (:class:`~cudarecv.ElasticSender`), or "": a group
    #: of this engine's workers and the trainer alone
    fleet: str = ""

    def __post_init__(self) -> None:
        if (
            not isinstance(self.staged, bool)
            or not isinstance(self.fleet, str)
            or not self.session
            or not isinstance(self.port, int)
            or not (self.timeout > 0 and math.isfinite(self.timeout))
        ):
            raise ArgumentError(f"malformed cudarecv init info: {self!r}")


@dataclass
class CudarecvUpdateInfo(WeightTransferUpdateInfo):
    """What each worker is told with ``update_weights``: the version the trainer is pushing."""

    version: int

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise ArgumentError(f"malformed cudarecv update info: version {self.version!r}")


@dataclass(frozen=True)
class Loaded:
    """How a worker put a version in place in the engine's pause (:attr:`CudarecvTrainerEngine.loaded`).

    Args:
        how: ``"staged"`` (loaded and processed beforehand, copied into place in the pause) or ``"reload"``
            (vLLM's in-place reload in the pause: ``staged=False``, or the worker logged why it could not stage).
        seconds: how long the worker's part of the pause took.
    """

    how: Literal["staged", "reload"]
    seconds: float


def dtype_of(name: str, what: str):
    """The torch dtype named ``name`` (``"bfloat16"`` or ``"torch.bfloat16"``)."""
    import torch

    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ArgumentError(
            f'`{what}` must name a floating-point torch dtype ("bfloat16", "float32"), got {name!r}'
        )
    return dtype


@dataclass(frozen=True)
class EngineStatus:
    """Where one engine of a trainer stands (:attr:`CudarecvTrainerEngine.engines`).

    Args:
        engine: its name (``vllm serve``'s URL, an ``LLM`` object's model, a Ray client's actor count).
        state: ``"joined"`` (each ``send_weights`` updates it), ``"joining"`` (its ``init_weight_transfer_engine``
            is under way), ``"lost"`` (its join, a transfer or its update failed: ``why``; a fleet joins it again
            at its next ``send_weights``) or ``"closed"``.
        version: the last version it put in place (0: none yet).
        loaded: worker index -> how that version went in and how long its part of the pause took.
        why: why it is lost, if it is.
    """

    engine: str
    state: Literal["joining", "joined", "lost", "closed"]
    version: int
    loaded: dict[int, Loaded]
    why: str | None = None
