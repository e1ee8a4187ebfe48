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
