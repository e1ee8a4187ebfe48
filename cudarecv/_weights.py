"""RL weight sync: a persistent sender/receiver pair.

A trainer holds a :class:`WeightSender` and pushes its policy's weights every
step; each actor holds a :class:`WeightReceiver` and acts on the latest
complete version it has. The structure travels once, at construction (a JSON
schema, never pickle); every push is then one transfer of the weights' storage
(in ``bucket_bytes`` chunks) into memory the receiver allocated at the
handshake, after a small header (version, byte count, fingerprint, optional
checksum).

The receiver keeps two storages: the published one (``receiver.td``, the last
complete, verified version) and the one the next pull lands in. A pull that
fails (timeout, wrong header, checksum mismatch, dead sender) never touches the
published one; a late write from an abandoned transfer can only land in the
other, which is never published after such a failure (the receiver is then
marked broken: close it and connect a new one).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Iterator

import torch
from tensordict import TensorDict
from torch import Tensor

from . import _cuda
from ._api import _lane, check_bucket_bytes
from ._fast_wire import read_bytes, wire_bytes
from ._handle import Transfer
from ._header import piece_sizes
from ._link import Link, resolve
from ._plan import _cut, plan_for
from ._staging import Lane, drain, recv_into, send_from
from ._walk import unwrap
from ._weights_wire import (
    HEADER_SIZE, STATUS_SIZE, TAG_HEADER, TAG_PAYLOAD, TAG_PREAMBLE, TAG_SCHEMA, TAG_STATUS,
    PushHeader, PushHeaderError, Schema, SchemaError, checksum, preamble, read_preamble,
    read_status, status_message,
)


class ChecksumError(ValueError):
    """A pushed payload whose checksum does not match its header (rejected, last version kept)."""


def _check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"`timeout` must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _peers(value: Any, name: str) -> list[int] | None:
    if value is None:
        return None
    peers = list(value) if isinstance(value, (list, tuple)) else [value]
    if not peers:
        raise ValueError(f"`{name}` is empty: pass at least one rank")
    if len(set(peers)) != len(peers):
        raise ValueError(f"`{name}` names a rank twice: {peers}")
    return peers


def _run(protocol: Any, lane: Lane, timeout: float, what: str) -> Any:
    """Drive a control-message protocol to its end within ``timeout`` seconds."""
    try:
        return Transfer(protocol, lane.stream).wait(timeout)
    except (SchemaError, PushHeaderError):
        raise
    except Exception as error:  # noqa: BLE001 - re-raised with the peer named
        raise _peer_error(lane.link, what, timeout, error) from error


def _peer_error(link: Link, what: str, timeout: float, error: BaseException) -> Exception:
    text = str(error)
    if isinstance(error, TimeoutError) or "Timed out" in text or "timed out" in text:
        return TimeoutError(f"{what}: rank {link.peer} of the group sent nothing within {timeout:g} s")
    return RuntimeError(f"{what}: the link to rank {link.peer} of the group failed: {text.splitlines()[0] if text else error!r}")


def _send_bytes(lane: Lane, data: bytes, tag: int) -> Any:
    yield from send_from(lane, [wire_bytes(lane, data)], [tag])


class _Driver:
    """One thread, started once per receiver, that finishes transfers handed to it.

    gloo reports a receive complete only inside ``Work.wait()``, and a pull has
    steps (header, then payload): ``pull(wait=False)`` hands its transfer here
    so it progresses while the caller acts.
    """

    def __init__(self, name: str) -> None:
        self._jobs: "queue.SimpleQueue[tuple[Transfer, float] | None]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, transfer: Transfer, timeout: float) -> None:
        self._jobs.put((transfer, timeout))

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            transfer, timeout = job
            with contextlib.suppress(BaseException):  # the error is on the transfer
                transfer.wait(timeout)

    def stop(self, timeout: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)


class WeightSender:
    """Push the values of ``td`` to one or more :class:`WeightReceiver` ranks, every step.

    Args:
        td: the weights (a tensordict or tensorclass; ``TensorDict.from_module(model)``
            shares the model's parameters, so each push sends their current values).
        dst: a global rank or a list of them. Exclusive with ``group_dst``.

    Keyword Args:
        group: the process group (a standalone one with ``group_dst``).
        group_dst: a rank or ranks in ``group``.
        bucket_bytes: bytes per payload message (default: the whole storage at once).
        timeout: seconds any wait may take (handshake, push).
        verify: send a checksum with every push; receivers reject a corrupted payload.
        stream: the CUDA stream for GPU weights (default: cudarecv's dedicated stream).

    Construction performs the handshake with every receiver and raises if one
    rejects the schema (naming it and the first differing key).

    Example:
        >>> sender = WeightSender(TensorDict.from_module(policy), dst=[1, 2], bucket_bytes=1 << 20)
        >>> version = sender.push()      # blocks until every receiver has the bytes
        >>> futures = sender.push(wait=False)
    """

    def __init__(self, td: Any, dst: Any = None, *, group: Any = None, group_dst: Any = None,
                 bucket_bytes: int | None = None, timeout: float = 60.0, verify: bool = False,
                 stream: Any = None) -> None:
        self.timeout = _check_timeout(timeout)
        check_bucket_bytes(bucket_bytes)
        dsts, group_dsts = _peers(dst, "dst"), _peers(group_dst, "group_dst")
        if (dsts is None) == (group_dsts is None):
            raise ValueError("pass exactly one of `dst` and `group_dst` (a rank or a list of ranks)")
        links = [resolve(d, None, group, "dst", "group_dst") for d in dsts] if dsts is not None else [
            resolve(None, d, group, "dst", "group_dst") for d in group_dsts]
        self._td = unwrap(td)
        plan = plan_for(self._td)
        plan.check()
        self.schema = Schema.of(plan.paths, plan.tensors)
        self._device = plan.device
        self._storage = torch.zeros(self.schema.total, dtype=torch.uint8, device=self._device)
        self._views = self.schema.views(self._storage)
        self._piece = bucket_bytes or max(self.schema.total, 1)
        self._chunks = _cut(self._storage, self._piece)
        self._verify = bool(verify)
        self._lanes = [_lane(link, self._device, stream, _cuda.StagingPool()) for link in links]
        self._in_flight: list[Transfer] = []
        self._closed = False
        self.version = 0
        self._handshake()
        self._drivers = [_Driver(f"cudarecv-push-{lane.link.peer}") for lane in self._lanes]

    @property
    def ranks(self) -> list[int]:
        """The receivers' ranks in the group."""
        return [lane.link.peer for lane in self._lanes]

    def _handshake(self) -> None:
        raw = self.schema.to_json()
        deadline = time.monotonic() + self.timeout
        for lane in self._lanes:
            def hello(lane: Lane = lane) -> Any:
                head = yield from send_from(lane, [wire_bytes(lane, preamble(len(raw)))], [TAG_PREAMBLE], defer=True)
                yield from _send_bytes(lane, raw, TAG_SCHEMA)
                if head:
                    yield head
            _run(hello(), lane, max(deadline - time.monotonic(), 1e-3), "weight-sync handshake")
        for lane in self._lanes:
            ok, reason = read_status(_run(read_bytes(lane, STATUS_SIZE, TAG_STATUS), lane,
                                          max(deadline - time.monotonic(), 1e-3), "weight-sync handshake"))
            if not ok:
                raise SchemaError(f"receiver rank {lane.link.peer} rejected the weights: {reason}")

    def _finish(self, transfers: list[Transfer], version: int) -> None:
        """Wait for every receiver's transfer (all of them, even after one fails), then raise
        the first failure, naming its receiver: the storage is reused only once all are out."""
        first = None
        deadline = time.monotonic() + self.timeout
        for lane, transfer in zip(self._lanes, transfers):
            try:
                transfer.wait(max(deadline - time.monotonic(), 1e-3))
            except Exception as error:  # noqa: BLE001 - the first is re-raised with its peer named
                first = first or _peer_error(lane.link, f"push of version {version}", self.timeout, error)
        if first is not None:
            raise first

    def _finish_in_flight(self) -> None:
        pending, self._in_flight = self._in_flight, []
        if pending:
            self._finish(pending, self.version)

    def push(self, wait: bool = True) -> int | list[Transfer]:
        """Send the current values of ``td`` to every receiver as the next version.

        Returns the new version number, or with ``wait=False`` one
        :class:`~cudarecv.Transfer` per receiver (their ``wait()`` returns ``None``).

        Raises:
            TimeoutError or RuntimeError naming the receiver whose link failed.
        """
        if self._closed:
            raise RuntimeError("this WeightSender is closed")
        self._finish_in_flight()  # the storage is reused: the previous push must be out
        plan = plan_for(self._td)
        if [tuple(map(str, p)) for p in plan.paths] != [l.key for l in self.schema.leaves] or any(
            tuple(t.shape) != l.shape or t.dtype != l.dtype for t, l in zip(plan.tensors, self.schema.leaves)
        ):
            raise SchemaError("the tensordict changed structure since the handshake: build a new WeightSender")
        stream = self._lanes[0].stream  # every lane of a sender shares its device's stream
        if stream is not None:
            _cuda.follow_caller(stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            torch._foreach_copy_(self._views, plan.tensors, non_blocking=True)
            digest = checksum(self._storage) if self._verify else bytes(16)
        if stream is not None:  # the caller's next writes (an optimizer step) wait for the copy
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        self.version += 1
        header = PushHeader(self.version, self.schema.total, self._piece, self.schema.fingerprint,
                            digest, self._verify)
        transfers = [Transfer(self._push(lane, header), lane.stream) for lane in self._lanes]
        if not wait:
            self._in_flight = transfers
            for driver, transfer in zip(self._drivers, transfers):
                driver.submit(transfer, self.timeout)  # one thread per receiver: none waits for another
            return transfers
        self._finish(transfers, self.version)
        return self.version

    def _push(self, lane: Lane, header: PushHeader) -> Any:
        head = yield from send_from(lane, [wire_bytes(lane, header.pack())], [TAG_HEADER], defer=True)
        tags = [TAG_PAYLOAD + i for i in range(len(self._chunks))]
        yield from send_from(lane, self._chunks, tags)
        if head:
            yield head

    def close(self) -> None:
        """Finish the push in flight (bounded by ``timeout``) and stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._finish_in_flight()
        for driver in self._drivers:
            driver.stop(self.timeout)

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Slot:
    """One storage the receiver can publish, with its tensordict of views and readers."""

    def __init__(self, schema: Schema, device: torch.device, pin_memory: bool) -> None:
        self.storage = torch.zeros(schema.total, dtype=torch.uint8, device=device, pin_memory=pin_memory)
        views = schema.views(self.storage)
        self.td = TensorDict({l.key: v for l, v in zip(schema.leaves, views)}, batch_size=[]).lock_()
        self.chunks: dict[int, list[Tensor]] = {}
        self.readers = 0

    def pieces(self, piece: int) -> list[Tensor]:
        found = self.chunks.get(piece)
        if found is None:
            found = self.chunks[piece] = _cut(self.storage, piece)
        return found


def _expected(expect: Any) -> tuple[list[tuple], list[Tensor]]:
    if isinstance(expect, torch.nn.Module):
        named = list(expect.named_parameters()) + list(expect.named_buffers())
        return [tuple(n.split(".")) for n, _ in named], [t for _, t in named]
    from ._walk import walk

    paths, tensors = walk(unwrap(expect))
    return [tuple(map(str, p)) for p in paths], tensors


class WeightReceiver:
    """Receive the versions a :class:`WeightSender` pushes; ``td`` is the latest complete one.

    Keyword Args:
        src / group_src: the sender's rank (global, or in ``group``); exactly one.
        group: the process group (a standalone one with ``group_src``).
        device: where the weights live (``"cpu"`` default, or a CUDA device).
        pin_memory: page-locked host storage (CPU only).
        expect: a tensordict or an ``nn.Module`` the weights must match (keys,
            shapes, dtypes); a mismatch raises :class:`SchemaError` naming the
            first differing key, and the sender's construction fails too.
        timeout: seconds any wait may take.
        stream: the CUDA stream for GPU weights (default: cudarecv's dedicated stream).

    Example:
        >>> receiver = WeightReceiver(src=0, device="cuda:0", expect=policy)
        >>> receiver.pull()              # blocks until the next version has landed
        >>> receiver.load_into(policy)   # or read receiver.td
    """

    def __init__(self, src: int | None = None, *, group: Any = None, group_src: int | None = None,
                 device: Any = None, pin_memory: bool = False, expect: Any = None, timeout: float = 60.0,
                 stream: Any = None) -> None:
        self.timeout = _check_timeout(timeout)
        self._device = torch.device(device if device is not None else "cpu")
        if pin_memory and self._device.type != "cpu":
            raise ValueError(f"`pin_memory=True` is for host memory, but `device` is {self._device}: drop one")
        link = resolve(src, group_src, group, "src", "group_src")
        self._lane = _lane(link, self._device, stream, _cuda.StagingPool())
        deadline = time.monotonic() + self.timeout
        length = read_preamble(_run(read_bytes(self._lane, 16, TAG_PREAMBLE), self._lane, self.timeout,
                                    "weight-sync handshake"))
        self.schema = Schema.from_json(_run(read_bytes(self._lane, length, TAG_SCHEMA), self._lane,
                                            max(deadline - time.monotonic(), 1e-3), "weight-sync handshake"))
        problem = None
        difference = None if expect is None else self.schema.first_difference(*_expected(expect))
        if difference:
            problem = f"the sender's weights do not match `expect`: {difference}"
        slots: list[_Slot] = []
        if problem is None:
            try:  # allocate before answering, so that the sender learns if it fails
                slots = [_Slot(self.schema, self._device, pin_memory) for _ in range(2)]
            except (RuntimeError, MemoryError) as error:
                problem = f"the receiver cannot allocate 2 x {self.schema.total} bytes on {self._device}: {error}"
        _run(_send_bytes(self._lane, status_message(problem is None, problem or ""), TAG_STATUS), self._lane,
             max(deadline - time.monotonic(), 1e-3), "weight-sync handshake")
        if problem:
            raise SchemaError(problem)
        self._slots = slots
        self._pending: Transfer | None = None
        self._cond = threading.Condition()
        self._published: int | None = None
        self._broken: str | None = None
        self._closed = False
        self._driver = _Driver(f"cudarecv-pull-{link.peer}")
        self.version = 0

    @property
    def td(self) -> TensorDict:
        """The latest complete, verified version (a locked tensordict of views)."""
        if self._published is None:
            raise RuntimeError("no version has landed yet: call pull() first")
        return self._slots[self._published].td

    @contextlib.contextmanager
    def reading(self) -> Iterator[TensorDict]:
        """Hold the latest version while reading it: no pull writes into it meanwhile.

        Example:
            >>> with receiver.reading() as td:
            ...     action = policy_from(td)(obs)
        """
        with self._cond:
            if self._published is None:
                raise RuntimeError("no version has landed yet: call pull() first")
            slot = self._slots[self._published]
            slot.readers += 1
        try:
            yield slot.td
        finally:
            with self._cond:
                slot.readers -= 1
                self._cond.notify_all()

    def pull(self, wait: bool = True) -> int | Transfer:
        """Receive the next version; return its number once it has landed and been verified.

        With ``wait=False``, return a :class:`~cudarecv.Transfer` whose ``wait()``
        returns the version (and whose ``done()`` advances it without blocking).

        Raises:
            PushHeaderError / ChecksumError: the push was rejected (drained; the last
                version stays published and the next pull works).
            TimeoutError / RuntimeError: nothing complete arrived in time or the sender
                died; the receiver is then broken: close it and connect a new one.
        """
        if self._closed:
            raise RuntimeError("this WeightReceiver is closed")
        if self._broken:
            raise RuntimeError(f"this WeightReceiver is broken ({self._broken}): close it and connect a new one")
        if self._pending is not None:  # one pull at a time: the spare buffer is the next one's
            with contextlib.suppress(Exception):
                self._pending.wait(self.timeout)
            self._pending = None
            if self._broken:
                raise RuntimeError(f"this WeightReceiver is broken ({self._broken}): close it and connect a new one")
        back = self._slots[1 if self._published == 0 else 0]
        with self._cond:
            if not self._cond.wait_for(lambda: back.readers == 0, timeout=self.timeout):
                raise TimeoutError(f"a reader held the spare weights buffer for {self.timeout:g} s")
        if self._lane.stream is not None:
            _cuda.follow_caller(self._lane.stream)
        transfer = Transfer(self._pull(self._lane, back), self._lane.stream, on_error=self._on_error)
        if wait:
            return transfer.wait(self.timeout)
        self._pending = transfer
        self._driver.submit(transfer, self.timeout)
        return transfer

    def _on_error(self, error: BaseException) -> BaseException:
        if isinstance(error, ChecksumError) or (isinstance(error, PushHeaderError) and "drained" in str(error)):
            return error  # the link is still in step: the next pull works
        replaced = _peer_error(self._lane.link, "pull", self.timeout, error)
        self._broken = str(replaced)
        return replaced

    def _pull(self, lane: Lane, slot: _Slot) -> Any:
        header = PushHeader.unpack((yield from read_bytes(lane, HEADER_SIZE, TAG_HEADER)))
        problem = None
        if header.total != self.schema.total or header.fingerprint != self.schema.fingerprint:
            problem = (f"a push of {header.total} bytes with fingerprint {header.fingerprint.hex()} does not "
                       f"match the handshake ({self.schema.total} bytes, {self.schema.fingerprint.hex()})")
        elif header.version <= self.version:
            problem = f"version {header.version} is not newer than the current {self.version}"
        sizes = piece_sizes(header.total, header.piece)
        tags = [TAG_PAYLOAD + i for i in range(len(sizes))]
        if problem:
            yield from drain(lane, sizes, tags)
            raise PushHeaderError(f"{problem}: rejected and drained; version {self.version} stays published")
        yield from recv_into(lane, slot.pieces(header.piece), tags)
        if lane.stream is not None:
            yield [_cuda.EventWork(_cuda.record(lane.stream))]  # verify and publish landed bytes only
        if header.verify:
            with torch.cuda.stream(lane.stream) if lane.stream is not None else contextlib.nullcontext():
                got = checksum(slot.storage)
            if got != header.checksum:
                raise ChecksumError(
                    f"version {header.version} arrived corrupted (checksum {got.hex()} != {header.checksum.hex()}): "
                    f"rejected; version {self.version} stays published"
                )
        with self._cond:
            self._published = self._slots.index(slot)
            self.version = header.version
            self._cond.notify_all()
        return header.version

    def load_into(self, module: torch.nn.Module, strict: bool = True) -> int:
        """Copy the latest version into ``module``'s parameters and buffers, in place.

        Every name is matched and checked before anything is written; returns the
        version copied. With ``strict=False``, names missing on either side are skipped.
        """
        named = list(module.named_parameters()) + list(module.named_buffers())
        with self.reading() as td:
            pairs, missing = [], []
            for name, tensor in named:
                source = td.get(tuple(name.split(".")), None)
                if source is None:
                    missing.append(name)
                    continue
                if source.shape != tensor.shape or source.dtype != tensor.dtype:
                    raise SchemaError(f"{name!r}: received {source.dtype} {list(source.shape)}, "
                                      f"module has {tensor.dtype} {list(tensor.shape)}")
                pairs.append((tensor, source))
            extra = len(td.keys(True, True)) - len(pairs)
            if strict and (missing or extra):
                raise SchemaError(f"load_into: module names not received: {missing}; "
                                  f"{extra} received leaves not in the module (pass strict=False to skip)")
            with torch.no_grad():
                for tensor, source in pairs:
                    tensor.copy_(source, non_blocking=True)
            if any(s.device.type == "cpu" and t.device.type == "cuda" for t, s in pairs):
                # a copy out of host memory may still be queued: finish it before the
                # next pull may write into that memory
                torch.cuda.current_stream(next(t for t, _ in pairs if t.device.type == "cuda").device).synchronize()
            return self.version

    def close(self) -> None:
        """Stop receiving (a pull in flight gets up to ``timeout`` to end). Idempotent;
        the published version stays readable."""
        if not self._closed:
            self._closed = True
            self._driver.stop(self.timeout)

    def __enter__(self) -> "WeightReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

