"""cudarecv.core.lifecycle: a state changes only by a move its table lists; the diagram is the table."""

from __future__ import annotations

import enum
import threading

import pytest

from cudarecv.core.lifecycle import IllegalMove, Lifecycle, mermaid


class Door(enum.Enum):
    SHUT = "shut"
    OPEN = "open"
    GONE = "gone"


MOVES = {Door.SHUT: {Door.OPEN, Door.GONE}, Door.OPEN: {Door.SHUT, Door.GONE}}


def test_a_listed_move_is_made_and_returns_the_state_left():
    door = Lifecycle("door", Door.SHUT, MOVES)
    assert door.move(Door.OPEN) is Door.SHUT
    assert door.state is Door.OPEN and door.allows(Door.GONE)


def test_a_move_the_table_does_not_list_is_refused_naming_both_states():
    door = Lifecycle("door 3", Door.SHUT, MOVES)
    door.move(Door.GONE)
    with pytest.raises(
        IllegalMove, match=r"door 3: no move from GONE to OPEN \(allowed: none, final\)"
    ):
        door.move(Door.OPEN)
    assert door.state is Door.GONE


def test_of_two_threads_racing_to_end_one_thing_exactly_one_moves():
    for _ in range(200):
        door = Lifecycle("door", Door.OPEN, MOVES)
        start, won = threading.Barrier(2, timeout=10), []

        def end(door: Lifecycle = door, start: threading.Barrier = start, won: list = won) -> None:
            start.wait()
            won.append(door.move_if(Door.GONE))

        threads = [threading.Thread(target=end) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(won) == [False, True]


def test_move_if_checks_the_state_it_moves_from():
    door = Lifecycle("door", Door.SHUT, MOVES)
    assert not door.move_if(Door.GONE, frm={Door.OPEN}) and door.state is Door.SHUT
    assert door.move_if(Door.GONE, frm={Door.SHUT}) and door.state is Door.GONE


def test_the_diagram_lists_every_move_and_the_final_states():
    assert mermaid(MOVES, Door.SHUT).splitlines() == [
        "[*] --> SHUT",
        "GONE --> [*]",
        "OPEN --> GONE",
        "OPEN --> SHUT",
        "SHUT --> GONE",
        "SHUT --> OPEN",
    ]


# -- the same-host channel (cudarecv.samehost.channels) --------------------------------------------------------

import pathlib  # noqa: E402
import re  # noqa: E402

import torch  # noqa: E402

from cudarecv.samehost import channels  # noqa: E402
from cudarecv.samehost.channels import ChannelState, RecvChannel, SendChannel  # noqa: E402

DESIGN = pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md"


def _channel_diagram(table: str) -> list[str]:
    """The lines of design.md's mermaid block marked ``%% cudarecv.samehost.channels.<table>``, less its header."""
    blocks = re.findall(r"```mermaid\n(.*?)```", DESIGN.read_text(), re.S)
    marker = f"%% cudarecv.samehost.channels.{table}"
    [block] = [b for b in blocks if marker in b.splitlines()[1]]
    lines = [line.strip() for line in block.splitlines()]
    assert lines[:2] == ["stateDiagram-v2", marker], lines[:2]
    return lines[2:]


@pytest.mark.parametrize("table", ["SEND_MOVES", "RECV_MOVES"])
def test_design_md_draws_the_channel_tables(table):
    assert (
        _channel_diagram(table) == mermaid(getattr(channels, table), channels.INITIAL).splitlines()
    )


def test_a_sending_channel_moves_only_as_its_table_lists():
    ch = SendChannel("host", torch.device("cpu"))
    with pytest.raises(IllegalMove, match=r"host channel's sender: no move from NEW to SHARED"):
        ch.move(ChannelState.SHARED)  # never shared before the receiver answered an offer
    assert ch.state is ChannelState.NEW
    for to in (ChannelState.OFFERED, ChannelState.SHARED, ChannelState.OFFERED, ChannelState.NEW):
        ch.move(to)  # offered, taken; re-offered, declined for now with nothing kept
    ch.leave()  # a failed transfer
    assert ch.state is ChannelState.WIRE and ch.segments == [] and ch.previous is None
    for to in ChannelState:  # final: the segments are never touched again
        with pytest.raises(IllegalMove, match="none, final"):
            ch.move(to)
    ch.leave()  # (a side's failure leaves every channel, some left already)
    assert ch.state is ChannelState.WIRE


def test_a_receiving_channel_is_never_offered_and_wire_is_final():
    ch = RecvChannel("device")
    with pytest.raises(IllegalMove, match="device channel's receiver: no move from NEW to OFFERED"):
        ch.move(ChannelState.OFFERED, [])
    ch.move(ChannelState.SHARED, ["a"])
    ch.move(ChannelState.SHARED, ["b"])  # a larger re-offer mapped: its mappings replace the old
    assert ch.mappings == ["b"]
    ch.move(ChannelState.WIRE, [])
    with pytest.raises(IllegalMove):
        ch.move(ChannelState.SHARED, ["c"])
    assert ch.state is ChannelState.WIRE and ch.mappings == []


def test_a_channels_state_is_set_nowhere_but_its_move():
    """No module of samehost assigns a state (``x.state = ...``, ``x.state, y = ...``) past the table, nor
    names one by the strings it once was."""
    package = pathlib.Path(channels.__file__).parent
    for path in sorted(package.glob("*.py")):
        text = path.read_text()
        assert not re.search(r"\.state\s*(?:,[^=\n]*)?=(?!=)", text), path.name
        if path.name != "channels.py":  # (the enum's values)
            assert not re.search(r"[\"'](new|offered|shared)[\"']", text), path.name
