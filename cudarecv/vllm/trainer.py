"""The trainer's side: :class:`CudarecvTrainerEngine`, a :class:`~cudarecv.WeightSender` to every worker of a
vLLM engine, driven through vLLM's weight-sync client (the ``LLM`` object, ``vllm serve`` over HTTP, Ray)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from types import TracebackType
from typing import Any, cast

import torch
import torch.distributed as dist
from tensordict import TensorDict
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightSource

from .. import ArgumentError, ShardedSender, TransferTimeout, UsageError, WeightSender
from .client import as_client
from .info import CudarecvInitInfo, CudarecvTrainerInitInfo, Loaded, dtype_of
from .rendezvous import group_of, loaded_key, member_key, seconds, staged_key

log = logging.getLogger("cudarecv")


class CudarecvTrainerEngine(TrainerWeightTransferEngine[CudarecvTrainerInitInfo]):
    """vLLM's ``"cudarecv"`` weight-transfer backend, trainer side.

    Built by ``WeightTransferTrainerFactory.trainer_init(CudarecvTrainerInitInfo(), client=..., source=...)``
    (or :meth:`trainer_init`): the workers join, the schema is checked both ways, and each
    :meth:`send_weights` moves one version, cast to the engine's dtype on the trainer.

    Example:
        >>> trainer = CudarecvTrainerEngine.trainer_init(CudarecvTrainerInitInfo(), client=llm,
        ...                                             source=ModuleSource(model))
        >>> trainer.send_weights()  # the engine generates with the model's weights from here on
        1
    """

    init_info_cls = CudarecvTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource, info: CudarecvTrainerInitInfo) -> None:
        super().__init__(
            client=as_client(client) if info.is_sender else client,
            source=source,
            is_sender=info.is_sender,
        )
        self.info = info
        self.sender: WeightSender | ShardedSender | None = None
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
        # the engine's session with this trainer, and its worker count
        self._session, self._workers = "", 0
        #: worker index -> how it put the last version in place in the engine's pause (staged or reloaded), and
        #: how long its part of the pause took
        self.loaded: dict[int, Loaded] = {}

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
            engine._connect()
        except BaseException:
            engine.shutdown()
            raise
        return engine

    # -- the handshake ---------------------------------------------------------------------------------------
    def _connect(self) -> None:
        info = self.info
        if info.pause is not None:
            # a trainer that died during its update left the engine paused: it generates again from here
            _Call(self.client.resume, "resume", info.timeout).join()
        session = os.urandom(6).hex()
        self._store = dist.TCPStore(
            info.host,
            info.port,
            is_master=True,
            wait_for_workers=False,
            timeout=seconds(info.timeout),
        )
        worker_info = CudarecvInitInfo(
            host=info.host,
            port=self._store.port,
            session=session,
            timeout=info.timeout,
            transport=info.transport,
            staged=info.staged,
        )
        with _Call(
            lambda: self.client.init_weight_transfer_engine(asdict(worker_info)),
            "init_weight_transfer_engine",
            2 * info.timeout,
        ):  # (an error here first; the engine's its context)
            try:
                first = json.loads(
                    self._store.get(member_key(session, 0))
                )  # (bounded by the store's timeout)
            except RuntimeError:
                raise TransferTimeout(
                    f"cudarecv weight transfer: no vLLM worker joined within {info.timeout:g} s "
                    f"(is the engine started with weight_transfer_config={{'backend': 'cudarecv'}}, "
                    f"and can it reach {info.host}:{self._store.port}?)"
                ) from None
            workers = int(first["workers"])
            self._session, self._workers = session, workers
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
                timeout=info.timeout,
                mode=info.mode,
                verify=info.verify,
                bucket_bytes=info.bucket_bytes,
                transport=info.transport,
                delta=info.delta,
            )
            td = self._td.unflatten_keys(".")
            self.sender = (
                ShardedSender(td, **options) if self.sliced else WeightSender(td, **options)
            )
        log.info(
            "cudarecv weight transfer to %d vLLM worker(s) (%s, %s, %s)",
            workers,
            dtype,
            info.mode,
            ", ".join(sorted(set(self.sender.transports.values()))),
        )

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
        """Worker (its rank in the trainer's group, 1 on) -> the bytes one version moves to it."""
        if self.sender is None:
            return {}
        if not isinstance(self.sender, ShardedSender):
            return {rank: self.nbytes for rank in self.sender.transports}
        assert self._td is not None  # (a sender has its tensordict)
        sizes = {name: t.element_size() for name, t in _leaves(self._td).items()}
        sharded: Any = (
            self.sender
        )  # (sliced: a sharded sender, whose plan says what each worker loads)
        return {
            rank: sum(box.numel * sizes[name] for name, box in pieces)
            for rank, pieces in sharded.plan.items()
        }

    # -- an update -------------------------------------------------------------------------------------------
    def send_weights(self) -> int | None:
        """Send the source's weights now as the next version; return it (None on a rank that does not send).

        The version travels while the engine goes on generating; once it has landed on every worker, whole and
        checked, the engine loads it (its only pause) and stamps it as its ``weight_version``. Returns once every
        worker loaded it, or raises naming the worker that failed, died or timed out: the engine then serves the
        previous version (a transfer that fails never reaches the engine's model)."""
        td = self._td
        for name, tensor in self.source:  # (every rank: a sharded source gathers collectively)
            if td is not None and self._shared.get(name) != tensor.data_ptr():
                td[name].copy_(tensor)
        if not self.is_sender:
            return None
        if self.sender is None:
            raise UsageError("this cudarecv trainer engine is shut down")
        # (sync mode: returns once every worker holds it, or raises naming one that does not; latest mode: at once,
        # and each worker's update waits, bounded, for it to land)
        version = self.sender.push()
        if self.info.staged:
            self._wait_staged(version)
        self._start(version)
        # (after the start, which loads nothing, so that the pause is as short as it can be; a pause that fails
        # or times out may still take effect in the engine: it is resumed all the same)
        paused = self.info.pause is not None
        try:
            self._pause()
            try:  # (the workers load it now: bounded, as every answer of the engine)
                _Call(
                    lambda: self.client.update_weights({"version": version}),
                    "update_weights",
                    self.info.timeout + 30.0,
                ).join()
            except BaseException:
                self._close_session(version)
                raise
            self.client.finish_weight_update(str(version))
        except BaseException:
            if paused:
                self._resume(failed=True)
            raise
        if paused:
            self._resume()
        self.loaded = self._loaded(version)
        return version

    def _pause(self) -> None:
        """Pause the engine's scheduler for the update as :attr:`info` says (bounded)."""
        mode = self.info.pause
        if mode is not None:
            _Call(lambda: self.client.pause(mode), "pause", self.info.timeout + 30.0).join()

    def _resume(self, failed: bool = False) -> None:
        """Resume the engine's scheduler (bounded). A failure is raised, or logged after an update that ``failed``
        (whose own error goes on): an engine left paused generates nothing until it is resumed (``POST /resume``,
        or the next trainer's ``trainer_init``)."""
        try:
            _Call(self.client.resume, "resume", self.info.timeout).join()
        except Exception:
            if not failed:
                raise
            log.exception("the vLLM engine could not be resumed after an update that failed")

    def _loaded(self, version: int) -> dict[int, Loaded]:
        """How each worker put ``version`` in place, as it said in the store (a worker that did not, or a store
        that does not answer: left out; the update itself is done)."""
        store, said = self._store, {}
        for index in range(self._workers):
            key = loaded_key(self._session, index, version)
            try:
                if store is not None and store.check([key]):
                    said[index] = Loaded(**json.loads(store.get(key)))
            except Exception as error:  # noqa: BLE001 - said, not raised: the version is in place
                log.warning(
                    "how worker %d loaded version %d is not known: %s", index, version, error
                )
        return said

    def _wait_staged(self, version: int) -> None:
        """Wait (bounded by the timeout) until every worker has staged ``version``, or found it cannot (it then
        reloads it in the pause), so that the engine pauses only to put it in place. Workers that do not say so in
        time are logged and the update goes on: a worker whose staging is not done within a few seconds of its
        ``update_weights`` reloads the version in the pause instead."""
        store, session, workers = self._store, self._session, self._workers
        if store is None:
            return
        keys = [staged_key(session, index, version) for index in range(workers)]
        started = time.monotonic()
        try:
            store.wait(keys, seconds(self.info.timeout))
        except RuntimeError as error:  # (the store's timeout)
            log.warning(
                "vLLM workers did not stage version %d within %g s (%s); updating anyway",
                version,
                self.info.timeout,
                str(error).splitlines()[0],
            )
            return
        log.debug(
            "version %d staged on every worker after %.2f s", version, time.monotonic() - started
        )

    def _close_session(self, version: int) -> None:
        """After a failed update: close the engine's update session if it is still open (best effort, logged),
        so that the next ``send_weights`` can start one."""
        try:
            self.client.finish_weight_update()
        except Exception as error:  # noqa: BLE001 - a worker whose update failed closed its session itself
            log.info(
                "after the failed update %d, the engine's update session was already closed (%s)",
                version,
                type(error).__name__,
            )

    def _start(self, version: int) -> None:
        """The engine's ``start_weight_update``. A trainer that died between its start and its update left the
        engine's update session open, which refuses a new start ("already active"): such a session is closed
        (it holds nothing of a version: a worker loads only a whole one) and the start made again."""
        try:
            self.client.start_weight_update()
        except Exception as error:  # noqa: BLE001 - what the engine says differs by client (an RPC, an HTTP 500)
            if "already active" not in str(error):
                raise
            log.warning(
                "the vLLM engine refused to start update %d: an update is already active (a previous "
                "trainer's, which died); closing it, then starting again",
                version,
            )
            self.client.finish_weight_update()
            self.client.start_weight_update()

    def shutdown(self) -> None:
        """Close the sender and the engine's side (its workers keep serving), and let the group and store go."""
        sender, self.sender = self.sender, None
        try:
            if sender is not None:
                sender.close()
            shut = (
                getattr(self.client, "shutdown_weight_transfer_engine", None)
                if self.is_sender
                else None
            )
            if shut is not None and self._store is not None:
                try:  # (bounded: an engine still busy with this trainer's call answers late or never)
                    _Call(shut, "shutdown_weight_transfer_engine", self.info.timeout).join()
                except Exception as error:  # noqa: BLE001 - the trainer's side is closed; the engine's is said
                    log.warning(
                        "the vLLM engine did not release this trainer's connection: %s: %s",
                        type(error).__name__,
                        error,
                    )
        finally:
            self._group = self._store = self._td = None
            self._shared.clear()


def _leaves(td: TensorDict) -> dict[str, torch.Tensor]:
    """The leaves of a flat tensordict of tensors, by name."""
    return {name: cast(torch.Tensor, t) for name, t in td.items()}


class _Call:
    """One call of the engine's client on a thread of its own, so that waiting for its answer is bounded (a client
    may wait for ever). ``join`` waits for it (bounded) and raises what it raised; as a context manager (while
    this thread does its part, e.g. the rendezvous during the engine's init) it joins on the way out, and an error
    of the block wins over the call's (which becomes its context)."""

    def __init__(self, call: Callable[[], object], what: str, timeout: float) -> None:
        self.what, self.timeout = what, timeout
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(call,), name=f"cudarecv-vllm-{what}", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> _Call:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if error is None:
            self.join()
            return
        try:
            self.join()
        except BaseException as answer:  # noqa: BLE001 - the block's error propagates, this one as its context
            error.__context__ = answer

    def _run(self, call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as error:  # noqa: BLE001 - raised by join, on the caller's thread
            self._error = error

    def join(self) -> None:
        self._thread.join(self.timeout)
        if (
            self._thread.is_alive()
        ):  # (the thread ends with the engine's answer: it holds nothing of ours)
            raise TransferTimeout(
                f"the vLLM engine did not answer {self.what} within {self.timeout:g} s"
            )
        if self._error is not None:
            raise self._error
