"""The trainer's side of the TorchRL scheme: a :class:`~cudarecv.WeightSender` to every worker, each version's
push, and the names of workers that died, failed or never switched (from the push's errors, the store's words,
and the collector's worker processes)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import cast

import torch.distributed as dist
from tensordict import TensorDictBase

from .. import Error, PeerError, ReceiverFailed, Transfer, TransferTimeout, WeightSender

FAILED = "failed: "  # what a worker's switched key says when it could not take the version


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


class Trainer:
    """The trainer's end (see the module docstring): ``key(*parts)`` names the scheme's store keys; ``workers()``
    lists the collector's worker processes; ``current()`` gives the policy's weights now."""

    def __init__(
        self,
        sender: WeightSender,
        store: dist.Store,
        key: Callable[..., str],
        name: str,
        sync: bool,
        timeout: float,
        workers: Callable[[], list],
        current: Callable[[], TensorDictBase] | None,
        pointers: list[int],
    ) -> None:
        self.sender, self.store, self.key, self.name, self.sync, self.timeout = (
            sender,
            store,
            key,
            name,
            sync,
            timeout,
        )
        self._workers, self._current, self._pointers = workers, current, pointers
        self._reported_dead: set[int] = (
            set()
        )  # the collector's exited worker processes already named

    def replaced(self) -> TensorDictBase | None:
        """The policy's current weights if they are no longer the tensors the sender was built on (the policy's
        ``load_state_dict(..., assign=True)`` or ``p.data = new`` replaced them), else None (the sender sends
        its own ``td``, which shares the policy's tensors)."""
        if self._current is None:
            return None
        current = self._current()
        return (
            None
            if [t.data_ptr() for t in current.values(True, True)] == self._pointers
            else current
        )

    def push(self, values: TensorDictBase | None) -> int:
        """Send the next version (``values``, or the sender's ``td``); with ``sync``, return once every worker acts
        with it. Raises naming every worker lost since the last call (once each)."""
        sender = self.sender
        dropped, before = dict(sender.dropped), sender.version
        try:
            # sync: one transfer per worker, under way
            pushed = cast(list[Transfer], sender.push(wait=False, values=values))
        except (
            PeerError
        ) as error:  # latest: a worker lost between calls, named after the version was published
            if sender.version == before or self._unnamed(dropped):
                raise self._named(error, dropped) from error
            pushed = []  # its process was named exited already: named once
        except Error as error:
            raise self._named(error, dropped) from error
        ranks, version = sender.ranks, sender.version
        if self.sync:
            self._wait_switched(version, pushed, ranks, dropped)
        # who was lost since the last call, though every worker left has the version (said once each; a worker
        # whose thread failed closes its receiver, so it is dropped too, its reason on the store)
        named = [
            f"worker {self._worker_of(r)} (rank {r}): {self._said(r) or why}"
            for r, why in self._unnamed(dropped)
        ]
        dead = self._newly_dead()
        if dead:
            named.append(f"worker process(es) {dead} of the collector exited")
        if named:
            raise PeerError(
                f"weight sync of {self.name!r}, version {version} (every worker left has it): "
                + "; ".join(named)
            )
        return version

    def _unnamed(self, before: dict[int, str]) -> list[tuple[int, str]]:
        """The receivers dropped since ``before`` whose worker process was not named exited already."""
        exited = {str(i) for i in self._reported_dead}
        return [
            (r, why)
            for r, why in self.sender.dropped.items()
            if r not in before and self._worker_of(r) not in exited
        ]

    def _named(self, error: Error, before: dict[int, str]) -> Error:
        """``error`` with the workers dropped since ``before`` named."""
        lost = [rank for rank in self.sender.dropped if rank not in before]
        names = ", ".join(f"worker {self._worker_of(rank)} (rank {rank})" for rank in lost)
        text = f"{names} dropped: {error}" if names else str(error)
        dead = self._newly_dead()
        if dead:
            text += f"; worker process(es) {dead} of the collector exited"
        return type(error)(f"weight sync of {self.name!r}: {text}")

    def _worker_of(self, rank: int) -> str:
        try:
            return self.store.get(self.key("worker", rank)).decode()
        except Exception:  # noqa: BLE001 - a name for an error message only
            return "?"

    def _said(self, rank: int) -> str | None:
        """Why the worker of ``rank`` stopped taking versions, if it said so."""
        key = self.key("failed", rank)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _wait_switched(
        self, version: int, pushed: list[Transfer], ranks: list[int], dropped: dict[int, str]
    ) -> None:
        """Wait until every worker of ``ranks`` (``pushed`` to) acts with ``version``; name those that fail or never
        do. Both waits block: the transfers' futures (a worker that died or failed is named as soon as its transfer
        fails), then the store's wait for each worker's word that it switched (or why it could not), for what is
        left of ``timeout``."""
        deadline = time.monotonic() + self.timeout
        for transfer in pushed:  # each bounded by the sender's timeout
            try:
                transfer.wait()
            except Error as error:
                raise self._named(error, dropped) from error
        keys = {rank: self.key("switched", rank, version) for rank in ranks}
        try:
            self.store.wait(list(keys.values()), seconds(max(deadline - time.monotonic(), 1e-3)))
        except dist.DistStoreError:  # its timeout; nothing else is taken for one
            missing = [r for r, key in keys.items() if not self.store.check([key])]
            named = ", ".join(f"worker {self._worker_of(r)} (rank {r})" for r in missing)
            dead = self._newly_dead()
            if dead:
                raise PeerError(
                    f"weight sync of {self.name!r}, version {version}: worker process(es) "
                    f"{dead} died; {named} did not switch to it"
                ) from None
            raise TransferTimeout(
                f"weight sync of {self.name!r}: {named} did not switch to version "
                f"{version} within {self.timeout:g} s (its policy's forward held it, or "
                "it stopped)"
            ) from None
        said = {rank: self.store.get(key).decode() for rank, key in keys.items()}
        for key in keys.values():
            self.store.delete_key(key)
        failed = [
            f"worker {self._worker_of(r)} (rank {r}): {why.removeprefix(FAILED)}"
            for r, why in said.items()
            if why.startswith(FAILED)
        ]
        if failed:
            raise ReceiverFailed(
                f"weight sync of {self.name!r}, version {version}: " + "; ".join(failed)
            )

    def _newly_dead(self) -> list[int]:
        """The collector's worker processes that exited since the last call named them (named from now on)."""
        dead = [
            i
            for i, proc in enumerate(self._workers())
            if hasattr(proc, "is_alive") and not proc.is_alive() and i not in self._reported_dead
        ]
        self._reported_dead.update(dead)
        return dead
