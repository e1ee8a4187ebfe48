"""The TorchRL scheme itself: its settings (which travel to the workers, pickled), its store and group, and the
TorchRL hooks of the trainer (:mod:`~cudarecv.torchrl.trainer`) and of each worker (:mod:`~cudarecv.torchrl.worker`)."""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme, register_weight_sync_backend

from .. import (
    ArgumentError,
    TransferTimeout,
    TransportPolicy,
    UsageError,
    WeightReceiver,
    WeightSender,
)
from .trainer import Trainer, seconds
from .worker import Worker

#: The name the scheme is registered under: ``WeightSyncScheme.from_backend(BACKEND)``.
BACKEND = "cudarecv"

#: schemes connected in this process, shut down at exit (collectors never call shutdown; a worker leaves its group
#: cleanly); held weakly, so a scheme let go of is collectable
_CONNECTED: weakref.WeakSet[CudarecvWeightSyncScheme] = weakref.WeakSet()


@atexit.register
def _shutdown_connected() -> None:
    for scheme in list(_CONNECTED):
        scheme.shutdown()


@register_weight_sync_backend(BACKEND)
class CudarecvWeightSyncScheme(WeightSyncScheme):
    """A TorchRL weight-sync scheme backed by cudarecv's weight sync (see the module docs).

    Args:
        strategy: TorchRL's weight format; only ``"tensordict"`` (the weights travel as one
            consolidated tensordict, whatever the model).

    Keyword Args:
        sync: ``True``: ``update_policy_weights_()`` returns once every worker acts with the
            new version. ``False``: it returns at once and workers take the newest version.
        timeout: seconds any wait may take once the workers have joined (a transfer, a
            worker switching to a version).
        connect_timeout: seconds the trainer waits for every worker to join when the
            collector starts (worker processes start and import TorchRL meanwhile).
        host: the address of the trainer's store, which workers connect to (``127.0.0.1``
            for workers on this machine; the trainer's address for workers on other hosts).
        transport: ``"auto"`` (shared memory with workers on the trainer's machine) or
            ``"wire"``.
        bucket_bytes: bytes per payload message on the wire (default: cudarecv's choice).
        verify: send a BLAKE3 digest with every version; workers reject a corrupted one.
        device: where workers receive the weights (default: the CPU). A worker whose policy
            lives elsewhere copies each version into it (still between two forward calls).
        zero_copy: workers on the trainer's machine act with each version where it lies in the
            trainer's shared snapshot (mapped read-only: no copy at all; see
            :class:`~cudarecv.WeightReceiver`). Only for policies whose forward writes none of their
            tensors in place (no ``BatchNorm`` running statistics in training mode): such a write
            kills the worker (SIGSEGV), which the trainer then names.
        delta: each version goes to a worker on the wire as the words that changed since the one it
            holds (see :class:`~cudarecv.WeightSender`'s ``delta``); workers on the trainer's machine read the
            shared snapshot and take none.

    Example:
        >>> scheme = WeightSyncScheme.from_backend("cudarecv", timeout=30.0)
        >>> collector = MultiAsyncCollector([make_env] * 4, policy, frames_per_batch=200, total_frames=-1,
        ...                                 weight_sync_schemes={"policy": scheme})
    """

    def __init__(
        self,
        strategy: str = "tensordict",
        *,
        sync: bool = True,
        timeout: float = 60.0,
        connect_timeout: float = 120.0,
        host: str = "127.0.0.1",
        transport: TransportPolicy = "auto",
        bucket_bytes: int | None = None,
        verify: bool = False,
        device: Any = None,
        zero_copy: bool = False,
        delta: bool = False,
    ) -> None:
        if strategy != "tensordict":
            raise ArgumentError(
                f'`strategy` must be "tensordict" for the cudarecv scheme (the weights travel as '
                f"one consolidated tensordict), got {strategy!r}"
            )
        if not isinstance(sync, bool):
            raise ArgumentError(f"`sync` must be True or False, got {sync!r}")
        checked = WeightSender.check_options(
            timeout=timeout,
            connect_timeout=connect_timeout,
            transport=transport,
            bucket_bytes=bucket_bytes,
            zero_copy=zero_copy,
            delta=delta,
        )
        if not isinstance(host, str) or not host:
            raise ArgumentError(
                f"`host` must be the address of the trainer's machine, got {host!r}"
            )
        try:
            device = torch.device(device if device is not None else "cpu")
        except (RuntimeError, TypeError) as error:
            raise ArgumentError(
                f'`device` must name a device ("cpu", "cuda:0"), got {device!r}: {error}'
            ) from None
        super().__init__(strategy)
        self.sync = sync
        self.timeout, self.connect_timeout = checked["timeout"], checked["connect_timeout"]
        self.host, self.transport, self.bucket_bytes = host, transport, bucket_bytes
        self.verify, self.device, self.zero_copy = bool(verify), device, zero_copy
        self.delta = delta
        self._session = os.urandom(
            6
        ).hex()  # the store's keys of this scheme's group and acknowledgements
        self._port: int | None = None
        self._workers: int | None = None
        self._worker_id: Any = None
        self._model_id: str | None = None
        self._initial: Any = None  # weights given to init_on_sender, sent as version 1
        self._local()

    _LOCAL = (
        "_store",
        "_group",
        "_trainer",
        "_worker",
    )  # what never travels to a worker: connections, threads

    def _local(self) -> None:
        self._store: Any = None
        self._group: Any = None
        self._trainer: Trainer | None = None
        self._worker: Worker | None = None

    @property
    def version(self) -> int:
        """The version this process holds: the last one sent (trainer) or the one its policy acts with (worker)."""
        if self._trainer is not None:
            return self._trainer.sender.version
        return self._worker.version if self._worker is not None else 0

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in self._LOCAL:
            state.pop(key, None)
        state["_initial"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._local()

    def create_transport(self, **kwargs: Any) -> Any:
        raise UsageError(
            "the cudarecv scheme carries the weights itself (WeightSender/WeightReceiver); "
            "it has no TorchRL transport"
        )

    def _count(self) -> int:
        """How many workers the scheme serves (set on the trainer's side, carried to the workers with it)."""
        if self._workers is None:
            raise UsageError(
                "the cudarecv scheme has no workers yet: the collector calls init_on_sender() first"
            )
        return self._workers

    def _key(self, *parts: object) -> str:
        return "/".join(("cudarecv", self._session, *map(str, parts)))

    def _connect_group(self, rank: int) -> Any:
        prefix = dist.PrefixStore(self._key("group"), self._store)
        try:
            return dist.ProcessGroupGloo(
                prefix, rank, self._count() + 1, seconds(self.connect_timeout)
            )
        except RuntimeError as error:
            if rank == 0:
                joined = int(self._store.add(self._key("joined"), 0))
                raise TransferTimeout(
                    f"weight sync of {self.model_id!r}: {joined} of {self._workers} workers "
                    f"joined within {self.connect_timeout:g} s ({error})"
                ) from None
            raise TransferTimeout(
                f"weight sync of {self.model_id!r}: worker {self._worker_id} could not join the "
                f"trainer's group within {self.connect_timeout:g} s ({error})"
            ) from None

    # -- the trainer -------------------------------------------------------------------------------------
    def _init_on_sender_impl(
        self,
        *,
        model_id: str,
        context: Any = None,
        num_workers: int | None = None,
        model: Any = None,
        weights: Any = None,
        **_: Any,
    ) -> None:
        """Called by the collector in the trainer (its other keyword arguments, like ``ctx``, are not needed)."""
        self._model_id = model_id
        if context is not None:
            self.context = context
        if model is not None:
            self.model = model
        workers = num_workers if num_workers is not None else getattr(context, "num_workers", None)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ArgumentError(
                f"the cudarecv scheme needs the number of workers (`num_workers`, or a collector "
                f"`context` with `num_workers`), got {workers!r}"
            )
        self._workers = workers
        self._initial = weights
        self._store = dist.TCPStore(
            self.host,
            0,
            workers + 1,
            is_master=True,
            wait_for_workers=False,
            timeout=seconds(self.connect_timeout),
        )
        self._port = self._store.port

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: Any = None, weights: Any = None
    ) -> None:
        """The trainer's ``connect()``: the workers join, the schema handshake, version 1."""
        follows_policy = (
            weights is None and self._initial is None
        )  # (then the trainer follows replaced tensors)
        source = self._weights(weights if weights is not None else self._initial)
        self._initial = None
        self._group = self._connect_group(0)
        sender = WeightSender(
            source,
            group=self._group,
            group_dst=list(range(1, self._count() + 1)),
            timeout=self.timeout,
            mode="sync" if self.sync else "latest",
            bucket_bytes=self.bucket_bytes,
            verify=self.verify,
            transport=self.transport,
            delta=self.delta,
        )
        self._trainer = Trainer(
            sender,
            self._store,
            self._key,
            self.model_id,
            self.sync,
            self.timeout,
            self._worker_processes,
            (lambda: self._weights(None)) if follows_policy else None,
            [t.data_ptr() for t in source.values(True, True)],
        )
        _CONNECTED.add(self)
        self._trainer.push(None)

    def _weights(self, weights: Any) -> TensorDictBase:
        """The weights to send, as a tensordict of detached tensors (the model's own, not a copy)."""
        prepared = self.prepare_weights(weights, self.model_id, self.strategy, self.context)
        if prepared is None:
            raise UsageError(
                f"the cudarecv scheme found no weights for {self.model_id!r}: pass `weights`, or a "
                "collector whose policy is an nn.Module"
            )
        if isinstance(prepared, dict):
            prepared = TensorDict(prepared, batch_size=[])
        if not isinstance(prepared, TensorDictBase):
            raise ArgumentError(
                f"weights must be an nn.Module, a tensordict or a dict of tensors, got "
                f"{type(prepared).__name__}"
            )
        return prepared.data

    def _worker_processes(self) -> list:
        """The collector's worker processes (to name those that exited)."""
        return getattr(self.context, "procs", None) or getattr(self.context, "jobs", None) or []

    def send(self, weights: Any = None, worker_ids: Any = None) -> None:
        """Send a new version to every worker (``update_policy_weights_()`` calls this).

        ``weights``: what to send instead of the policy's current weights (a module, a tensordict or a dict with
        the policy's keys, shapes and dtypes). With ``sync=True``, returns once every worker acts with the version.

        Raises:
            ArgumentError: ``worker_ids`` names a subset of the workers (every version goes to every worker), or
                ``weights`` do not match the policy's.
            PeerError / TransferTimeout / ReceiverFailed: a worker died, took longer than ``timeout`` or failed;
                it is named (the others have the version).
        """
        if self._trainer is None:
            raise UsageError(
                "the cudarecv scheme is not connected on this side: the collector calls connect() "
                "first (send() is the trainer's)"
            )
        if worker_ids is not None:
            wanted = {worker_ids} if isinstance(worker_ids, int) else set(worker_ids)
            if wanted != set(range(self._count())):
                raise ArgumentError(
                    f"`worker_ids={worker_ids!r}`: the cudarecv scheme sends every version to every "
                    f"worker (0..{self._count() - 1}); pass None"
                )
        self._trainer.push(self._trainer.replaced() if weights is None else self._weights(weights))

    # -- a worker ----------------------------------------------------------------------------------------
    def _init_on_receiver_impl(
        self,
        *,
        model_id: str,
        context: Any = None,
        model: Any = None,
        worker_idx: Any = None,
        **_: Any,
    ) -> None:
        """Called in each worker (``context`` may come later; ``model`` is the policy to update)."""
        if self._port is None:
            raise UsageError(
                "this cudarecv scheme was not initialized on the trainer (init_on_sender) before it "
                "reached the worker"
            )
        self._model_id = model_id
        if context is not None:
            self.context = context
        if model is not None:
            self.model = model
        self._worker_id = worker_idx

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: Any = None) -> None:
        """A worker's ``connect()``: join the group, the handshake, version 1 into the policy, then a thread that
        takes every next version."""
        if worker_idx is not None:
            self._worker_id = worker_idx
        if self._port is None:
            raise UsageError(
                "the cudarecv scheme has no store yet: the collector calls init_on_sender() first"
            )
        self._store = dist.TCPStore(
            self.host,
            self._port,
            self._count() + 1,
            is_master=False,
            timeout=seconds(self.connect_timeout),
        )
        rank = int(
            self._store.add(self._key("joined"), 1)
        )  # 1..workers, whatever the collector numbers
        self._store.set(self._key("worker", rank), str(self._worker_id))
        self._group = self._connect_group(rank)
        receiver = WeightReceiver(
            group=self._group,
            group_src=0,
            device=self.device,
            expect=self._policy(),
            timeout=self.timeout,
            transport=self.transport,
            zero_copy=self.zero_copy,
        )
        self._worker = Worker(
            receiver,
            self._store,
            self._key,
            rank,
            self.model_id,
            self.sync,
            self.timeout,
            self.device,
            self._policy,
        )
        self._worker.start(f"cudarecv-torchrl-{self.model_id}-{self._worker_id}")
        _CONNECTED.add(self)

    def _policy(self) -> nn.Module:
        model = self.model
        if not isinstance(model, nn.Module):
            raise UsageError(
                f"the cudarecv scheme updates an nn.Module in the worker; {self.model_id!r} resolved "
                f"to {type(model).__name__}"
            )
        return model

    def receive(self, timeout: float | None = None) -> TensorDictBase | None:
        """The worker's own thread takes every version; this returns the one the policy acts with."""
        if self._worker is None:
            raise UsageError("the cudarecv scheme is not connected in this worker")
        return self._worker.td()

    # -- both --------------------------------------------------------------------------------------------
    def __del__(
        self,
    ) -> None:  # (TorchRL's shuts down, which may wait: garbage collection never should)
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.stopping.set()

    def shutdown(self) -> None:
        """Close this side (collectors do not call it; a process that exits closes it too). The worker's receiver
        closes first: that ends its thread's pull, then the thread is joined."""
        _CONNECTED.discard(self)
        if self._worker is not None:
            self._worker.close()
        if self._trainer is not None:
            with contextlib.suppress(Exception):  # the other side is gone already
                self._trainer.sender.close()
        self._trainer = self._worker = self._group = self._store = None
        super().shutdown()
