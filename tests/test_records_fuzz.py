"""Every parser of a message from a peer, fuzzed (hypothesis): for any byte string the only outcomes are the parsed
message or a cudarecv error (:class:`cudarecv.Error`), never another exception, and no allocation sized from what
the bytes say. Three kinds of input each: any bytes near the record's size; a valid record with bytes flipped, cut
or added; and a well-formed record (magic, CRC, length right) whose fields are anything, so each message's own
checks of its fields are what is tried. A hang is the suite's timeout (pytest-timeout).
"""

from __future__ import annotations

import json
import os
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudarecv
from cudarecv.core.records import Record, Table
from cudarecv.plan import header as fast
from cudarecv.samehost import cuda_ipc, records, shared_memory
from cudarecv.samehost.machine import machine_key
from cudarecv.weights import wire
from cudarecv.weights.schema import MAX_BYTES, MAX_SCHEMA_BYTES, Schema

settings.register_profile(
    "fuzz",
    # (derandomized: the same examples each run; CUDARECV_FUZZ_EXAMPLES=2000 or more for a deeper search)
    max_examples=int(os.environ.get("CUDARECV_FUZZ_EXAMPLES", "600")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
FUZZ = settings.get_profile("fuzz")
#: the most a parse may allocate beyond its input: a record is a few hundred bytes, a schema a few of its own size
ALLOCATION_ROOM = 1 << 20


def outcome(parse: Callable[[bytes], Any], raw: bytes) -> Any:
    """``parse(raw)``'s result or its cudarecv error, checking it allocated nothing sized from the input."""
    tracemalloc.start()
    try:
        return parse(raw)
    except cudarecv.Error as error:
        assert str(error), "a cudarecv error says what is wrong"
        return error
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < ALLOCATION_ROOM + 8 * len(raw), (
            f"parsing {len(raw)} bytes allocated {peak} bytes"
        )


_CODES = {
    "H": (0, 2**16 - 1),
    "I": (0, 2**32 - 1),
    "Q": (0, 2**64 - 1),
    "i": (-(2**31), 2**31 - 1),
    "q": (-(2**63), 2**63 - 1),
}


def field_values(fmt: str) -> st.SearchStrategy[tuple]:
    """Any values of a little-endian struct format's fields (``16s``: 16 bytes), with the edges likelier."""
    parts = []
    for count, code in _tuples(fmt):
        if code == "s":
            parts.append(st.binary(min_size=count, max_size=count))
        else:
            lo, hi = _CODES[code]
            edge = st.sampled_from(sorted({lo, hi, 0, 1, 2, 3, 4, 5, -1 if lo < 0 else hi - 1}))
            parts += [st.one_of(edge, st.integers(lo, hi))] * count
    return st.tuples(*parts)


def _tuples(fmt: str) -> list[tuple[int, str]]:
    """``(count, code)`` of each field of ``fmt`` (``16s`` is one field of 16 bytes; ``3I`` three fields)."""
    out, digits = [], ""
    for ch in fmt:
        if ch.isdigit():
            digits += ch
        else:
            out.append((int(digits or 1), ch))
            digits = ""
    return out


def mutated(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """A valid message with bytes flipped, cut short or added to."""

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        raw = bytearray(draw(valid))
        for _ in range(draw(st.integers(0, 4))):
            if raw:
                raw[draw(st.integers(0, len(raw) - 1))] ^= draw(st.integers(1, 255))
        cut = draw(st.integers(0, len(raw)))
        return bytes(raw[:cut] if draw(st.booleans()) else raw) + draw(st.binary(max_size=40))

    return build()


def inputs(size: int, valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=2 * size + 8), mutated(valid), valid)


def well_formed(record: Record) -> st.SearchStrategy[bytes]:
    """Records with the right magic, CRC and size whose fields are anything."""
    return field_values(record.fields.format[3:]).map(lambda values: record.pack(*values))


# -- the fast wire's header -------------------------------------------------------------------------------------
def test_fast_wire_header_fuzzed():
    good = fast.Header(
        fast.KIND_CHUNKS, 3, 4096, 1024, bytes(range(16)), fast.PayloadRoute.SEGMENT, 1, True, 7, 9
    )
    assert fast.Header.unpack(good.pack()) == good

    @FUZZ
    @given(inputs(fast.SIZE, st.one_of(st.just(good.pack()), well_formed(fast.RECORD))))
    def check(raw: bytes) -> None:
        got = outcome(fast.Header.unpack, raw)
        if isinstance(got, fast.Header):
            assert (
                got.pack() == raw[: fast.SIZE]
                and got.bucket_bytes > 0
                and fast.messages(got.total, got.bucket_bytes) <= fast.MAX_MESSAGES
            )
            assert (
                got.transport in set(fast.PayloadRoute)
                and got.segment < fast.ROUTE_SLOTS[got.transport]
            )
        else:
            assert isinstance(got, cudarecv.OutOfStepError)

    check()


# -- the same-host transport's records ----------------------------------------------------------------------------
def test_same_host_records_fuzzed():
    @FUZZ
    @given(
        inputs(
            records.BACK_SIZE,
            st.one_of(
                well_formed(records.BACK),
                st.just(records.back(records.Word.DONE, records.Status.OK, 5)),
            ),
        ),
        st.sampled_from(list(records.Word)),
        st.integers(0, 8),
    )
    def back(raw: bytes, word: records.Word, seq: int) -> None:
        got = outcome(lambda r: records.read_back(r, word, seq), raw)
        assert isinstance(got, (records.Status, cudarecv.OutOfStepError)), got

    back()

    @FUZZ
    @given(
        inputs(
            records.READY_SIZE,
            st.one_of(well_formed(records.READY), st.just(records.ready(5, 4096))),
        ),
        st.integers(0, 8),
        st.sampled_from([0, 4096, 2**40]),
    )
    def ready(raw: bytes, seq: int, total: int) -> None:
        got = outcome(lambda r: records.read_ready(r, seq, total), raw)
        assert got is None or isinstance(got, cudarecv.OutOfStepError), got
        if got is None:
            assert raw[: records.READY_SIZE] == records.ready(seq, total)

    ready()


# -- offers of segments: host memory, a shared storage, CUDA IPC ------------------------------------------------
def offers(table: Table, kind: int) -> st.SearchStrategy[bytes]:
    """Well-formed offers of ``table`` (this machine's key, so the entries' checks are reached) with any entries."""
    each = field_values(table.each.format[1:])
    return st.builds(
        lambda version, got, pid, entries: table.pack(
            version, got, machine_key(), pid, entries=entries
        ),
        st.sampled_from([1, 1, 1, 2]),
        st.sampled_from([kind, kind, kind, 1, 2, 3, 99]),
        st.sampled_from([os.getpid(), 1, 2**32 - 1]),
        st.lists(each, max_size=4),
    )


@pytest.mark.parametrize("kind", ["host", "storage", "cuda ipc"])
def test_offers_fuzzed(kind):
    table, code = {
        "host": (shared_memory.HOST_OFFER, shared_memory.HOST),
        "storage": (shared_memory.STORAGE_OFFER, shared_memory.STORAGE),
        "cuda ipc": (cuda_ipc.OFFER, cuda_ipc.KIND),
    }[kind]
    parse = {
        "host": lambda raw: shared_memory.map_offer(raw, 1 << 30),
        "storage": lambda raw: shared_memory.StorageMapping(raw, 1 << 30),
        # (no GPU here: the checks before a handle is opened are what a CPU machine can try)
        "cuda ipc": lambda raw: shared_memory.open_offer(
            raw, cuda_ipc.OFFER, cuda_ipc.KIND, 2, None, 1 << 30
        ),
    }[kind]

    @FUZZ
    @given(
        st.one_of(
            st.binary(max_size=table.size_of(3) + 8),
            mutated(offers(table, code)),
            offers(table, code),
        )
    )
    def check(raw: bytes) -> None:
        got = outcome(parse, raw)
        assert isinstance(got, (shared_memory.MappingError, tuple)), (
            got
        )  # (nothing fuzzed maps: no real segment)
        if isinstance(got, shared_memory.MappingError):
            assert isinstance(got, OSError) and got.link_usable
        else:
            assert kind == "cuda ipc"

    check()


# -- weight sync: the schema, the push header, asks, trailers, the handshake's answer and preamble ---------------
def _schema() -> Schema:
    return Schema.of([("a",), ("b", "c")], [torch.zeros(3, 4), torch.zeros(5, dtype=torch.int64)])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _one_value_replaced(draw: st.DrawFn, raw: bytes) -> bytes:
    """The JSON document ``raw`` with one of its values (at any depth) replaced by any JSON value."""
    doc = json.loads(raw)
    path, node = [], doc
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    if path:
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = draw(json_values)
    return json.dumps(doc, separators=(",", ":")).encode()


def test_weight_schema_fuzzed():
    good = _schema()
    assert Schema.from_json(good.to_json()) == good

    @FUZZ
    @given(
        st.one_of(
            st.binary(max_size=600),
            schema_docs(),
            mutated(st.just(good.to_json())),
            json_values.map(lambda v: json.dumps(v).encode()),
        )
    )
    def check(raw: bytes) -> None:
        got = outcome(Schema.from_json, raw)
        assert isinstance(got, (Schema, cudarecv.SchemaError)), got
        if isinstance(got, Schema):
            assert got.to_json() == raw and got.leaves

    check()


def _layout():
    from cudarecv.plan.boxes import Box
    from cudarecv.weights.sharded.layout import Layout, Part

    return Layout(
        (
            Part(("l0", "weight"), torch.float32, (7, 5), Box((4, 0), (3, 5))),
            Part(("l0", "bias"), torch.float32, (7,), None),
            Part(("scale",), torch.bfloat16, (), Box((), ())),
        )
    )


@st.composite
def layout_docs(draw: st.DrawFn) -> bytes:
    """The JSON of a valid sharded layout with one of its values (at any depth) replaced by any JSON value."""
    return _one_value_replaced(draw, _layout().to_json())


@st.composite
def schema_docs(draw: st.DrawFn) -> bytes:
    """The JSON of a valid schema with one of its values (at any depth) replaced by any JSON value."""
    return _one_value_replaced(draw, _schema().to_json())


def test_sharded_layout_fuzzed():
    """A sharded sync's layout (what a peer says it sends or wants): parsed and checked, or a SchemaError; a box
    parsed always lies inside its leaf and holds elements."""
    from cudarecv.weights.sharded.layout import Layout

    good = _layout()
    assert Layout.from_json(good.to_json()) == good

    @settings(FUZZ, max_examples=300)  # (a layout's checks are the schema's: fewer examples)
    @given(
        st.one_of(
            st.binary(max_size=600),
            layout_docs(),
            mutated(st.just(good.to_json())),
            json_values.map(lambda v: json.dumps(v).encode()),
        )
    )
    def check(raw: bytes) -> None:
        got = outcome(Layout.from_json, raw)
        assert isinstance(got, (Layout, cudarecv.SchemaError)), got
        if isinstance(got, Layout):
            for part in got.parts:
                if part.box is not None:
                    assert part.box.numel > 0 or not part.shape
                    assert all(
                        s >= 0 and s + n <= whole
                        for s, n, whole in zip(part.box.starts, part.box.sizes, part.shape)
                    )

    check()


def test_deep_json_is_a_schema_error():
    """Nested past Python's recursion limit: still a SchemaError (json raises RecursionError)."""
    with pytest.raises(cudarecv.SchemaError, match="malformed weight schema"):
        Schema.from_json(b"[" * 100_000 + b"]" * 100_000)


_HEADER = wire.PushHeader(4, 1024, 256, bytes(16), relayed=True, up=1, down=3)
PUSH_MESSAGES = {
    "push header": (wire.PushHeader.unpack, wire.HEADER, _HEADER.pack(), wire.PushHeader),
    "ask": (wire.read_ask, wire.ASK_RECORD, wire.ask_message(wire.GOT, 5, wire.LOST, 2), wire.Ask),
    "trailer": (wire.read_trailer, wire.TRAILER, wire.trailer_message(7, wire.BROKEN, 3), tuple),
}


@pytest.mark.parametrize("message", list(PUSH_MESSAGES))
def test_push_header_asks_and_trailers_fuzzed(message):
    parse, record, good, kind = PUSH_MESSAGES[message]
    assert isinstance(parse(good), kind) and record.pack(*record.unpack(good)) == good

    @FUZZ
    @given(inputs(record.size, st.one_of(st.just(good), well_formed(record))))
    def check(raw: bytes) -> None:
        got = outcome(parse, raw)
        assert isinstance(got, (kind, cudarecv.OutOfStepError)), got

    check()


def test_handshake_answer_and_preamble_fuzzed():
    @FUZZ
    @given(
        inputs(
            wire.STATUS_SIZE,
            st.builds(wire.status_message, st.integers(0, 255), st.text(max_size=300)),
        )
    )
    def answer(raw: bytes) -> None:
        got = outcome(wire.read_status, raw)
        assert isinstance(got, (tuple, cudarecv.OutOfStepError)), got
        if isinstance(got, tuple):
            assert (
                got[0] in (wire.ACCEPTED, wire.REFUSED, wire.FAILED)
                and len(got[1]) < wire.STATUS_SIZE
            )

    answer()

    def offer(raw: bytes) -> wire.Offer:
        got = wire.read_preamble(raw)
        wire.check_offer(
            got.length, got.bucket_bytes
        )  # what the receiver does before sizing anything from it
        return got

    good = wire.preamble(4000, 1 << 20, "latest", session=3, shared=160)
    assert offer(good) == wire.Offer(4000, 1 << 20, "latest", 3, 160)

    @FUZZ
    @given(inputs(wire.PREAMBLE_SIZE, st.one_of(st.just(good), well_formed(wire.PREAMBLE))))
    def preamble(raw: bytes) -> None:
        got = outcome(offer, raw)
        assert isinstance(got, (wire.Offer, cudarecv.OutOfStepError, cudarecv.SchemaError)), got
        if isinstance(got, wire.Offer):
            assert 0 < got.length <= MAX_SCHEMA_BYTES and 0 < got.bucket_bytes <= MAX_BYTES

    preamble()
