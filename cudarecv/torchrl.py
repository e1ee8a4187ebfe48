"""TorchRL weight sync over cudarecv: :class:`CudarecvWeightSyncScheme`, the ``"cudarecv"`` backend.

TorchRL's collectors push policy weights to their workers through pluggable
weight-sync schemes. This one carries them with :class:`~cudarecv.WeightSender`
and :class:`~cudarecv.WeightReceiver` on a process group of its own (gloo, on a
store the trainer opens; the user's default group is never touched): one schema
handshake when the collector starts, then one consolidated transfer per
``update_policy_weights_()`` (through shared memory when a worker is on the
trainer's machine), versioned and bounded by ``timeout`` everywhere.

Versions stay whole. A worker's policy always holds one complete version: each
version lands in a buffer the policy does not use, then the policy's tensors are
switched to it between two of its forward calls (no copy, no forward sees half
of a version). In ``MultiAsyncCollector`` a batch may hold frames of two
consecutive versions (the switch happens between two steps of a rollout); each
frame is acted with one.

- ``sync=True`` (the default): ``update_policy_weights_()`` returns once every
  worker acts with the new version; a worker that died or stopped answering is
  named in the error within ``timeout``.
- ``sync=False``: ``update_policy_weights_()`` snapshots the weights and returns
  at once; each worker switches to the newest version as soon as it has landed,
  and a slow worker skips the ones it missed (the trainer never waits for it).

Importing this module registers the scheme with TorchRL, so
``WeightSyncScheme.from_backend("cudarecv", ...)`` finds it. It needs the
``torchrl`` extra (``pip install "cudarecv[torchrl]"``).

Example:
    >>> from cudarecv.torchrl import CudarecvWeightSyncScheme
    >>> collector = MultiSyncCollector([make_env, make_env], policy, frames_per_batch=200, total_frames=-1,
    ...                                weight_sync_schemes={"policy": CudarecvWeightSyncScheme()})
    >>> for batch in collector:
    ...     train(policy, batch)
    ...     collector.update_policy_weights_()  # every worker acts with the new weights from here on
"""

from __future__ import annotations

import atexit
import datetime
import os
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme, register_weight_sync_backend

from . import (
    ArgumentError,
    Error,
    PeerError,
    ReceiverFailed,
    SenderClosed,
    TransferTimeout,
    UsageError,
    WaitTimeout,
    WeightReceiver,
    WeightSender,
)

__all__ = ["BACKEND", "CudarecvWeightSyncScheme"]

#: The name the scheme is registered under: ``WeightSyncScheme.from_backend(BACKEND)``.
BACKEND = "cudarecv"

