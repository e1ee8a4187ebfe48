"""The vLLM worker's side: :class:`CudarecvWeightTransferEngine`, one per worker process, a
:class:`~cudarecv.WeightReceiver` on a gloo group of its own with the trainer (a fleet's engine: an
:class:`~cudarecv.ElasticReceiver` of the trainer's sender, joined through its store).

A thread of the worker's takes each version the trainer pushes, whole (every leaf, checked), into the receiver's
own buffers while the engine goes on generating, then (``staged``, the default) loads and processes it beside the
served model with vLLM's own loaders (:mod:`cudarecv.vllm.staged`) and says so in the trainer's store. The model is
touched only in ``update_weights``, which the trainer calls once every worker has staged the version: the engine
pauses to copy the processed tensors into place, not to receive or load them. A version that cannot be staged (the
reason is logged) is loaded in the pause with vLLM's in-place reload, as is every version without ``staged``. A
transfer that fails or times out never reaches the model: the engine serves the previous version."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from tensordict import TensorDict
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from .. import (
    ElasticReceiver,
    Error,
    ShardedReceiver,
    UsageError,
    WaitTimeout,
    WeightReceiver,
)
from ..core.shutdown import start_thread  # (joined at exit: pyproject.toml's contract allows it)
from .info import CudarecvInitInfo, CudarecvUpdateInfo, Loaded
from .memory import return_freed_memory
from .rendezvous import group_of, joined_key, loaded_key, member_key, seconds, staged_key
from .slices import whole_leaves, worker_slices
from .staged import NotStaged, Staged, prepare

log = logging.getLogger("cudarecv")

#: what receives a worker's versions: from the trainer alone on a group (its slices, if tensor-parallel), or as one
#: of a fleet's engines through the store
Receiver = WeightReceiver | ShardedReceiver | ElasticReceiver


class CudarecvWeightTransferEngine(WeightTransferEngine[CudarecvInitInfo, CudarecvUpdateInfo]):
    """vLLM's ``"cudarecv"`` weight-transfer backend, worker side (vLLM builds it; see :mod:`cudarecv.vllm`)."""

    init_info_cls = CudarecvInitInfo
    update_info_cls = CudarecvUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._receiver: Receiver | None = None
        self._group: Any = None
        self._store: Any = None
        self._landed = (
            threading.Condition()
        )  # guards the two below; notified as the taking thread learns more
        self._version = 0  # the last version landed (whole and checked), which update_weights loads
        self._failure: BaseException | None = None  # why the taking thread stopped, if it failed
        self._taking: threading.Thread | None = None
        self._shapes: dict[str, tuple[int, ...]] = {}  # each checkpoint tensor's whole shape
        self._want: dict[str, tuple[slice, ...]] | None = (
            None  # the slices this worker loads, if it takes slices
        )
        self._staging = True  # whether each landed version is staged (the trainer's `staged`)
        # the last version staged or tried (None: it could not be, loaded in the pause), until an update takes it
        self._staged: tuple[int, Staged | None] | None = None
        self._session, self._index = "", 0
        # held while a version is staged, and while one is put in place or reloaded: never both at once (vLLM's
        # reload changes the records staging reads)
        self._model_lock = threading.Lock()

    # -- the handshake -------------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: CudarecvInitInfo) -> None:
        """Join the trainer's group and take its schema, checked against this engine's checkpoint."""
        self.shutdown()  # (a trainer that connects again replaces the last one)
        workers, index = (
            self.parallel_config.world_size,
            self.parallel_config.rank,
        )  # (one engine: TP x PP workers)
        dtype = self.model_config.dtype
        try:
            self._store = dist.TCPStore(
                init_info.host, init_info.port, is_master=False, timeout=seconds(init_info.timeout)
            )
            expect = expected_weights(self.model_config.model, dtype)
            if expect is None:
                log.warning(
                    "vLLM worker %d: no local safetensors checkpoint at %r to check the trainer's weights "
                    "against; taking them as the trainer names them",
                    index,
                    self.model_config.model,
                )
            self._shapes = (
                {}
                if expect is None
                else {k: tuple(t.shape) for k, t in expect.flatten_keys(".").items()}
            )
            # (a fleet's workers each receive every tensor whole: a store's receivers take no slices)
            self._want = None if init_info.fleet else self._slices()
            self._store.set(
                member_key(init_info.session, index),
                json.dumps(
                    {
                        "workers": workers,
                        "dtype": str(dtype).removeprefix("torch."),
                        "host": socket.gethostname(),
                        "sliced": self._want is not None,
                    }
                ),
            )
            options = dict(
                device=self.device,
                expect=expect,
                timeout=init_info.timeout,
                transport=init_info.transport,
            )
            # (one of a fleet's engines: each worker joins the trainer's sender through the store)
            if init_info.fleet:
                joined = ElasticReceiver(self._store, init_info.fleet, **options)
                self._receiver = joined
                # (the trainer knows this worker among its sender's receivers by this number)
                self._store.set(
                    joined_key(init_info.session, index),
                    json.dumps({"id": joined.id, "generation": joined.generation}),
                )
            else:
                self._group = group_of(
                    self._store, init_info.session, index + 1, workers + 1, init_info.timeout
                )
                # (sliced: the trainer sends each worker what it loads)
                self._receiver = (
                    WeightReceiver(group=self._group, group_src=0, **options)
                    if self._want is None
                    else ShardedReceiver(
                        group=self._group, group_src=[0], want=self._want, **options
                    )
                )
        except BaseException:
            self.shutdown()
            raise
        self._version, self._failure, self._staged = 0, None, None
        self._staging, self._session, self._index = init_info.staged, init_info.session, index
        self._taking = start_thread(
            self._take_versions, f"cudarecv-vllm-worker-{index}", (self._receiver,)
        )
        log.info(
            "vLLM worker %d joined the trainer's weight sync (%s)", index, self._receiver.transport
        )

    def _slices(self) -> dict[str, tuple[slice, ...]] | None:
        """What this worker's loaders read of each checkpoint tensor, if a tensor-parallel worker of a mapped
        architecture with its checkpoint at hand (else None: it receives each tensor whole)."""
        if not self._shapes or self.parallel_config.pipeline_parallel_size != 1:
            return None
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        architectures = getattr(self.model_config.hf_config, "architectures", None) or [""]
        return worker_slices(
            self.model_config.hf_config,
            architectures[0],
            self._shapes,
            get_tensor_model_parallel_rank(),
            get_tensor_model_parallel_world_size(),
        )

    def _take_versions(self, receiver: Receiver) -> None:
        """The taking thread: every version the trainer pushes, as it comes, until the receiver closes or fails."""
        _off_the_engines_cores(self._index)
        while True:
            try:
                version = receiver.pull()
            except WaitTimeout:
                continue  # nothing pushed meanwhile: the pull goes on
            except Error as error:
                if (
                    receiver is self._receiver
                ):  # (else: shutdown() or a new trainer closed it under the pull)
                    log.warning("vLLM worker: the trainer's versions stopped: %s", error)
                    error.__traceback__ = None  # (its frames would keep this engine)
                    with self._landed:
                        self._failure = error
                        self._landed.notify_all()
                return
            with self._landed:
                self._version = version
                self._landed.notify_all()
            if self._staging:
                self._stage(receiver, version)

    def _stage(self, receiver: Receiver, version: int) -> None:
        """Load and process ``version`` beside the served model (the engine generates meanwhile), then say in the
        store that it is staged, or that it could not be (why is logged: the update loads it in the pause)."""
        started = time.perf_counter()
        staged: Staged | None = None
        # (this trainer's: a new one may connect meanwhile)
        store, session = self._store, self._session
        try:
            with (
                self._model_lock,  # (never beside a reload of the served model in the pause)
                receiver.reading() as weights,  # (no pull writes into these buffers while they load)
            ):
                staged = prepare(
                    self.model,
                    self.model_config,
                    whole_leaves(weights.flatten_keys("."), self._shapes, self._want),
                )
        except NotStaged as why:
            log.warning(
                "vLLM worker %d: version %d is loaded in the pause with vLLM's in-place reload: %s",
                self._index,
                version,
                why,
            )
        except Exception:
            log.exception(
                "vLLM worker %d: staging version %d failed; it is loaded in the pause with vLLM's in-place "
                "reload",
                self._index,
                version,
            )
        else:
            log.info(
                "vLLM worker %d staged version %d in %.2f s (%d layers, %.1f MB to copy in the pause)",
                self._index,
                version,
                time.perf_counter() - started,
                len(staged.layers),
                staged.nbytes / 1e6,
            )
        with self._landed:
            # (shut down, or another trainer connected, while it staged)
            if receiver is not self._receiver:
                if staged is not None:
                    staged.drop()
                return
            self._take_staged()  # (one not put in place: a newer version replaces it)
            self._staged = (version, staged)
            self._landed.notify_all()
        if store is not None:
            try:
                store.set(
                    staged_key(session, self._index, version),
                    "staged" if staged is not None else "reload",
                )
                if version > 1:
                    store.delete_key(staged_key(session, self._index, version - 1))
            except Exception as error:  # noqa: BLE001 - the trainer then waits its bounded time and goes on
                log.warning(
                    "vLLM worker %d could not say version %d is staged: %s",
                    self._index,
                    version,
                    error,
                )

    def _take_staged(self, drop: bool = True) -> Staged | None:
        """(Holding ``_landed``:) the staged version, no longer held here; ``drop``: let go of it now."""
        staged = None if self._staged is None else self._staged[1]
        self._staged = None
        if drop and staged is not None:
            staged.drop()
        return staged

    # -- an update -----------------------------------------------------------------------------------------
    def start_weight_update(self) -> None:
        """Nothing yet: the model is touched only once a whole version has arrived (``receive_weights``)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one version (the base class's, without its device-wide sync on a CPU engine)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: CudarecvUpdateInfo) -> None:
        """Load the version the trainer names, which the taking thread received whole and checked (the trainer
        asks once its push returned: it has landed, or the receiver failed and says why)."""
        receiver = self._receiver
        if receiver is None:
            raise UsageError(
                "the cudarecv weight transfer is not initialized: the trainer calls "
                "init_weight_transfer_engine first"
            )
        with self._landed:
            if not self._landed.wait_for(
                lambda: self._version >= update_info.version or self._failure is not None,
                timeout=receiver.timeout,
            ):
                raise UsageError(
                    f"the trainer announced version {update_info.version}, which did not land within "
                    f"{receiver.timeout:g} s (the last landed: {self._version})"
                )
            if self._version != update_info.version:
                if self._failure is not None:
                    raise UsageError(f"version {update_info.version} did not land: {self._failure}")
                raise UsageError(
                    f"the trainer announced version {update_info.version}, but version "
                    f"{self._version} landed"
                )
            # (the taking thread stages it next; the trainer waited for that before it asked: a short grace here,
            # in the engine's pause, and the version is reloaded if it is not staged by then)
            self._landed.wait_for(
                lambda: (
                    not self._staging
                    or self._failure is not None
                    or (self._staged is not None and self._staged[0] >= update_info.version)
                ),
                timeout=min(receiver.timeout, STAGED_GRACE),
            )
            staged = None
            if self._staged is not None and self._staged[0] == update_info.version:
                staged = self._take_staged(drop=False)
        started = time.perf_counter()
        # (a staging still running past the trainer's wait ends first: bounded)
        if not self._model_lock.acquire(timeout=receiver.timeout):
            raise UsageError(
                f"version {update_info.version} could not be put in place: staging a version still ran after "
                f"{receiver.timeout:g} s"
            )
        try:
            how = self._put_in_place(receiver, update_info.version, staged)
        finally:
            self._model_lock.release()
        self._say_loaded(update_info.version, Loaded(how, time.perf_counter() - started))

    def _put_in_place(
        self, receiver: Receiver, version: int, staged: Staged | None
    ) -> Literal["staged", "reload"]:
        """Apply ``staged``, else reload ``version`` from the receiver's buffers (vLLM's in-place reload); which."""
        if staged is not None:
            try:
                took = staged.apply()
            except NotStaged as why:  # (checked before anything was written)
                staged.drop()
                log.warning(
                    "vLLM worker %d: version %d could not be put in place (%s); reloading it",
                    self._index,
                    version,
                    why,
                )
            else:
                log.info(
                    "vLLM worker %d: version %d in place in %.3f s", self._index, version, took
                )
                return "staged"
        with receiver.reading() as weights:  # (no pull writes into these buffers while they load)
            load(
                self.model,
                self.model_config,
                whole_leaves(weights.flatten_keys("."), self._shapes, self._want),
            )
        return "reload"

    def _say_loaded(self, version: int, loaded: Loaded) -> None:
        """Tell the trainer how ``version`` was put in place (:attr:`CudarecvTrainerEngine.loaded`); best effort."""
        store = self._store
        if store is None:
            return
        try:
            store.set(loaded_key(self._session, self._index, version), json.dumps(asdict(loaded)))
            if version > 1:
                store.delete_key(loaded_key(self._session, self._index, version - 1))
        except Exception as error:  # noqa: BLE001 - the update itself is done
            log.warning(
                "vLLM worker %d could not say how version %d loaded: %s",
                self._index,
                version,
                error,
            )

    def finish_weight_update(self) -> None:
        """Nothing left: ``receive_weights`` loaded the version whole."""

    def shutdown(self) -> None:
        """Close the receiver (which ends the taking thread's pull), and let the thread, the group and the store
        go (the engine keeps serving)."""
        receiver, self._receiver = self._receiver, None
        taking, self._taking = self._taking, None
        try:
            if receiver is not None:
                receiver.close()
        finally:
            if taking is not None and receiver is not None:
                taking.join(receiver.timeout)
            with self._landed:
                self._take_staged()
            self._group = self._store = None
            if receiver is not None:
                return_freed_memory()


#: seconds an update waits in the engine's pause for a version still being staged, before it reloads it
STAGED_GRACE = 5.0

#: the niceness of the taking thread: the engine's own threads and processes win the CPU whenever they want it
BACKGROUND_NICE = 10


def _off_the_engines_cores(index: int) -> None:
    """Run this thread (it receives, checks and stages versions while the engine generates) on the cores this
    process was not bound to, if it was bound to some and others are free to it: vLLM's CPU build binds each
    worker's inference threads to cores of their own, which a thread of the same process shares by default and
    would slow (a version's checks and copies stretched the gaps between tokens 3-5x there). A process bound to
    nothing (a GPU worker) is left as it is."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        # below the engine's threads and processes wherever it runs (a niceness of this thread alone on Linux)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError as error:
        log.debug("vLLM worker %d: the taking thread keeps its priority (%s)", index, error)
    try:
        mine = set(os.sched_getaffinity(0))
        # (the inference threads may each be bound to one core)
        for thread in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):
                mine |= os.sched_getaffinity(int(thread))
        others = os.sched_getaffinity(os.getppid()) - mine
        if others:
            os.sched_setaffinity(0, others)  # (on Linux, 0 is the calling thread)
            log.info("vLLM worker %d takes versions on cores %s", index, sorted(others))
    except OSError as error:  # (a parent gone, or a cpuset that forbids it: stay where we are)
        log.debug(
            "vLLM worker %d: the taking thread stays on the worker's cores (%s)", index, error
        )


def load(
    model: torch.nn.Module, model_config: Any, weights: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Load ``weights`` (checkpoint names and whole tensors) into a served ``model`` with vLLM's layer-wise reload
    (which repacks each layer as loading did)."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    with disable_mtp_completeness_check():
        cast(Any, model).load_weights(
            weights
        )  # (vLLM's model class, which torch's Module does not type)
    finalize_layerwise_reload(model, model_config)


def expected_weights(model: str, dtype: torch.dtype) -> TensorDict | None:
    """The weights the engine loaded, as ``expect`` (meta tensors of ``dtype``, nested on ``.``): names and
    shapes from the headers of its safetensors checkpoint; None if ``model`` is no local folder with one."""
    from safetensors import safe_open

    files = sorted(Path(model).glob("*.safetensors")) if Path(model).is_dir() else []
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                shapes[name] = f.get_slice(name).get_shape()
    return TensorDict(
        {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in shapes.items()},
        batch_size=[],
    ).unflatten_keys(".")
