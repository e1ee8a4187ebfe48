"""RL weight sync: a persistent sender/receiver pair.

A trainer holds a :class:`WeightSender` and pushes its policy's weights every
step; each actor holds a :class:`WeightReceiver` and acts on the latest
complete version it has. The structure travels once, at construction (a JSON
schema, never pickle, after a preamble with its length and the push message
size); every push is then one transfer of the weights' storage (in
``bucket_bytes`` chunks) into memory the receiver allocated at the handshake,
after a small header (version, byte count, fingerprint, optional BLAKE3 digest).

The receiver keeps two storages: the published one (``receiver.td``, the last
complete, verified version) and the one the next pull lands in. A pull that
fails (timeout, wrong header, digest mismatch, dead sender) never touches the
published one; a late write from an abandoned transfer can only land in the
other, which is never published after such a failure (the receiver is then
marked broken: close it and connect a new one).

A receiver of a fan-out that fails (dies, or takes longer than ``timeout``) is
named in the push's :class:`TransferTimeout`/:class:`PeerError` and dropped; every other
receiver keeps getting every version, and ``sender.ranks`` shows who is left.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Callable, Iterator

import torch
from tensordict import TensorDict
from torch import Tensor

from . import _cuda
from ._api import check_bucket_bytes
from ._control import read_bytes, wire_bytes
from ._errors import (
    ArgumentError,
    BrokenError,
    ChecksumError,
    Error,
    LinkError,
    MismatchError,
    OutOfStepError,
    PeerError,
    PushHeaderError,
    SchemaError,
    TransferTimeout,
    UsageError,
    WaitTimeout,
)
from ._handle import Transfer
from ._header import check_pieces, cut
from ._link import Link, resolve
from ._plan import plan_for
from ._staging import Lane, drain, lane_for, recv_into, send_from
from ._transport import park
from ._walk import unwrap
from ._weights_wire import (
    HEADER_SIZE,
    MAX_SCHEMA_BYTES,
    PREAMBLE_SIZE,
    STATUS_SIZE,
    TAG_HEADER,
    TAG_PAYLOAD,
    TAG_PREAMBLE,
    TAG_SCHEMA,
    TAG_STATUS,
    PushHeader,
    Schema,
    check_offer,
    checksum,
    preamble,
    read_preamble,
    read_status,
    status_message,
)


def _check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ArgumentError(f"`timeout` must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _peers(value: Any, name: str) -> list[int] | None:
    if value is None:
        return None
    peers = list(value) if isinstance(value, (list, tuple)) else [value]
    if not peers:
        raise ArgumentError(f"`{name}` is empty: pass at least one rank")
    if len(set(peers)) != len(peers):
        raise ArgumentError(f"`{name}` names a rank twice: {peers}")
    return peers


def _link_error(link: Link, what: str, error: BaseException, seconds: float, silent: str) -> LinkError:
    """``error`` on the link to ``link.peer`` as a :class:`TransferTimeout` or :class:`PeerError` naming the peer.

    ``seconds``: the time that ran out (a timeout) or that had passed (a failure);
    ``silent`` says what the peer did not do, e.g. ``"sent nothing"``.
    """
    if isinstance(error, TimeoutError):
        return TransferTimeout(f"{what}: rank {link.peer} of the group {silent} within {seconds:g} s")
    text = str(error).splitlines()[0] if str(error) else repr(error)
    return PeerError(f"{what}: the link to rank {link.peer} of the group failed after {seconds:.3g} s: {text}")


def _run(protocol: Any, lane: Lane, timeout: float, what: str, silent: str = "sent nothing") -> Any:
    """Drive a control-message protocol to its end within ``timeout`` seconds."""
    def named(error: BaseException, elapsed: float) -> BaseException:
        if isinstance(error, (MismatchError, OutOfStepError)):
            return error
        return _link_error(lane.link, what, error, timeout if isinstance(error, TimeoutError) else elapsed, silent)

    return Transfer(protocol, lane.stream, on_error=named, timeout=timeout, link=lane.link).wait()


def _send_bytes(lane: Lane, data: bytes, tag: int) -> Any:
    yield from send_from(lane, [wire_bytes(lane, data)], [tag])


class _Driver:
    """One thread, started once per peer, that runs what is handed to it (transfers to settle).

    gloo reports a receive complete only inside ``Work.wait()``, and a pull has
    steps (header, then payload): ``pull(wait=False)`` hands its transfer here
    so it progresses while the caller acts; a fan-out push hands each receiver's
    transfer to that receiver's driver, so none waits for another.
    """

    def __init__(self, name: str) -> None:
        self._jobs: "queue.SimpleQueue[Callable[[], None] | None]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            with contextlib.suppress(BaseException):  # a transfer keeps its own error
                job()

    def stop(self, timeout: float) -> None:
        """Let the thread end after what it runs now (waiting up to ``timeout`` s for it)."""
        self._jobs.put(None)
        self._thread.join(timeout)


class _Receiver:
    """The sender's view of one receiver: its lane, its driver, and why it is gone (if it is)."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.rank = lane.link.peer
        self.driver = _Driver(f"cudarecv-push-{self.rank}")
        self.gone: str | None = None


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
        timeout: seconds any wait may take (handshake, each receiver's push).
        verify: send a BLAKE3 digest with every push; receivers reject a corrupted payload.
        stream: the CUDA stream for GPU weights (default: cudarecv's dedicated stream).

    Construction performs the handshake with every receiver and raises if one
    rejects the schema (naming it and the first differing key). A receiver that
    later fails is dropped (see :attr:`ranks` and :attr:`dropped`).

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
            raise ArgumentError("pass exactly one of `dst` and `group_dst` (a rank or a list of ranks)")
        links = [resolve(d, None, group, "dst", "group_dst") for d in dsts] if dsts is not None else [
            resolve(None, d, group, "dst", "group_dst") for d in group_dsts]
        self._td = unwrap(td)
        plan = plan_for(self._td)
        plan.check()
        if not plan.tensors:
            raise ArgumentError("`td` has no tensors: weight sync needs at least one leaf to send")
        self.schema = Schema.of(plan.paths, plan.tensors)
        raw = self.schema.to_json()
        if len(raw) > MAX_SCHEMA_BYTES:
            raise ArgumentError(f"the schema of `td` takes {len(raw)} bytes of JSON, more than {MAX_SCHEMA_BYTES}: "
                             "send fewer, larger leaves")
        self._piece = bucket_bytes or max(self.schema.total, 1)
        check_pieces(self.schema.total, self._piece, "weights")
        self._device = plan.device
        self._storage = torch.zeros(self.schema.total, dtype=torch.uint8, device=self._device)
        self._views = self.schema.views(self._storage)
        self._chunks = cut(self._storage, self._piece)
        self._verify = bool(verify)
        lanes = [lane_for(link, self._device, stream, _cuda.StagingPool()) for link in links]
        self._in_flight: list[tuple[_Receiver, Transfer]] = []
        self._torn = False  # a dropped receiver's send may still read the storage: use a new one
        self._closed = False
        self.version = 0
        self._handshake(lanes, raw)
        self._receivers = [_Receiver(lane) for lane in lanes]

    @property
    def ranks(self) -> list[int]:
        """The ranks (in the group) of the receivers still served."""
        return [r.rank for r in self._receivers if r.gone is None]

    @property
    def dropped(self) -> dict[int, str]:
        """The receivers dropped after a failure, and why."""
        return {r.rank: r.gone for r in self._receivers if r.gone is not None}

    def _handshake(self, lanes: list[Lane], raw: bytes) -> None:
        """Offer the schema to every receiver at once, then read every answer."""
        def hello(lane: Lane) -> Any:
            head = yield from send_from(lane, [wire_bytes(lane, preamble(len(raw), self._piece))], [TAG_PREAMBLE],
                                        defer=True)
            yield from _send_bytes(lane, raw, TAG_SCHEMA)
            if head:
                yield head

        def answer(lane: Lane) -> Any:
            return (yield from read_bytes(lane, STATUS_SIZE, TAG_STATUS, "handshake answer", SchemaError))

        what = "weight-sync handshake"
        offers = [(lane, self._control(hello(lane), lane, what, "took no schema")) for lane in lanes]
        answers = [(lane, self._control(answer(lane), lane, what, "sent no answer")) for lane in lanes]
        try:
            for _, transfer in offers + answers:
                transfer.wait()  # raises, naming the rank, if the link failed
        except BaseException:
            park([transfer for _, transfer in offers + answers])  # what is still in flight runs out
            raise
        for lane, transfer in answers:
            ok, reason = read_status(transfer.wait())
            if not ok:
                raise SchemaError(f"receiver rank {lane.link.peer} rejected the weights: {reason}")

    def _control(self, protocol: Any, lane: Lane, what: str, silent: str) -> Transfer:
        def named(error: BaseException, elapsed: float) -> BaseException:
            if isinstance(error, (MismatchError, OutOfStepError)):
                return error
            seconds = self.timeout if isinstance(error, TimeoutError) else elapsed
            return _link_error(lane.link, what, error, seconds, silent)

        return Transfer(protocol, lane.stream, on_error=named, timeout=self.timeout, link=lane.link,
                        raise_first=False)

    def _drop(self, receiver: _Receiver, version: int, timeout: float) -> Callable[[BaseException, float], BaseException]:
        """The error hook of ``receiver``'s push of ``version``: name it, and drop it."""
        def dropped(error: BaseException, elapsed: float) -> BaseException:
            seconds = timeout if isinstance(error, TimeoutError) else elapsed
            failure = _link_error(receiver.lane.link, f"push of version {version}", error, seconds,
                                  f"did not take version {version}")
            receiver.gone = str(failure)
            self._torn = True  # its send may still be reading the storage, long after this
            return type(failure)(f"{failure}; rank {receiver.rank} is dropped from this sender")

        return dropped

    def _finish(self, pushes: list[tuple[_Receiver, Transfer]], version: int) -> None:
        """Wait for every receiver's transfer (each bounded by its own timeout, all running at
        once); then raise the first failure, naming its receiver and who got the version."""
        errors = []
        for _, transfer in pushes:
            try:
                transfer.wait()
            except Exception as error:  # noqa: BLE001 - re-raised below, with the ranks reached
                errors.append(error)
        if errors:
            reached = [r.rank for r, t in pushes if not t.failed]
            raise type(errors[0])(f"{errors[0]} (version {version} reached ranks {reached})") from errors[0]

    def _finish_in_flight(self) -> None:
        """The push in flight must be out before the storage is reused; its failures were
        reported on its futures (and their receivers dropped)."""
        pending, self._in_flight = self._in_flight, []
        for _, transfer in pending:
            with contextlib.suppress(Exception):
                transfer.wait()

    def push(self, wait: bool = True, timeout: float | None = None) -> int | list[Transfer]:
        """Send the current values of ``td`` to every receiver still served, as the next version.

        Returns the new version number, or with ``wait=False`` one
        :class:`~cudarecv.Transfer` per receiver (their ``wait()`` returns ``None``).
        ``timeout``: seconds each receiver may take (default: the sender's ``timeout``).

        Raises:
            TransferTimeout or PeerError naming the receiver whose link failed: it is
                dropped (the others got the version, and get the next ones);
                PeerError if no receiver is left.
        """
        if self._closed:
            raise UsageError("this WeightSender is closed")
        limit = self.timeout if timeout is None else _check_timeout(timeout)
        self._finish_in_flight()  # the storage is reused: the previous push must be out
        live = [r for r in self._receivers if r.gone is None]
        if not live:
            raise PeerError(f"every receiver of this WeightSender was dropped ({self.dropped}): "
                               "connect new receivers with a new WeightSender")
        plan = plan_for(self._td)
        if [tuple(map(str, p)) for p in plan.paths] != [l.key for l in self.schema.leaves] or any(
            tuple(t.shape) != l.shape or t.dtype != l.dtype for t, l in zip(plan.tensors, self.schema.leaves)
        ):
            raise SchemaError("the tensordict changed structure since the handshake: build a new WeightSender")
        if self._torn:  # the old storage stays with the parked sends of the dropped receiver
            self._storage = torch.zeros_like(self._storage)
            self._views, self._chunks = self.schema.views(self._storage), cut(self._storage, self._piece)
            self._torn = False
        stream = live[0].lane.stream  # every lane of a sender shares its device's stream
        if stream is not None:
            _cuda.follow_caller(stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), torch.no_grad():
            torch._foreach_copy_(self._views, plan.detached, non_blocking=True)  # never an autograd node
            digest = checksum(self._storage) if self._verify else bytes(16)
        if stream is not None:  # the caller's next writes (an optimizer step) wait for the copy
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        self.version += 1
        header = PushHeader(self.version, self.schema.total, self._piece, self.schema.fingerprint,
                            digest, self._verify)
        pushes = []
        for receiver in live:  # each posted on its own: one failing never keeps the others from theirs
            transfer = Transfer(self._push(receiver.lane, header), receiver.lane.stream, timeout=limit,
                                driver=receiver.driver.submit, link=receiver.lane.link,
                                on_error=self._drop(receiver, self.version, limit), raise_first=False)
            pushes.append((receiver, transfer))
        if not wait:  # each is driven on its receiver's thread from the start: none waits for another
            self._in_flight = pushes
            return [transfer for _, transfer in pushes]
        self._finish(pushes, self.version)
        return self.version

    def _push(self, lane: Lane, header: PushHeader) -> Any:
        head = yield from send_from(lane, [wire_bytes(lane, header.pack())], [TAG_HEADER], defer=True)
        yield from send_from(lane, self._chunks, [TAG_PAYLOAD] * len(self._chunks))
        if head:
            yield head

    def close(self) -> None:
        """Finish the push in flight (bounded by ``timeout``) and stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finish_in_flight()
        for receiver in self._receivers:  # a dropped receiver's thread may wait on it forever: no join
            receiver.driver.stop(self.timeout if receiver.gone is None else 0.0)

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Slot:
    """One storage the receiver can publish, with its tensordict of views and readers."""

    def __init__(self, schema: Schema, piece: int, device: torch.device, pin_memory: bool) -> None:
        self.storage = torch.zeros(schema.total, dtype=torch.uint8, device=device, pin_memory=pin_memory)
        views = schema.views(self.storage)
        self.td = TensorDict({l.key: v for l, v in zip(schema.leaves, views)}, batch_size=[]).lock_()
        if len(self.td.keys(True, True)) != len(schema.leaves):
            raise SchemaError("the schema's keys do not make one leaf each")
        self.pieces = cut(self.storage, piece)
        self.readers = 0


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

    Every reason to refuse the sender's schema (malformed, empty, duplicate or
    overlapping keys, sizes out of range, ``expect`` not matching, no memory) is
    sent back as the handshake's answer, so the sender fails at once too.

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
            raise ArgumentError(f"`pin_memory=True` is for host memory, but `device` is {self._device}: drop one")
        link = resolve(src, group_src, group, "src", "group_src")
        self._lane = lane_for(link, self._device, stream, _cuda.StagingPool())
        self.schema, self._piece, self._slots = self._handshake(expect, pin_memory)
        self._pending: Transfer | None = None
        self._cond = threading.Condition()
        self._published: int | None = None
        self._broken: str | None = None
        self._closed = False
        self._driver = _Driver(f"cudarecv-pull-{link.peer}")  # drives every pull (the caller keeps the time)
        self.version = 0

    def _handshake(self, expect: Any, pin_memory: bool) -> tuple[Schema, int, list[_Slot]]:
        """Read the sender's offer, check it and allocate; answer the sender either way."""
        lane, what = self._lane, "weight-sync handshake"
        started = time.monotonic()

        def left() -> float:
            return max(self.timeout - (time.monotonic() - started), 1e-3)

        length, piece = read_preamble(_run(read_bytes(lane, PREAMBLE_SIZE, TAG_PREAMBLE, "handshake preamble",
                                                      SchemaError), lane, self.timeout, what))
        try:
            check_offer(length, piece)
        except SchemaError as error:  # the schema itself cannot be received: refuse at once
            self._answer(str(error), left())
            raise
        raw = _run(read_bytes(lane, length, TAG_SCHEMA, "weight schema", SchemaError), lane, left(), what)
        try:
            schema = Schema.from_json(raw)
            check_pieces(schema.total, piece, "weights")
            difference = None if expect is None else schema.first_difference(*_expected(expect))
            if difference:
                raise SchemaError(f"the sender's weights do not match `expect`: {difference}")
            try:  # allocate before answering, so that the sender learns if it fails
                slots = [_Slot(schema, piece, self._device, pin_memory) for _ in range(2)]
            except (RuntimeError, MemoryError) as error:
                raise SchemaError(f"the receiver cannot allocate 2 x {schema.total} bytes on {self._device}: "
                                  f"{error}") from None
        except Exception as error:  # noqa: BLE001 - every reason to refuse goes back to the sender
            problem = str(error) if isinstance(error, SchemaError) else f"{type(error).__name__}: {error}"
            self._answer(problem, left())
            raise SchemaError(problem) from error
        self._answer(None, left())
        return schema, piece, slots

    def _answer(self, problem: str | None, timeout: float) -> None:
        _run(_send_bytes(self._lane, status_message(problem is None, problem or ""), TAG_STATUS), self._lane,
             timeout, "weight-sync handshake", "took no answer")

    @property
    def td(self) -> TensorDict:
        """The latest complete, verified version (a locked tensordict of views)."""
        if self._published is None:
            raise UsageError("no version has landed yet: call pull() first")
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
                raise UsageError("no version has landed yet: call pull() first")
            slot = self._slots[self._published]
            slot.readers += 1
        try:
            yield slot.td
        finally:
            with self._cond:
                slot.readers -= 1
                self._cond.notify_all()

    def pull(self, wait: bool = True, timeout: float | None = None) -> int | Transfer:
        """Receive the next version; return its number once it has landed and been verified.

        ``timeout``: seconds this pull may take (default: the receiver's ``timeout``).

        With ``wait=False``, return a :class:`~cudarecv.Transfer` whose ``wait()``
        returns the version; it is driven to its end on the receiver's own thread,
        and a ``wait(t)`` that runs out never fails it (the pull goes on).

        Raises:
            PushHeaderError / ChecksumError: the push was rejected and drained; the
                last version stays published and the next pull works.
            OutOfStepError: a message that is no push of this handshake (lengths,
                not a header); TransferTimeout / PeerError: nothing complete arrived
                within ``timeout``, or the sender died. After these the receiver is
                broken (:class:`BrokenError` from then on): close it and connect a
                new one.
        """
        if self._closed:
            raise UsageError("this WeightReceiver is closed")
        limit = self.timeout if timeout is None else _check_timeout(timeout)
        if self._broken:
            raise BrokenError(f"this WeightReceiver is broken ({self._broken}): close it and connect a new one")
        if self._pending is not None:  # one pull at a time: the spare buffer is the next one's
            with contextlib.suppress(Exception):
                self._pending.wait()  # bounded by its own timeout
            self._pending = None
            if self._broken:
                raise BrokenError(f"this WeightReceiver is broken ({self._broken}): close it and connect a new one")
        back = self._slots[1 if self._published == 0 else 0]
        with self._cond:
            if not self._cond.wait_for(lambda: back.readers == 0, timeout=limit):
                raise WaitTimeout(f"a reader held the spare weights buffer for {limit:g} s")
        if self._lane.stream is not None:
            _cuda.follow_caller(self._lane.stream)
        transfer = Transfer(self._pull(self._lane, back), self._lane.stream,
                            on_error=lambda error, elapsed: self._on_error(error, elapsed, limit),
                            timeout=limit, driver=self._driver.submit, link=self._lane.link)
        if wait:
            return transfer.wait()
        self._pending = transfer  # driven on the receiver's thread from the start
        return transfer

    def _on_error(self, error: BaseException, elapsed: float, timeout: float) -> BaseException:
        if isinstance(error, Error) and error.link_usable:
            return error  # drained, the link in step: the next pull works
        if isinstance(error, OutOfStepError):
            self._broken = str(error)
            return error
        seconds = timeout if isinstance(error, TimeoutError) else elapsed
        replaced = _link_error(self._lane.link, "pull", error, seconds, "sent nothing complete")
        self._broken = str(replaced)
        return replaced

    def _pull(self, lane: Lane, slot: _Slot) -> Any:
        raw = yield from read_bytes(lane, HEADER_SIZE, TAG_HEADER, "weight-push header", _header_too_long)
        header = PushHeader.unpack(raw)
        total, piece = self.schema.total, self._piece
        if (header.total, header.piece) != (total, piece):  # never sized from the header
            raise OutOfStepError(
                f"a push of {header.total} bytes in {header.piece}-byte messages does not match the handshake "
                f"({total} bytes in {piece}-byte messages): not drained, the link is out of step"
            )
        problem = None
        if header.fingerprint != self.schema.fingerprint:
            problem = (f"a push with fingerprint {header.fingerprint.hex()} does not match the handshake "
                       f"({self.schema.fingerprint.hex()})")
        elif header.version <= self.version:
            problem = f"version {header.version} is not newer than the current {self.version}"
        if problem:
            yield from drain(lane, total, piece, TAG_PAYLOAD)
            raise PushHeaderError(f"{problem}: rejected and drained; version {self.version} stays published")
        yield from recv_into(lane, slot.pieces, [TAG_PAYLOAD] * len(slot.pieces))
        if lane.stream is not None:
            yield [_cuda.EventWork(_cuda.record(lane.stream))]  # verify and publish landed bytes only
        if header.verify:
            with torch.cuda.stream(lane.stream) if lane.stream is not None else contextlib.nullcontext():
                got = checksum(slot.storage)
            if got != header.checksum:
                raise ChecksumError(
                    f"version {header.version} arrived corrupted (BLAKE3 {got.hex()} != {header.checksum.hex()}): "
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
            self._driver.stop(0.0 if self._broken else self.timeout)  # a broken one may wait forever

    def __enter__(self) -> "WeightReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _header_too_long(text: str) -> OutOfStepError:
    return OutOfStepError(f"{text} (not drained, the link is out of step)")
