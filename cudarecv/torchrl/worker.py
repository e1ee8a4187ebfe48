"""A worker's side of the TorchRL scheme: a :class:`~cudarecv.WeightReceiver`, a thread that takes every next
version, and the switch of the policy's tensors to each version between two of its forward calls (no copy, no
forward sees half of a version)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import nn

from .. import (
    ReceiverFailed,
    SenderClosed,
    TransferTimeout,
    WaitTimeout,
    WeightReceiver,
)
from ..core.shutdown import start_thread  # (joined at exit: pyproject.toml's contract allows it)
from .trainer import FAILED


class Worker:
    """A worker's end (see the module docstring): ``policy()`` is the module to update, ``key(*parts)`` names the
    scheme's store keys, ``rank`` this worker's in the scheme's group."""

    def __init__(
        self,
        receiver: WeightReceiver,
        store: dist.Store,
        key: Callable[..., str],
        rank: int,
        name: str,
        sync: bool,
        timeout: float,
        device: Any,
        policy: Callable[[], nn.Module],
    ) -> None:
        self.receiver, self.store, self.key, self.rank, self.name = receiver, store, key, rank, name
        self.sync, self.timeout, self.device, self._policy = sync, timeout, device, policy
        self.stopping = threading.Event()
        self._gate = (
            threading.RLock()
        )  # held by every forward of the worker's policy, and by a switch
        self._hooks: tuple[Any, Any] | None = None
        self._wrapped: dict[int, tuple[TensorDict, TensorDict]] = {}
        self._reading: Any = None  # the hold on the version the worker's policy uses
        self._thread: threading.Thread | None = None
        self.failure: str | None = None
        #: the version the policy acts with
        self.version = 0

    def start(self, thread_name: str) -> None:
        """Version 1 into the policy, then a thread that takes every next version."""
        self._switch(self.receiver.pull())
        self._thread = start_thread(self._take_versions, thread_name)  # (joined at exit too)

    def td(self) -> TensorDictBase:
        """The version the policy acts with."""
        if self.failure is not None:
            raise ReceiverFailed(f"weight sync of {self.name!r}: {self.failure}")
        return self.receiver.td

    def _take_versions(self) -> None:
        """The worker's thread: pull each next version, switch the policy to it, say so. Its pull blocks until a
        version comes (looking up once per ``timeout`` with nothing pushed); :meth:`close` ends it by closing the
        receiver."""
        while not self.stopping.is_set():
            try:
                version = self.receiver.pull(timeout=self.timeout)
            except WaitTimeout:
                continue  # the trainer pushed nothing meanwhile: the pull goes on
            except SenderClosed:
                return
            except Exception as error:  # noqa: BLE001 - told to the trainer, which raises it
                if not self.stopping.is_set():  # (else: close() closed the receiver under the pull)
                    self._fail(f"receiving a version failed: {error}", self.version + 1)
                # the pull's future keeps its error, whose traceback would keep this thread's frames (and this
                # worker) for good: torch's future is opaque to the garbage collector
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
        self.failure = reason
        try:
            self.store.set(self.key("failed", self.rank), reason)
            if self.sync:
                self.store.set(self.key("switched", self.rank, version), FAILED + reason)
            self.receiver.close()
        except Exception:  # noqa: BLE001 - the trainer is gone: nobody to tell
            pass

    def _switch(self, version: int) -> None:
        """Point the policy's tensors at the version just landed, between two of its forward calls."""
        model = self._policy()
        hold = self.receiver.reading()
        td = hold.__enter__()  # no pull writes this version's buffer while the policy uses it
        try:
            self._guard(model)
            if not self._gate.acquire(timeout=self.timeout):
                raise TransferTimeout(f"the policy's forward held it for {self.timeout:g} s")
            try:
                current = TensorDict.from_module(model)
                if (
                    all(t.device == self.device for t in current.values(True, True))
                    or self.version == 0
                ):
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
            self.store.set(self.key("switched", self.rank, version), "")  # (stored as b"")

    def _as_module_tensors(self, td: TensorDict, current: TensorDictBase) -> TensorDict:
        """``td``'s views as the module holds them (parameters as ``nn.Parameter``), made once per buffer."""
        entry = self._wrapped.get(id(td))
        if entry is not None and entry[0] is td:
            return entry[1]
        wrapped = TensorDict({}, batch_size=[])
        for path, held in current.items(True, True):
            view = td.get(path)
            wrapped.set(
                path,
                nn.Parameter(view, requires_grad=held.requires_grad)
                if isinstance(held, nn.Parameter)
                else view,
            )
        if (
            len(self._wrapped) >= self.receiver.buffer_count
        ):  # the buffers the receiver hands out take turns
            self._wrapped.clear()
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

    def close(self) -> None:
        """Close the receiver (that ends the thread's pull), join the thread, let go of the version held."""
        self.stopping.set()
        with contextlib.suppress(Exception):  # the trainer is gone already
            self.receiver.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout)
        if self._reading is not None:
            self._reading.__exit__(None, None, None)
        self._thread = self._reading = None