#: schemes connected in this process, shut down at exit (collectors never call shutdown; a worker leaves
#: its group cleanly); held weakly, so a scheme let go of is collectable
_CONNECTED: "weakref.WeakSet[CudarecvWeightSyncScheme]" = weakref.WeakSet()
_FAILED = "failed: "  # what a worker's switched key says when it could not take the version


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


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

    Example:
        >>> scheme = WeightSyncScheme.from_backend("cudarecv", timeout=30.0)
        >>> collector = MultiAsyncCollector([make_env] * 4, policy, frames_per_batch=200, total_frames=-1,
        ...                                 weight_sync_schemes={"policy": scheme})
    """

    def __init__(self, strategy: str = "tensordict", *, sync: bool = True, timeout: float = 60.0,
                 connect_timeout: float = 120.0, host: str = "127.0.0.1", transport: str = "auto",
                 bucket_bytes: int | None = None, verify: bool = False, device: Any = None,
                 zero_copy: bool = False) -> None:
        if strategy != "tensordict":
            raise ArgumentError(f"`strategy` must be \"tensordict\" for the cudarecv scheme (the weights travel as "
                                f"one consolidated tensordict), got {strategy!r}")
        if not isinstance(sync, bool):
            raise ArgumentError(f"`sync` must be True or False, got {sync!r}")
        checked = WeightSender.check_options(timeout=timeout, connect_timeout=connect_timeout, transport=transport,
                                             bucket_bytes=bucket_bytes, zero_copy=zero_copy)
        if not isinstance(host, str) or not host:
            raise ArgumentError(f"`host` must be the address of the trainer's machine, got {host!r}")
        try:
            device = torch.device(device if device is not None else "cpu")
        except (RuntimeError, TypeError) as error:
            raise ArgumentError(f"`device` must name a device (\"cpu\", \"cuda:0\"), got {device!r}: {error}") from None
        super().__init__(strategy)
        self.sync = sync
        self.timeout, self.connect_timeout = checked["timeout"], checked["connect_timeout"]
        self.host = host
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.verify = bool(verify)
        self.device = device
        self.zero_copy = zero_copy
        self._session = os.urandom(6).hex()  # the store's keys of this scheme's group and acknowledgements
        self._port: int | None = None
        self._workers: int | None = None
        self._worker_id: Any = None
        self._model_id: str | None = None
        self._initial: Any = None  # weights given to init_on_sender, sent as version 1
        self._local()

    def _local(self) -> None:
        """The state that never travels to a worker: connections, threads, buffers."""
        self._store: Any = None
        self._group: Any = None
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._gate = threading.RLock()  # held by every forward of the worker's policy, and by a switch
        self._hooks: tuple[Any, Any] | None = None
        self._wrapped: dict[int, tuple[TensorDict, TensorDict]] = {}
        self._reading: Any = None  # the hold on the version the worker's policy uses
        self._rank: int | None = None
        self._failure: str | None = None
        self._reported_dead: set[int] = set()  # trainer: the collector's exited worker processes already named
        self._follows_policy = False  # trainer: the sender was built on the policy's own tensors
        self._sender_pointers: list[int] = []  # trainer: where those tensors' data lie
        #: the version this process holds: the last one sent (trainer) or the one its policy acts with (worker)
        self.version = 0

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in ("_store", "_group", "_sender", "_receiver", "_thread", "_stopping", "_gate", "_hooks",
                    "_wrapped", "_reading", "_rank", "_failure", "_reported_dead", "_follows_policy",
                    "_sender_pointers", "version"):
            state.pop(key, None)
        state["_initial"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._local()

    def create_transport(self, **kwargs: Any) -> Any:
        raise UsageError("the cudarecv scheme carries the weights itself (WeightSender/WeightReceiver); "
                         "it has no TorchRL transport")

    def _key(self, *parts: object) -> str:
        return "/".join(("cudarecv", self._session, *map(str, parts)))

    def _connect_group(self, rank: int) -> Any:
        prefix = dist.PrefixStore(self._key("group"), self._store)
        try:
            return dist.ProcessGroupGloo(prefix, rank, self._workers + 1, _seconds(self.connect_timeout))
        except RuntimeError as error:
            if rank == 0:
                joined = int(self._store.add(self._key("joined"), 0))
                raise TransferTimeout(f"weight sync of {self.model_id!r}: {joined} of {self._workers} workers "
                                      f"joined within {self.connect_timeout:g} s ({error})") from None
            raise TransferTimeout(f"weight sync of {self.model_id!r}: worker {self._worker_id} could not join the "
                                  f"trainer's group within {self.connect_timeout:g} s ({error})") from None

    # -- the trainer --------------------------------------------------------------------
    def _init_on_sender_impl(self, *, model_id: str, context: Any = None, num_workers: int | None = None,
                             model: Any = None, weights: Any = None, **_: Any) -> None:
        """Called by the collector in the trainer (its other keyword arguments, like ``ctx``, are not needed)."""
        self._model_id = model_id
        if context is not None:
            self.context = context
        if model is not None:
            self.model = model
        workers = num_workers if num_workers is not None else getattr(context, "num_workers", None)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ArgumentError(f"the cudarecv scheme needs the number of workers (`num_workers`, or a collector "
                                f"`context` with `num_workers`), got {workers!r}")
        self._workers = workers
        self._initial = weights
        self._store = dist.TCPStore(self.host, 0, workers + 1, is_master=True, wait_for_workers=False,
                                    timeout=_seconds(self.connect_timeout))
        self._port = self._store.port

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: Any = None, weights: Any = None) -> None:
        """The trainer's ``connect()``: the workers join, the schema handshake, version 1."""
        # the sender follows the policy's tensors (when no other weights were given): see _replaced
        self._follows_policy = weights is None and self._initial is None
        source = self._weights(weights if weights is not None else self._initial)
        self._initial = None
        self._group = self._connect_group(0)
        self._sender = WeightSender(source, group=self._group, group_dst=list(range(1, self._workers + 1)),
                                    timeout=self.timeout, mode="sync" if self.sync else "latest",
                                    bucket_bytes=self.bucket_bytes, verify=self.verify,
                                    transport=self.transport)
        _CONNECTED.add(self)
        self._sender_pointers = [t.data_ptr() for t in source.values(True, True)]
        self._push(None)

    def _weights(self, weights: Any) -> TensorDictBase:
        """The weights to send, as a tensordict of detached tensors (the model's own, not a copy)."""
        prepared = self.prepare_weights(weights, self.model_id, self.strategy, self.context)
        if prepared is None:
            raise UsageError(f"the cudarecv scheme found no weights for {self.model_id!r}: pass `weights`, or a "
                             "collector whose policy is an nn.Module")
        if isinstance(prepared, dict):
            prepared = TensorDict(prepared, batch_size=[])
        if not isinstance(prepared, TensorDictBase):
            raise ArgumentError(f"weights must be an nn.Module, a tensordict or a dict of tensors, got "
                                f"{type(prepared).__name__}")
        return prepared.data

    def send(self, weights: Any = None, worker_ids: Any = None) -> None:
        """Send a new version to every worker (``update_policy_weights_()`` calls this).

        ``weights``: what to send instead of the policy's current weights (a module,
        a tensordict or a dict with the policy's keys, shapes and dtypes). With
        ``sync=True``, returns once every worker acts with the version.

        Raises:
            ArgumentError: ``worker_ids`` names a subset of the workers (every version goes
                to every worker), or ``weights`` do not match the policy's.
            PeerError / TransferTimeout / ReceiverFailed: a worker died, took longer than
                ``timeout`` or failed; it is named (the others have the version).
        """
        if self._sender is None:
            raise UsageError("the cudarecv scheme is not connected on this side: the collector calls connect() "
                             "first (send() is the trainer's)")
        if worker_ids is not None:
            wanted = {worker_ids} if isinstance(worker_ids, int) else set(worker_ids)
            if wanted != set(range(self._workers)):
                raise ArgumentError(f"`worker_ids={worker_ids!r}`: the cudarecv scheme sends every version to every "
                                    f"worker (0..{self._workers - 1}); pass None")
        self._push(self._replaced() if weights is None else self._weights(weights))

    def _replaced(self) -> TensorDictBase | None:
        """The policy's current weights if they are no longer the tensors the sender was built on (the
        policy's ``load_state_dict(..., assign=True)`` or ``p.data = new`` replaced them), else None (the
        sender sends its own ``td``, which shares the policy's tensors)."""
        if not self._follows_policy:
            return None
        current = self._weights(None)
        return None if [t.data_ptr() for t in current.values(True, True)] == self._sender_pointers else current

    def _push(self, values: TensorDictBase | None) -> None:
        dropped, before = dict(self._sender.dropped), self._sender.version
        try:
            pushed = self._sender.push(wait=False, values=values)  # sync: one transfer per worker, under way
        except PeerError as error:  # latest: a worker lost between calls, named after the version was published
            if self._sender.version == before or self._unnamed(dropped):
                raise self._named(error, dropped) from error
            pushed = []  # its process was named exited already: named once
        except Error as error:
            raise self._named(error, dropped) from error
        ranks = self._sender.ranks
        self.version = version = self._sender.version
        if self.sync:
            self._wait_switched(version, pushed, ranks, dropped)
        # who was lost since the last call, though every worker left has the version (said once each; a
        # worker whose thread failed closes its receiver, so it is dropped too, its reason on the store)
        named = [f"worker {self._worker_of(r)} (rank {r}): {self._said(r) or why}" for r, why in self._unnamed(dropped)]
        dead = self._newly_dead()
        if dead:
            named.append(f"worker process(es) {dead} of the collector exited")
        if named:
            raise PeerError(f"weight sync of {self.model_id!r}, version {version} (every worker left has it): "
                            + "; ".join(named))

    def _unnamed(self, before: dict[int, str]) -> list[tuple[int, str]]:
        """The receivers dropped since ``before`` whose worker process was not named exited already."""
        exited = {str(i) for i in self._reported_dead}
        return [(r, why) for r, why in self._sender.dropped.items() if r not in before and self._worker_of(r) not in exited]

    def _named(self, error: Error, before: dict[int, str]) -> Error:
        """``error`` with the workers dropped since ``before`` named."""
        lost = [rank for rank in self._sender.dropped if rank not in before]
        names = ", ".join(f"worker {self._worker_of(rank)} (rank {rank})" for rank in lost)
        text = f"{names} dropped: {error}" if names else str(error)
        dead = self._newly_dead()
        if dead:
            text += f"; worker process(es) {dead} of the collector exited"
        return type(error)(f"weight sync of {self.model_id!r}: {text}")

    def _worker_of(self, rank: int) -> str:
        try:
            return self._store.get(self._key("worker", rank)).decode()
        except Exception:  # noqa: BLE001 - a name for an error message only
            return "?"

    def _said(self, rank: int) -> str | None:
        """Why the worker of ``rank`` stopped taking versions, if it said so."""
        key = self._key("failed", rank)
        return self._store.get(key).decode() if self._store.check([key]) else None

    def _wait_switched(self, version: int, pushed: list[Any], ranks: list[int], dropped: dict[int, str]) -> None:
        """Wait until every worker of ``ranks`` (``pushed`` to) acts with ``version``; name those that fail or
        never do. Both waits block: the transfers' futures (a worker that died or failed is named as soon as
        its transfer fails), then the store's wait for each worker's word that it switched (or why it could
        not), for what is left of ``timeout``."""
        deadline = time.monotonic() + self.timeout
        for transfer in pushed:  # each bounded by the sender's timeout
            try:
                transfer.wait()
            except Error as error:
                raise self._named(error, dropped) from error
        keys = {rank: self._key("switched", rank, version) for rank in ranks}
        try:
            self._store.wait(list(keys.values()), _seconds(max(deadline - time.monotonic(), 1e-3)))
        except dist.DistStoreError:  # its timeout; nothing else is taken for one
            missing = [r for r, key in keys.items() if not self._store.check([key])]
            named = ", ".join(f"worker {self._worker_of(r)} (rank {r})" for r in missing)
            dead = self._newly_dead()
            if dead:
                raise PeerError(f"weight sync of {self.model_id!r}, version {version}: worker process(es) "
                                f"{dead} died; {named} did not switch to it") from None
            raise TransferTimeout(f"weight sync of {self.model_id!r}: {named} did not switch to version "
                                  f"{version} within {self.timeout:g} s (its policy's forward held it, or "
                                  "it stopped)") from None
        said = {rank: self._store.get(key).decode() for rank, key in keys.items()}
        for key in keys.values():
            self._store.delete_key(key)
        failed = [f"worker {self._worker_of(r)} (rank {r}): {why.removeprefix(_FAILED)}"
                  for r, why in said.items() if why.startswith(_FAILED)]
        if failed:
            raise ReceiverFailed(f"weight sync of {self.model_id!r}, version {version}: " + "; ".join(failed))

    def _newly_dead(self) -> list[int]:
        """The collector's worker processes that exited since the last call named them (named from now on)."""
        dead = [i for i in self._dead_workers() if i not in self._reported_dead]
        self._reported_dead.update(dead)
        return dead

    def _dead_workers(self) -> list[int]:
        """Indices of the collector's worker processes that are known to have exited."""
        context = self.context
        procs = getattr(context, "procs", None) or getattr(context, "jobs", None) or []
        return [i for i, proc in enumerate(procs) if hasattr(proc, "is_alive") and not proc.is_alive()]

    # -- a worker -----------------------------------------------------------------------
    def _init_on_receiver_impl(self, *, model_id: str, context: Any = None, model: Any = None,
                               worker_idx: Any = None, **_: Any) -> None:
        """Called in each worker (``context`` may come later; ``model`` is the policy to update)."""
        if self._port is None:
            raise UsageError("this cudarecv scheme was not initialized on the trainer (init_on_sender) before it "
                             "reached the worker")
        self._model_id = model_id
        if context is not None:
            self.context = context
        if model is not None:
            self.model = model
        self._worker_id = worker_idx

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: Any = None) -> None:
        """A worker's ``connect()``: join the group, the handshake, version 1 into the policy, then a
        thread that takes every next version."""
        if worker_idx is not None:
            self._worker_id = worker_idx
        self._store = dist.TCPStore(self.host, self._port, self._workers + 1, is_master=False,
                                    timeout=_seconds(self.connect_timeout))
        self._rank = int(self._store.add(self._key("joined"), 1))  # 1..workers, whatever the collector numbers
        self._store.set(self._key("worker", self._rank), str(self._worker_id))
        self._group = self._connect_group(self._rank)
        model = self._policy()
        self._receiver = WeightReceiver(group=self._group, group_src=0, device=self.device, expect=model,
                                        timeout=self.timeout, transport=self.transport, zero_copy=self.zero_copy)
        self._switch(self._receiver.pull())
        self._thread = threading.Thread(target=self._take_versions, daemon=True,
                                        name=f"cudarecv-torchrl-{self.model_id}-{self._worker_id}")
        self._thread.start()
        _CONNECTED.add(self)

    def _policy(self) -> nn.Module:
        model = self.model
        if not isinstance(model, nn.Module):
            raise UsageError(f"the cudarecv scheme updates an nn.Module in the worker; {self.model_id!r} resolved "
                             f"to {type(model).__name__}")
        return model

    def _take_versions(self) -> None:
        """The worker's thread: pull each next version, switch the policy to it, say so. Its pull blocks
        until a version comes (looking up once per ``timeout`` with nothing pushed); :meth:`shutdown` ends
        it by closing the receiver."""
        while not self._stopping.is_set():
            try:
                version = self._receiver.pull(timeout=self.timeout)
            except WaitTimeout:
                continue  # the trainer pushed nothing meanwhile: the pull goes on
            except SenderClosed:
                return
            except Exception as error:  # noqa: BLE001 - told to the trainer, which raises it
                if not self._stopping.is_set():  # (else: shutdown closed the receiver under the pull)
                    self._fail(f"receiving a version failed: {error}", self.version + 1)
                # the pull's future keeps its error, whose traceback would keep this thread's frames
                # (and this scheme) for good: torch's future is opaque to the garbage collector
                error.__traceback__ = None
                return
            try:
                self._switch(version)
            except Exception as error:  # noqa: BLE001 - as above
                self._fail(f"switching the policy to version {version} failed: {error}", version)
                return

    def _fail(self, reason: str, version: int) -> None:
        """Tell the trainer why this worker takes no more versions (and, sync, that it never switches to
        ``version``), then leave (its sender drops it)."""
        self._failure = reason
        try:
            self._store.set(self._key("failed", self._rank), reason)
            if self.sync:
                self._store.set(self._key("switched", self._rank, version), _FAILED + reason)
            self._receiver.close()
        except Exception:  # noqa: BLE001 - the trainer is gone: nobody to tell
            pass

    def _switch(self, version: int) -> None:
        """Point the policy's tensors at the version just landed, between two of its forward calls."""
        model = self._policy()
        hold = self._receiver.reading()
        td = hold.__enter__()  # no pull writes this version's buffer while the policy uses it
        try:
            self._guard(model)
            if not self._gate.acquire(timeout=self.timeout):
                raise TransferTimeout(f"the policy's forward held it for {self.timeout:g} s")
            try:
                current = TensorDict.from_module(model)
                if all(t.device == self.device for t in current.values(True, True)) or self.version == 0:
                    self._as_module_tensors(td, current).to_module(model)
                else:  # the collector moved the policy to another device: copy into it
                    current.data.update_(td)
            finally:
                self._gate.release()
        except BaseException:
            hold.__exit__(None, None, None)
            raise
        previous, self._reading = self._reading, hold
        if previous is not None:
            previous.__exit__(None, None, None)
        self.version = version
        if self.sync:
            self._store.set(self._key("switched", self._rank, version), b"")

    def _as_module_tensors(self, td: TensorDict, current: TensorDictBase) -> TensorDict:
        """``td``'s views as the module holds them (parameters as ``nn.Parameter``), made once per buffer."""
        entry = self._wrapped.get(id(td))
        if entry is not None and entry[0] is td:
            return entry[1]
        wrapped = TensorDict({}, batch_size=[])
        for path, held in current.items(True, True):
            view = td.get(path)
            wrapped.set(path, nn.Parameter(view, requires_grad=held.requires_grad)
                        if isinstance(held, nn.Parameter) else view)
        if len(self._wrapped) >= self._receiver.buffer_count:  # its two buffers and (zero-copy) the
            self._wrapped.clear()                                    # sender's snapshots take turns; one more replaced one
        self._wrapped[id(td)] = (td, wrapped)
        return wrapped

    def _guard(self, model: nn.Module) -> None:
        """Make every forward of ``model`` hold the gate, so that a switch never happens during one."""
        if self._hooks is None:
            gate = self._gate

            def enter(module: nn.Module, args: Any) -> None:
                gate.acquire()

            def leave(module: nn.Module, args: Any, output: Any) -> None:
                gate.release()

            self._hooks = (enter, leave)
        enter, leave = self._hooks
        if enter not in model._forward_pre_hooks.values():
            model.register_forward_pre_hook(enter)
            model.register_forward_hook(leave, always_call=True)

    def receive(self, timeout: float | None = None) -> TensorDictBase | None:
        """The worker's own thread takes every version; this returns the one the policy acts with."""
        if self._receiver is None:
            raise UsageError("the cudarecv scheme is not connected in this worker")
        if self._failure is not None:
            raise ReceiverFailed(f"weight sync of {self.model_id!r}: {self._failure}")
        return self._receiver.td

    # -- both ---------------------------------------------------------------------------
    def __del__(self) -> None:  # (TorchRL's shuts down, which may wait: garbage collection never should)
        stopping = getattr(self, "_stopping", None)
        if stopping is not None:
            stopping.set()

    def shutdown(self) -> None:
        """Close this side (collectors do not call it; a process that exits closes it too). The worker's
        receiver closes first: that ends its thread's pull, then the thread is joined."""
        _CONNECTED.discard(self)
        self._stopping.set()
        for end in (self._receiver, self._sender):
            if end is not None:
                try:
                    end.close()
                except Exception:  # noqa: BLE001 - the other side is gone already
                    pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout)
        if self._reading is not None:
            self._reading.__exit__(None, None, None)
        self._sender = self._receiver = self._thread = self._reading = None
        self._group = self._store = None
        super().shutdown()
