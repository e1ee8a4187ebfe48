"""The trainer's side: :class:`CudarecvTrainerEngine`, a :class:`~cudarecv.WeightSender` to every worker of a
vLLM engine, driven through vLLM's weight-sync client (the ``LLM`` object, ``vllm serve`` over HTTP, Ray); or, given
a list of clients, an :class:`~cudarecv.ElasticSender` that a fleet of engines joins through the trainer's store."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, cast

import torch
import torch.distributed as dist
from tensordict import TensorDict
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightSource

from .. import (
    ArgumentError,
    ElasticSender,
    MismatchError,
    ShardedSender,
    TransferTimeout,
    UsageError,
    WeightSender,
)
from .client import as_client
from .engines import Call, Engine, EngineState, Joined, label, update_bound
from .info import CudarecvInitInfo, CudarecvTrainerInitInfo, EngineStatus, Loaded, dtype_of
from .memory import return_freed_memory
from .rendezvous import group_of, member_key, seconds

log = logging.getLogger("cudarecv")


class CudarecvTrainerEngine(TrainerWeightTransferEngine[CudarecvTrainerInitInfo]):
    """vLLM's ``"cudarecv"`` weight-transfer backend, trainer side.

    Built by ``WeightTransferTrainerFactory.trainer_init(CudarecvTrainerInitInfo(), client=..., source=...)``
    (or :meth:`trainer_init`): the workers join, the schema is checked both ways, and each
    :meth:`send_weights` moves one version, cast to the engine's dtype on the trainer.

    ``client`` is one engine's client (the ``LLM`` object, ``HTTPVLLMWeightSyncClient``,
    ``RayVLLMWeightSyncClient``), or a list of them: a **fleet**. A fleet's workers join one
    :class:`~cudarecv.ElasticSender` through the trainer's store, which reaches them over a relay chain across
    hosts (sync mode), and each ``send_weights`` updates every engine that has joined, each on a thread of its
    own. An engine that dies, stops answering or refuses a version is lost (logged, :attr:`engines` says why),
    never raised: the others' updates go on, and it is joined again at each later ``send_weights`` until it
    answers (a restarted one takes that very update). :meth:`add_engine` and :meth:`remove_engine` change the
    fleet. A fleet's workers each receive every tensor whole (a tensor-parallel engine's workers too).

    Example:
        >>> trainer = CudarecvTrainerEngine.trainer_init(CudarecvTrainerInitInfo(), client=llm,
        ...                                             source=ModuleSource(model))
        >>> trainer.send_weights()  # the engine generates with the model's weights from here on
        1
        >>> fleet = CudarecvTrainerEngine.trainer_init(CudarecvTrainerInitInfo(), source=ModuleSource(model),
        ...     client=[HTTPVLLMWeightSyncClient(url) for url in urls])
    """

    init_info_cls = CudarecvTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource, info: CudarecvTrainerInitInfo) -> None:
        #: whether ``client`` is a list of engines' clients (a fleet)
        self.fleet = isinstance(client, Sequence) and not isinstance(client, str)
        clients = list(client) if self.fleet else [client]
        if self.fleet and not clients and info.is_sender:
            raise ArgumentError("`client` is an empty list: give the fleet's engines' clients")
        if info.is_sender:
            clients = [as_client(c) for c in clients]
        super().__init__(
            client=clients if self.fleet else clients[0],
            source=source,
            is_sender=info.is_sender,
        )
        self.info = info
        self.sender: WeightSender | ShardedSender | ElasticSender | None = None
        self._store: Any = None
        self._group: Any = None
        self._td: TensorDict | None = (
            None  # the weights as they travel (the engine's dtype), flat on "."
        )
        self._shared: dict[
            str, int
        ] = {}  # leaves that are the source's own tensors: their data pointers
        self.dtype: torch.dtype | None = (
            None  # what the weights travel and load in (the engine's, unless set)
        )
        self.sliced = False  # whether each worker receives only the slices it loads (a tensor-parallel engine)
        self._session = os.urandom(6).hex()  # (this trainer's, in the store's keys)
        self._engines: list[Engine] = (
            [Engine(c, label(c), info, i) for i, c in enumerate(clients)] if info.is_sender else []
        )
        names = [e.label for e in self._engines]
        if len(set(names)) != len(names):
            raise ArgumentError(
                f"`client` names an engine twice: {names} (each engine of a fleet once: two trainers' connections "
                "to one engine would replace each other)"
            )
        self._added = len(self._engines)  # (engines ever added: each one's index)
        self._lock = threading.Lock()  # (the list of engines: added and removed from any thread)
        #: one engine's trainer: that engine (kept after shutdown, for `loaded`)
        self._one = None if self.fleet or not self._engines else self._engines[0]
        # (a fleet's: the first engine's to join, which the others must have)
        self._first_dtype: str | None = None

    @classmethod
    def trainer_init(
        cls, init_info: CudarecvTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> CudarecvTrainerEngine:
        if not isinstance(init_info, CudarecvTrainerInitInfo):
            raise ArgumentError(
                f"`init_info` must be a CudarecvTrainerInitInfo, got {type(init_info).__name__}"
            )
        if source is None:
            raise ArgumentError(
                "`source` is required: the weights to send (vLLM's ModuleSource(model))"
            )
        engine = cls(client=client, source=source, info=init_info)
        if not engine.is_sender:
            for _ in source:  # (rank 0 reads the source once: a sharded one gathers on every rank)
                pass
            return engine
        try:
            if engine.fleet:
                engine._connect_fleet()
            else:
                engine._connect()
        except BaseException:
            engine.shutdown()
            raise
        return engine

    # -- the engines -----------------------------------------------------------------------------------------
    @property
    def engines(self) -> list[EngineStatus]:
        """Where each engine stands: joined, joining, lost (and why), its last version and how it loaded."""
        with self._lock:
            engines = list(self._engines)
        return [e.status() for e in engines]

    @property
    def loaded(self) -> dict[int, Loaded]:
        """Worker index -> how it put the last version in place in the engine's pause (staged or reloaded), and
        how long its part of the pause took; a fleet's: each engine's in :attr:`engines`."""
        if self.fleet:
            raise UsageError("a fleet's trainer: each engine's `loaded` is in `trainer.engines`")
        return dict(self._one.loaded) if self._one is not None else {}

    def add_engine(self, client: Any) -> None:
        """Add an engine to the fleet (an engine that was started later): it joins at the next
        :meth:`send_weights`, which brings it the newest version."""
        if not self.fleet:
            raise UsageError(
                "add_engine is a fleet's: build the trainer with `client=[...]`, a list of clients"
            )
        if self.sender is None:
            raise UsageError("this cudarecv trainer engine is shut down")
        wrapped = as_client(client)
        with self._lock:
            if label(wrapped) in (e.label for e in self._engines):
                raise ArgumentError(
                    f"`client` is an engine of this fleet already: {label(wrapped)}"
                )
            self._engines.append(Engine(wrapped, label(wrapped), self.info, self._added))
            self._added += 1

    def remove_engine(self, client: Any) -> None:
        """Stop updating an engine of the fleet (its workers let go of this trainer, bounded; the engine keeps
        serving its last version). ``client``: the one given, or its engine's name in :attr:`engines`."""
        if not self.fleet:
            raise UsageError(
                "remove_engine is a fleet's: build the trainer with `client=[...]`, a list of clients"
            )
        with self._lock:
            found = [
                e
                for e in self._engines
                if client
                in (e.label, getattr(e.client, "client", None), getattr(e.client, "llm", None))
            ]
            if not found:
                raise ArgumentError(
                    f"`client` is no engine of this fleet: {client!r} (its engines: "
                    f"{[e.label for e in self._engines]})"
                )
            self._engines.remove(found[0])
        found[0].close(tell=True, timeout=update_bound(self.info.timeout))

    # -- the handshake ---------------------------------------------------------------------------------------
    def _open_store(self) -> None:
        info = self.info
        self._store = dist.TCPStore(
            info.host,
            info.port,
            is_master=True,
            wait_for_workers=False,
            timeout=seconds(info.timeout),
        )

    def _connect(self) -> None:
        """One engine: its workers and this trainer form a gloo group of their own."""
        info = self.info
        engine = self._one
        assert engine is not None  # (one engine's trainer)
        if info.pause is not None:
            # a trainer that died during its update left the engine paused: it generates again from here
            engine.resume()
        session = self._session
        self._open_store()
        worker_info = CudarecvInitInfo(
            host=info.host,
            port=self._store.port,
            session=session,
            timeout=info.timeout,
            transport=info.transport,
            staged=info.staged,
        )
        engine.connecting()
        with Call(
            lambda: engine.client.init_weight_transfer_engine(asdict(worker_info)),
            "init_weight_transfer_engine",
            2 * info.timeout,
        ):  # (an error here first; the engine's its context)
            first = self._first_worker(session)
            workers = int(first["workers"])
            self._group = group_of(self._store, session, 0, workers + 1, info.timeout)
            joined = [json.loads(self._store.get(member_key(session, i))) for i in range(workers)]
            if len({(w["workers"], w["dtype"], w.get("sliced", False)) for w in joined}) != 1:
                raise UsageError(
                    f"the engine's workers disagree on their number, dtype or slicing: {joined}"
                )
            dtype = dtype_of(info.dtype or first["dtype"], "dtype")
            self.sliced = bool(
                first.get("sliced")
            )  # a tensor-parallel engine: each worker receives what it loads
            self._td, self.dtype = self._weights(dtype), dtype
            # a tensor-parallel engine's workers each want slices: a sender of each worker's slices
            options = dict(
                group=self._group,
                group_dst=list(range(1, workers + 1)),
                **self._sender_options(),
            )
            td = self._td.unflatten_keys(".")
            self.sender = (
                ShardedSender(td, **options) if self.sliced else WeightSender(td, **options)
            )
        engine.connected(Joined(session, workers, str(first["dtype"]), self.sliced))
        log.info(
            "cudarecv weight transfer to %d vLLM worker(s) (%s, %s, %s)",
            workers,
            dtype,
            info.mode,
            ", ".join(sorted(set(self.sender.transports.values()))),
        )

    def _first_worker(self, session: str) -> dict[str, Any]:
        """The first worker's record (bounded by the store's timeout)."""
        try:
            return cast(dict[str, Any], json.loads(self._store.get(member_key(session, 0))))
        except RuntimeError:
            raise TransferTimeout(
                f"cudarecv weight transfer: no vLLM worker joined within {self.info.timeout:g} s "
                "(is the engine started with weight_transfer_config={'backend': 'cudarecv'}, and can it reach "
                f"{self.info.host}:{self._store.port}?)"
            ) from None

    def _connect_fleet(self) -> None:
        """A fleet: the engines join an elastic sender through the store, each on a thread of its own. The sender
        is built once the first engine says its dtype, which the others must have too; ``trainer_init`` waits up
        to ``join_wait`` for the others once one joined. Engines that do not join are lost (logged) and joined
        again at each ``send_weights``. Raises if none joins within twice the timeout."""
        info = self.info
        self._open_store()
        fleet = self._fleet_name()
        for engine in self._engines:
            engine.begin_join(self._store, fleet, self._session, self._served, self._engine_dtype)
        # (the weights travel in the engines' dtype, which the first worker to join says: the sender waits for it)
        deadline = time.monotonic() + 2 * info.timeout
        while self._first_dtype is None:
            self._first_dtype = next(
                (d for d in map(self._dtype_said, self._engines) if d is not None), None
            )
            if self._first_dtype is None:
                if time.monotonic() > deadline or not any(e.busy() for e in self._engines):
                    raise self._none_joined()
                time.sleep(0.02)  # (a poll of the joins' first records, bounded by the deadline)
        dtype = dtype_of(info.dtype or self._first_dtype, "dtype")
        self._td, self.dtype = self._weights(dtype), dtype
        self.sender = ElasticSender(
            self._td.unflatten_keys("."),
            self._store,
            fleet,
            **self._sender_options(),
        )
        # (one joined, then the others within join_wait: one that is down or hung holds up nobody for long)
        while not any(e.state is EngineState.JOINED for e in self._engines):
            if time.monotonic() > deadline or not any(e.busy() for e in self._engines):
                raise self._none_joined()
            time.sleep(0.02)  # (a poll of the joins under way, bounded by the deadline)
        waited = time.monotonic() + info.join_wait
        for engine in self._engines:
            engine.wait(waited - time.monotonic())
        joined = [e for e in self._engines if e.state is EngineState.JOINED]
        log.info(
            "cudarecv weight transfer to a fleet of %d vLLM engine(s), %d joined (%s, %s)",
            len(self._engines),
            len(joined),
            dtype,
            info.mode,
        )

    def _sender_options(self) -> dict[str, Any]:
        """The trainer's settings every sender of it takes."""
        info = self.info
        return dict(
            timeout=info.timeout,
            mode=info.mode,
            verify=info.verify,
            bucket_bytes=info.bucket_bytes,
            transport=info.transport,
            delta=info.delta,
        )

    def _none_joined(self) -> TransferTimeout:
        """What ``trainer_init`` of a fleet raises when no engine joined: each engine and why."""
        return TransferTimeout(
            "cudarecv weight transfer: no engine of the fleet joined: "
            + "; ".join(f"{e.label}: {e.why}" for e in self._engines)
        )

    def _engine_dtype(self) -> str | None:
        """The dtype every engine of the fleet must have (the first's to join), once it is known."""
        return self._first_dtype

    def _fleet_name(self) -> str:
        """The fleet sender's name in the store (this trainer's own)."""
        return f"vllm-fleet-{self._session}"

    def _dtype_said(self, engine: Engine) -> str | None:
        """The dtype a joining engine's first worker said in the store, if it has yet."""
        if not engine.session:
            return None
        key = member_key(engine.session, 0)
        if not self._store.check([key]):
            return None
        return cast(str, json.loads(self._store.get(key))["dtype"])

    def _served(self, ids: tuple[int, ...]) -> bool:
        """Whether the fleet's sender serves every receiver of ``ids`` (an engine's workers)."""
        sender = self.sender
        if not isinstance(sender, ElasticSender):
            return False
        served = {r["id"] for r in sender.receivers if r["state"] == "served"}
        return set(ids) <= served

    def _weights(self, dtype: torch.dtype) -> TensorDict:
        """The tensordict that travels: each source tensor itself where it is already a plain contiguous tensor
        of ``dtype``, else a buffer of ``dtype`` that :meth:`send_weights` copies it into."""
        leaves = {}
        for name, tensor in self.source:
            if (
                type(tensor) in (torch.Tensor, torch.nn.Parameter)
                and tensor.dtype == dtype
                and tensor.is_contiguous()
            ):
                leaves[name] = tensor.detach()
                self._shared[name] = tensor.data_ptr()
            else:
                leaves[name] = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
        return TensorDict(leaves, batch_size=[])

    @property
    def nbytes(self) -> int:
        """Bytes of one version (in :attr:`dtype`), what each worker receives unless the engine is tensor-parallel
        (each worker then receives the slices it loads: :meth:`bytes_to`); 0 on a rank that does not send."""
        return sum(t.nbytes for t in _leaves(self._td).values()) if self._td is not None else 0

    def bytes_to(self) -> dict[int, int]:
        """Worker (its rank in the trainer's group, 1 on; a fleet's: its receiver id) -> the bytes one version
        moves to it."""
        if self.sender is None:
            return {}
        if not isinstance(self.sender, ShardedSender):
            return {rank: self.nbytes for rank in self.sender.transports}
        assert self._td is not None  # (a sender has its tensordict)
        sizes = {name: t.element_size() for name, t in _leaves(self._td).items()}
        return {
            rank: sum(box.numel * sizes[name] for name, box in pieces)
            for rank, pieces in self.sender.plan.items()
        }

    # -- an update -------------------------------------------------------------------------------------------
    def send_weights(self) -> int | None:
        """Send the source's weights now as the next version; return it (None on a rank that does not send).

        The version travels while the engine goes on generating; once it has landed on every worker, whole and
        checked, the engine loads it (its only pause) and stamps it as its ``weight_version``. Returns once every
        worker loaded it, or raises naming the worker that failed, died or timed out: the engine then serves the
        previous version (a transfer that fails never reaches the engine's model).

        A fleet's: first joins the engines that are lost or were added (waiting at most ``join_wait`` s for
        them), pushes once to every worker that joined, then updates each engine on a thread of its own. Returns
        once each is updated or lost (:attr:`engines`); an engine that fails is never raised. Engines that missed
        the version to a hop of the relay chain that failed during the push (sync mode) get the same weights pushed
        once more, as the next version, through the chain healed around it: the version returned is then that
        one."""
        td = self._td
        for name, tensor in self.source:  # (every rank: a sharded source gathers collectively)
            if td is not None and self._shared.get(name) != tensor.data_ptr():
                td[name].copy_(tensor)
        if not self.is_sender:
            return None
        if self.sender is None:
            raise UsageError("this cudarecv trainer engine is shut down")
        if not self.fleet:
            # (sync mode: returns once every worker holds it, or raises naming one that does not; latest mode: at
            # once, and each worker's update waits, bounded, for it to land)
            version = self.sender.push()
            assert self._one is not None  # (a sender's)
            self._one.update(self._store, version)
            return version
        self._join_lost()
        sender = self.sender
        assert isinstance(sender, ElasticSender)  # (a fleet's)
        # (those that joined before the push: one joining meanwhile takes the next)
        with self._lock:
            joined = [e for e in self._engines if e.state is EngineState.JOINED and not e.busy()]
        version, reached = self._push_fleet(sender)
        missed = [e for e in joined if self._missed(e, reached)]
        if missed:  # (the chain healed around the failed hop: a second push reaches them)
            log.warning(
                "vLLM engine(s) %s missed version %d (a hop of the relay chain before them failed during the "
                "push, or they rejected it); pushing the same weights again as the next version",
                ", ".join(e.label for e in missed),
                version,
            )
            version, reached = self._push_fleet(sender)
        updates = [
            (
                engine,
                engine.begin_update(functools.partial(self._update_one, engine, version, reached)),
            )
            for engine in joined
        ]
        deadline = time.monotonic() + update_bound(self.info.timeout)
        for engine, thread in updates:
            if thread is not None:
                thread.join(max(deadline - time.monotonic(), 0.0))
                # (one still running goes on, bounded; the engine is joined again once it ended)
                if thread.is_alive():
                    engine.lose(
                        TransferTimeout(f"its update of version {version} did not end in time")
                    )
        if not any(e.version == version for e, _ in updates):
            log.warning("no vLLM engine of the fleet took version %d", version)
        return version

    def _push_fleet(self, sender: ElasticSender) -> tuple[int, set[int] | None]:
        """One push to the fleet: its version, and (sync mode) the receivers that got it. A worker that rejects
        it (its checksum or header: the link stays in step) is logged here, not raised: its engine misses it."""
        try:
            version = sender.push()
        except MismatchError as error:
            log.warning("vLLM fleet: %s", error)
            version = sender.version
        return version, (set(sender.reached or ()) if self.info.mode == "sync" else None)

    def _join_lost(self) -> None:
        """Start joining every engine that is lost (or added), and wait up to ``join_wait`` for those joins."""
        with self._lock:
            engines = list(self._engines)
        fleet = self._fleet_name()
        started = [
            e
            for e in engines
            if e.begin_join(self._store, fleet, self._session, self._served, self._engine_dtype)
        ]
        deadline = time.monotonic() + self.info.join_wait
        for engine in started:
            engine.wait(deadline - time.monotonic())

    def _missed(self, engine: Engine, reached: set[int] | None) -> bool:
        """Whether ``engine``'s workers are all still served but did not all get the last push (``reached``)."""
        ids = () if engine.joined is None else engine.joined.ids
        return reached is not None and self._served(ids) and not set(ids) <= reached

    def _update_one(self, engine: Engine, version: int, reached: set[int] | None) -> None:
        """One fleet engine's update; a failure loses it (logged), the others go on. An engine whose workers did
        not all get the version (``reached``, sync mode) but are still served skips it: it keeps its version and
        takes the next."""
        joined = engine.joined
        ids = () if joined is None else joined.ids
        try:
            if not self._served(ids):
                raise UsageError(
                    "its workers were dropped by the push (died, stopped, or their link broke)"
                )
            if reached is not None and not set(ids) <= reached:
                log.warning(
                    "vLLM engine %s missed version %d too (a hop before it in the relay chain failed during "
                    "the push again); it keeps version %d and takes the next",
                    engine.label,
                    version,
                    engine.version,
                )
                return
            # (a client of the store of its own: its waits hold up no other engine's)
            store = self._store.clone()
            engine.update(store, version, alive=lambda: self._served(ids))
        except Exception as error:  # noqa: BLE001 - one engine's failure is its own: it is lost, said
            engine.lose(error)

    def shutdown(self) -> None:
        """Close the sender and the engines' side (their workers keep serving), and let the group and store go.
        Waits (bounded) for each engine's join or update under way."""
        sender, self.sender = self.sender, None
        with self._lock:
            engines, self._engines = self._engines, []
        try:
            if not self.fleet and sender is not None:
                sender.close()
            tell = self.is_sender and self._store is not None
            bound = update_bound(self.info.timeout)
            closing = [
                threading.Thread(
                    target=engine.close,
                    args=(tell, bound),
                    name=f"cudarecv-vllm-close-{engine.label}",
                    daemon=True,
                )
                for engine in engines
            ]
            for thread in closing:
                thread.start()
            for thread in closing:  # (each engine's wait and calls bounded on their own)
                thread.join(bound + 2 * self.info.timeout)
            if self.fleet and sender is not None:  # (after its receivers said BYE)
                sender.close()
        finally:
            self._group = self._store = self._td = None
            self._shared.clear()
            if sender is not None:
                return_freed_memory()


def _leaves(td: TensorDict) -> dict[str, torch.Tensor]:
    """The leaves of a flat tensordict of tensors, by name."""
    return {name: cast(torch.Tensor, t) for name, t in td.items()}
