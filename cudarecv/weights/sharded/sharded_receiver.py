"""A receiver of a sharded weight sync: :class:`ShardedReceiver` (``ShardedReceiver(src=[...])``: every rank of
the sender's mesh), into DTensors (``expect``) or slices (``want``).

``expect`` says the layout wanted: its plain tensors whole, its DTensor leaves as their local shard of the
receivers' own mesh (``Shard(1)`` for a column-parallel matrix, ``Replicate()`` for a bias); without it every
leaf whole. At construction the receiver reads every sender rank's layout, checks that the pieces they will
send fill what it wants exactly once, answers each, then holds one plain :class:`~cudarecv.WeightReceiver` per
sender rank that sends it something, shaped as those pieces.

Pieces land in place: each sender rank's messages are cut leaf by leaf, and a piece that is one contiguous block
of the wanted layout (a row block of a whole matrix or of a row-sharded one, a column block of a column-sharded
one cut along rows) is received straight into the spare one of this receiver's two buffers; only a piece that
lies strided there (columns of a whole matrix) lands in a staging buffer first and is copied once. Pieces a
sender rank on this machine offers in shared memory are copied once, from its snapshot into the spare buffer.

A version is published only once the pieces of that version from every sender rank have landed and passed
their checks: then the spare buffer becomes :attr:`td`. In latest mode each rank answers with its newest version,
so a pull asks in rounds until the ranks agree (:mod:`~cudarecv.weights.sharded.lineup`: also when this receiver
is slower than a trainer step). A sender rank that fails or stalls makes the pull raise naming its rank, and
nothing is published; a pull returns within its timeout (``WaitTimeout``, the pull going on, if the ranks did not
all send one version by then).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from tensordict import TensorDict

from ...core import streams
from ...core.checks import check_timeout
from ...core.driver import Driver
from ...core.errors import ArgumentError, BrokenError, Error, SchemaError, UsageError, WaitTimeout
from ...core.transfer import Transfer
from ...plan.boxes import Box
from ...wire.staging import lane_for, release_pair
from ..handshake import expected
from ..options import TransportPolicy, check_receiver
from ..receiver import WeightReceiver
from ..schema import Schema
from ..slots import Slot, load_into
from . import exchange
from .buffers import Buffers
from .layout import (
    Layout,
    check_want,
    dtensor_type,
    in_order,
    narrowed,
    pieces,
    receiver_layout,
    uncovered,
    wanting_all,
)
from .lineup import Lineup

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from typing_extensions import Self

    from ...core.protocol import Protocol


class ShardedReceiver:
    """A receiver of a :class:`~cudarecv.ShardedSender` (see the module docstring): one plain
    :class:`~cudarecv.WeightReceiver` per sender rank that sends it pieces, put together in buffers of its own.

    Args:
        src: every rank of the sender's mesh (global ranks; a list). Exclusive with ``group_src``.

    Keyword Args:
        group, group_src: the process group, and the sender's ranks in it (a list).
        device, pin_memory, timeout, stream, transport: as :class:`~cudarecv.WeightReceiver`'s.
        expect: the layout wanted: plain tensors whole, DTensor leaves as their local shard of this receiver's
            mesh (without it: every leaf whole).
        zero_copy: False (the pieces are put together in this receiver's own buffers).
        want: slices of named leaves, the rest whole (``{"w": (slice(0, 512),)}``: rows 0-511 of ``w``).

    Example:
        >>> tp = init_device_mesh("cpu", (2,))     # receivers 2 and 3: a tensor-parallel pair
        >>> expect = TensorDict({"w": distribute_tensor(torch.empty(64, 32), tp, [Shard(1)])}, [])
        >>> receiver = cudarecv.ShardedReceiver(src=[0, 1], expect=expect)   # trainer ranks 0 and 1 (FSDP2)
        >>> receiver.pull(); receiver.td["w"].to_local()                     # this rank's 64 x 16 columns
    """

    def __init__(
        self,
        src: int | list[int] | None = None,
        *,
        group: Any = None,
        group_src: int | list[int] | None = None,
        device: Any = None,
        pin_memory: bool = False,
        expect: Any = None,
        timeout: float = 60.0,
        stream: Any = None,
        transport: TransportPolicy = "auto",
        zero_copy: bool = False,
        want: dict[str, tuple[slice, ...]] | None = None,
    ) -> None:
        self._closed, self._inner = False, []
        self.timeout, device = check_receiver(timeout, transport, zero_copy, device, pin_memory)
        if zero_copy:
            raise ArgumentError(
                "`zero_copy=True` publishes one sender's snapshot where it lies; a receiver of "
                "pieces (`src` a list, `want`, or DTensors in `expect`) puts them together in buffers "
                "of its own: drop `zero_copy`"
            )
        bad_want = _form_of(
            want
        )  # before anything is sent; the sender ranks are told (below), as they wait for it
        self._device = device
        #: leaf index -> the expected DTensor (its mesh and placements)
        self._dtensors: dict[int, DTensor] = {}
        self._moved: dict[int, list[tuple[int, Box]]] = {}
        try:
            peers, links, global_ranks = exchange.peer_links(
                src, group_src, group, "src", "group_src"
            )
            lanes = [
                lane_for(link, device, stream, streams.StagingPool(), peers_at_once=True)
                for link in links
            ]
            try:
                #: the layout this receiver holds: each leaf's whole shape and the box wanted of it
                layouts, self.layout = exchange.answer(
                    lanes,
                    self.timeout,
                    lambda found: self._want(found, expect, want, peers, bad_want),
                )
            # the exchange's ends let go of their pair groups (NCCL), as the senders' do
            except BaseException:
                for lane in lanes:
                    release_pair(lane.wire)
                raise
        except Error as error:
            if (
                bad_want is not None and error is not bad_want
            ):  # (the caller's to fix first, whatever else failed)
                raise bad_want from error
            raise
        self._source = layouts[0]
        self._buffers = Buffers(self.layout, self._source, self._dtensors, device, pin_memory)
        self._slots = self._buffers.slots
        self._cond = self._slots.cond
        self._version = 0
        self._turn_lock = threading.Lock()
        self._pending: Transfer | None = None
        self._collected = (
            True  # whether a caller took the pending pull's outcome (not: its wait ran out)
        )
        self._lineup: Lineup | None = None  # the rounds of the pull under way
        self._round: dict[
            int, Transfer
        ] = {}  # its round's pulls started so far (index of the rank's receiver ->)
        self._driver = Driver(f"cudarecv-pull-{'-'.join(map(str, peers))}")
        # a sender rank on this machine: its pieces are read where they lie in its snapshot (zero-copy), and copied
        # once, into this receiver's own buffer
        options = dict(
            device=device,
            pin_memory=pin_memory,
            timeout=self.timeout,
            stream=stream,
            transport=transport,
            zero_copy=device.type == "cpu" and not pin_memory,
        )
        try:
            for peer in peers:
                moved = self._moved[peer]
                if not moved:
                    continue
                shapes = TensorDict(
                    {
                        self._source.parts[j].key: torch.empty(
                            box.sizes, dtype=self._source.parts[j].dtype, device="meta"
                        )
                        for j, box in moved
                    },
                    [],
                )
                where = {"src": peer} if global_ranks else {"group": group, "group_src": peer}
                receiver = PieceReceiver(
                    places=self._buffers.places(moved),
                    spare=self._slots.spare,
                    retire=self._buffers.retire,
                    **where,
                    expect=shapes,
                    **options,
                )
                self._inner.append((peer, moved, receiver))
        except BaseException:
            self.close()
            raise
        finally:  # the layout exchange's ends let go of their pair groups (NCCL): each receiver holds its own
            for lane in lanes:
                release_pair(lane.wire)
        #: the sender's mode, learnt in the handshakes: ``"sync"`` or ``"latest"``
        self.mode = self._inner[0][2].mode
        self.zero_copy = False

    def _want(
        self,
        layouts: list[Layout],
        expect: Any,
        want: Any,
        ranks: list[int],
        bad_want: Error | None,
    ) -> Layout:
        """What this receiver wants of the layouts of the sender ranks ``ranks`` (``want``: slices of named leaves);
        raises ``bad_want`` (what is wrong with ``want``'s form) first, then :class:`ArgumentError` if ``want`` does
        not fit the leaves, :class:`SchemaError` if the sender ranks disagree, ``expect`` does not match, or their
        pieces do not fill what it wants exactly once."""
        if bad_want is not None:
            raise bad_want
        first = layouts[0]
        for rank, layout in zip(ranks[1:], layouts[1:]):
            problem = first.difference(layout)
            if problem:
                raise SchemaError(
                    f"sender ranks {ranks[0]} and {rank} send different weights: {problem}"
                )
        if expect is None:
            wanted = wanting_all(first)
        else:
            keys, tensors = expected(expect)
            mine = receiver_layout(keys, tensors)
            problem = first.difference(mine)
            if problem:
                raise SchemaError(f"the sender's weights do not match `expect`: {problem}")
            wanted = in_order(mine, first)
            by_key = {tuple(map(str, k)): t for k, t in zip(keys, tensors)}
            DTensor = dtensor_type()
            self._dtensors = {
                i: t for i, p in enumerate(first.parts) if isinstance(t := by_key[p.key], DTensor)
            }
        if want is not None:
            wanted = narrowed(wanted, want, set(self._dtensors))
        self._moved = {rank: pieces(layout, wanted) for rank, layout in zip(ranks, layouts)}
        problem = uncovered(wanted, self._moved)
        if problem:
            raise SchemaError(problem)
        if not any(self._moved.values()):
            raise SchemaError(
                "this receiver wants no element of any leaf (every shard of `expect` here is empty)"
            )
        return wanted

    # -- reading -----------------------------------------------------------------------------------------
    version = property(lambda self: self._version, doc="The version published (0: none yet).")
    buffer_count = property(
        lambda self: 2, doc="Two buffers of the wanted layout, published in turn."
    )
    arriving = property(
        lambda self: (
            self._pending is not None
            and not self._pending.settled
            and self._pending.timeout != math.inf
        ),
        doc="Whether a pull is under way and its version has begun to arrive (its own clock runs).",
    )

    @property
    def transport(self) -> str:
        """What carries the pieces: one of ``"shared memory"``, ``"cuda ipc"``, ``"wire"``, or several,
        comma-separated, when sender ranks differ (see :attr:`transports`)."""
        return ", ".join(sorted({r.transport for _, _, r in self._inner}))

    @property
    def transports(self) -> dict[int, str]:
        """Sender rank -> what carries its pieces."""
        return {rank: r.transport for rank, _, r in self._inner}

    @property
    def staged_bytes(self) -> int:
        """Bytes held besides the two buffers of the wanted layout: staging for the pieces that lie strided there
        (0 where every piece lands in place, e.g. an FSDP2 trainer's row shards into whole or tensor-parallel
        weights), and the own storage of a sender rank's receiver that cannot land in place (after a relay
        forward of its failed)."""
        return sum(slot.storage.numel() for _, _, r in self._inner for slot in r._slots.own)

    @property
    def plan(self) -> dict[int, list[tuple[str, Box]]]:
        """Sender rank -> the pieces it sends here: (leaf name, :class:`~cudarecv.plan.boxes.Box` of the whole leaf)."""
        return {
            rank: [(self._source.parts[i].name, box) for i, box in moved]
            for rank, moved in self._moved.items()
        }

    @property
    def td(self) -> TensorDict:
        """The latest version whole, in the wanted layout (DTensors where ``expect`` had them)."""
        return self._slots.td()

    def reading(self) -> contextlib.AbstractContextManager[TensorDict]:
        """Hold the latest version while reading it (see :meth:`WeightReceiver.reading`)."""
        return self._slots.reading()

    def load_into(self, module: torch.nn.Module, strict: bool = True) -> int:
        """Copy the latest version into ``module`` in place: each DTensor parameter's local shard from the
        leaf placed alike (never a collective); returns the version copied."""
        with self.reading() as td:
            load_into(td, module, strict)
            return self._version

    # -- pulling -----------------------------------------------------------------------------------------
    @overload
    def pull(self, wait: Literal[True] = ..., timeout: float | None = ...) -> int: ...
    @overload
    def pull(self, wait: bool, timeout: float | None = ...) -> int | Transfer: ...
    def pull(self, wait: bool = True, timeout: float | None = None) -> int | Transfer:
        """Receive a version newer than the one held from every sender rank; publish it once every piece landed
        (see :meth:`WeightReceiver.pull`). Raises what a sender rank's pieces raised, naming its rank; nothing is
        published then.

        ``timeout`` bounds the whole call: it returns the version, or raises :class:`WaitTimeout` when the sender
        ranks have not all sent one version within it (a stalled rank, or, in latest mode, trainers that move on
        faster than this receiver takes their pieces: :mod:`~cudarecv.weights.sharded.lineup` says how it asks the
        ranks until they agree). The pull goes on: the next ``pull()`` carries on with it, and
        returns its version at once if it was published meanwhile."""
        if self._closed:
            raise UsageError("this WeightReceiver is closed")
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        deadline = time.monotonic() + timeout
        if not self._turn_lock.acquire(timeout=timeout):
            raise WaitTimeout(
                f"another thread's pull held this WeightReceiver for {timeout:g} s (pulls from several "
                "threads take turns)"
            )
        try:
            transfer = self._pending
            if transfer is None or (transfer.settled and self._collected):
                transfer = self._pending = Transfer(
                    self._pulling(timeout),
                    timeout=math.inf,
                    driver=self._driver.submit,
                    raise_first=False,
                    what=f"pull from ranks {self._ranks()}",
                )
            self._collected = not wait  # (wait=False: the caller holds the future)
            if not wait:
                return transfer
            try:
                version = transfer.wait(max(deadline - time.monotonic(), 0.0))
            except WaitTimeout:
                raise WaitTimeout(
                    self._late(timeout)
                ) from None  # (not collected: the next pull carries on with it)
            except BaseException:
                self._collected = True
                raise
            self._collected = True
            return version
        finally:
            self._turn_lock.release()

    def _ranks(self) -> list[int]:
        return [rank for rank, _, _ in self._inner]

    def _late(self, timeout: float) -> str:
        """Why a pull ran out of ``timeout`` s, for its :class:`WaitTimeout`: the ranks nothing came from, or what the
        round under way waits for."""
        lineup, published, goes_on = (
            self._lineup,
            self._version,
            "the pull goes on: the next pull() carries on with it",
        )
        silent = [rank for rank, _, r in self._inner if r.version <= published and not r.arriving]
        if lineup is None or (silent and lineup.phase == "first"):
            return (
                f"pull from ranks {self._ranks()}: from rank(s) {silent} no version newer than {published} began "
                f"to arrive within {timeout:g} s (are they still pushing?); {goes_on}"
            )
        held = {rank: r.version for rank, _, r in self._inner}
        floors, pulls = (
            lineup.floors,
            dict(self._round),
        )  # (the round's asks, and its pulls started so far)
        waiting = [
            self._inner[i][0] for i in sorted(floors) if i not in pulls or not pulls[i].settled
        ]
        goal = min(floors.values(), default=published) + 1
        why = {
            "first": "the first round",
            "catch up": "the rank(s) behind, for the newest version another rank sent",
            "fresh": "every rank again at one moment, as the trainers push faster than this receiver takes a "
            "round",
        }[lineup.phase]
        return (
            f"pull from ranks {self._ranks()}: the sender ranks did not all send one version within {timeout:g} s "
            f"(the version of each rank's pieces: {held}; round {lineup.rounds} asks {why}, for version {goal} "
            f"or newer, and waits for rank(s) {waiting}); {goes_on}"
        )

    def _pulling(self, timeout: float) -> Protocol:
        """The pull's protocol: rounds of pulls from the sender ranks, as :class:`Lineup` says (the first from every
        rank, then from the ranks behind, then from every rank at one moment again), until all hold one version
        newer than the published (each landing its pieces in the spare buffer); then copy what did
        not land in place and publish."""
        index = (
            self._slots.spare()
        )  # (constant until this pull publishes: the buffer every piece lands in)
        self._slots.wait_unread(index, timeout)
        # a piece's own clock, once its version arrives: the receiver's timeout at least, since the caller's (say
        # 1 s) may be shorter than a version takes, and the pull goes on past the caller's wait
        clock = max(timeout, self.timeout)
        receivers = [r for _, _, r in self._inner]
        lineup = self._lineup = Lineup(
            self._version,
            latest=self.mode == "latest",
            retake={i for i, r in enumerate(receivers) if not r.zero_copy},
        )
        asks = lineup.first([r.version for r in receivers])
        while asks:
            self._round = {}
            for (
                i,
                floor,
            ) in asks.items():  # (each asks on its own thread: the ranks are asked at one moment)
                self._round[i] = receivers[i].pull_above(floor, clock)
            pulls = list(self._round.values())
            yield [t.ended() for t in pulls]
            for t in pulls:
                t.wait()  # raises a sender rank's failure, naming it
            asks = lineup.next([r.version for r in receivers])
        versions = [r.version for r in receivers]
        version = versions[0]
        slot, views = (
            self._slots.own[index],
            self._buffers.views[index],
        )  # (a new one if a rank's receiver retired it)
        # What did not land in place is copied on this receiver's stream, after what each rank's pull queued on its
        # own (stream waits: never torch.cuda.synchronize, which waits for every stream of the device, the caller's
        # unrelated work too, nor the default stream); the version is published once the copies ran (the host waits
        # for that stream's event; the caller's wait keeps the pull's time). Host memory: the ranks' pulls ended
        # with their bytes in, and the copies are the host's.
        stream = self._copy_stream()
        # (each rank's version held until the copies out of it ran)
        with contextlib.ExitStack() as held:
            tds = [held.enter_context(receiver.reading()) for _, _, receiver in self._inner]
            if stream is not None:
                for _, _, receiver in self._inner:
                    pulled = receiver._lane.stream
                    if pulled is not None and pulled != stream:
                        stream.wait_stream(pulled)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for (_, moved, _), td in zip(self._inner, tds):
                    for leaf, box in moved:
                        part = self.layout.parts[leaf]
                        place, piece = views[leaf][box.within(part.known_box)], td[part.key]
                        if (
                            piece.data_ptr() != place.data_ptr() or piece.numel() != place.numel()
                        ):  # (not landed in place)
                            place.copy_(piece, non_blocking=True)
            if stream is not None:
                yield [streams.EventWork(streams.record(stream))]
        self._slots.publish(slot, version)
        self._version = version
        return version

    def _copy_stream(self) -> torch.cuda.Stream | None:
        """The stream this receiver's own copies into its GPU buffers run on: its lanes' (the ``stream`` given, or
        cudarecv's dedicated one of the device), where the ranks' pulls ran; None for host buffers."""
        if self._device.type != "cuda":
            return None
        lanes = [r._lane.stream for _, _, r in self._inner if r._lane.stream is not None]
        return lanes[0] if lanes else streams.dedicated_stream(self._device)

    # -- ending ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the receiver of every sender rank (each tells its sender rank). Idempotent; :attr:`td` stays
        readable."""
        if self._closed:
            return
        self._closed = True
        for _, _, receiver in self._inner:
            receiver.close()
        if hasattr(self, "_driver"):
            self._driver.stop(self.timeout)
        self._pending = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _form_of(want: Any) -> Error | None:
    """What is wrong with the form of ``want`` (:func:`~cudarecv.weights.sharded.layout.check_want`), or None."""
    if want is None:
        return None
    try:
        check_want(want)
    except Error as error:
        return error
    return None


class PieceReceiver(WeightReceiver):
    """A plain receiver of one sender rank's pieces, landing them where the sharded receiver's buffers want them:
    ``places[b]``: piece name -> its contiguous block of buffer ``b`` (None: strided there, staged); ``spare``:
    which buffer the next pull lands in (the sharded receiver's spare, never its published one)."""

    def __init__(
        self,
        *,
        places: list[dict[tuple[str, ...], torch.Tensor | None]],
        spare: Callable[[], int],
        retire: Callable[[int], None],
        **options: Any,
    ) -> None:
        self._places = places
        super().__init__(**options)
        self._slots.place(spare, retire)

    def _own_slots(
        self, schema: Schema, bucket_bytes: int, device: torch.device, pin_memory: bool
    ) -> list[Slot]:
        if (
            not schema.leafwise
        ):  # (a sender rank that cuts evenly: its version lands in own slots, copied out)
            return super()._own_slots(schema, bucket_bytes, device, pin_memory)
        return [
            Slot.placed_at(
                schema,
                bucket_bytes,
                device,
                pin_memory,
                [places[leaf.key] for leaf in schema.leaves],
            )
            for places in self._places
        ]

    def pull_above(self, floor: int, timeout: float) -> Transfer:
        """Start a pull, for a round of the sharded pull, of a version newer than ``floor`` (latest mode: past the
        version held, to wait for the one the other ranks hold, or just below it, to take it again if the sender
        has none newer; sync mode takes the next version pushed); ``timeout``: its clock once the version arrives."""
        if self._closed:
            raise UsageError("this WeightReceiver is closed")
        with self._turn(timeout):
            if self._puller.broken:
                raise BrokenError(
                    f"this WeightReceiver is broken ({self._puller.broken}): close it and connect a "
                    "new one"
                )
            transfer = self._pending
            if transfer is None or transfer.settled:  # (else: a pull left under way, carried on)
                transfer = self._pending = self._puller.start(timeout, floor)
            return transfer
