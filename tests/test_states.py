"""cudarecv.core.lifecycle: a state changes only by a move its table lists; the diagram is the table."""

from __future__ import annotations

import contextlib
import enum
import importlib
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from cudarecv.core.lifecycle import IllegalMove, Lifecycle, mermaid
from cudarecv.samehost import channels
from cudarecv.samehost.channels import ChannelState, RecvChannel, SendChannel
from cudarecv.weights.inbox import Farewell
from cudarecv.weights.membership.elastic_receiver import Membership
from cudarecv.weights.relay import Passage, Relay
from cudarecv.weights.session import Member, Standing
from policies import policy, set_version
from rawwire import store, unique_key


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


# -- the lifecycles of weight sync, and their diagrams in docs/design.md ---------------------------------

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"

#: every lifecycle table docs/design.md draws (its block says ``%% <module>.<table>``), and its first state
LIFECYCLES = {
    "cudarecv.weights.session.MOVES": Standing.ENROLLED,
    "cudarecv.weights.membership.elastic_receiver.MOVES": Membership.JOINING,
    "cudarecv.weights.relay.MOVES": Passage.FORWARDING,
    "cudarecv.weights.inbox.MOVES": Farewell.OPEN,
}


def _diagrams() -> dict[str, str]:
    """docs/design.md's ``stateDiagram-v2`` blocks by the table their ``%%`` line names, each as its lines."""
    blocks = re.findall(r"```mermaid\nstateDiagram-v2\n(.*?)```", DESIGN.read_text(), re.S)
    found = {}
    for block in blocks:
        lines = [line.strip() for line in block.strip().splitlines()]
        assert lines[0].startswith("%% "), f"a state diagram names no table: {lines[:2]}"
        name = lines[0][3:].split()[0]
        assert name not in found, f"{name} is drawn twice"
        found[name] = "\n".join(lines[1:])
    return found


def test_every_lifecycle_in_design_md_is_drawn_from_its_table():
    diagrams = _diagrams()
    assert set(LIFECYCLES) <= set(diagrams), set(LIFECYCLES) - set(diagrams)
    for name, initial in LIFECYCLES.items():
        module, table = name.rsplit(".", 1)
        moves = getattr(importlib.import_module(module), table)
        assert diagrams[name] == mermaid(moves, initial), (
            f"docs/design.md's diagram of {name} is not its table: paste mermaid({table}, "
            f"{initial}) (cudarecv.core.lifecycle)"
        )


def _member(ident: int = 3) -> Member:
    """A sender's view of a receiver, with no link (its standing alone is under test)."""
    return Member(SimpleNamespace(link=SimpleNamespace(peer=ident)), "host", ident, 1234)


def test_a_receiver_that_closed_cannot_be_dropped_and_a_dropped_one_stays_failed():
    done = _member()
    for step in (Standing.SERVED, Standing.LEAVING, Standing.DONE):
        done.move(step)
    with pytest.raises(IllegalMove, match=r"receiver 3 .*: no move from DONE to DROPPED"):
        done.move(Standing.DROPPED, why="late")
    assert done.why == "closed by its receiver" and not done.failed and done.ended

    dropped = _member()
    dropped.move(Standing.SERVED)
    assert dropped.served and dropped.why is None
    assert dropped.move_if(Standing.DROPPED, why="its link died")
    # (a push's hook that failed too: named, the first failure kept)
    assert not dropped.move_if(Standing.DROPPED, why="again")
    assert dropped.move_if(Standing.NAMED, why="again")
    assert dropped.failed and not dropped.served and dropped.why == "its link died"
    with pytest.raises(IllegalMove, match="no move from NAMED to SERVED"):
        dropped.move(Standing.SERVED)


def test_a_receiver_let_go_of_at_the_senders_close_says_so_for_its_lane():
    member = _member()
    assert member.lane.link.peer == 3
    member.sending = SimpleNamespace(what="a push")  # (a stand-in for its last transfer)
    member.let_go()  # (the sender's close: the process group may go)
    assert member.sending is None
    with pytest.raises(
        cudarecv.UsageError, match=r"the weight sender closed: receiver 3 .* no link"
    ):
        _ = member.lane


def test_a_receiver_is_served_only_once_enrolled_and_closing_ones_take_no_failure():
    member = _member()
    assert not member.served and member.why is None
    with pytest.raises(IllegalMove, match="no move from ENROLLED to LEAVING"):
        member.move(Standing.LEAVING)
    member.move(Standing.SERVED)
    member.move(
        Standing.CLOSING
    )  # the sender said CLOSED: its BYE in answer may come with a dead link
    assert member.served and not member.move_if(Standing.DROPPED, why="its link closed")
    member.move(Standing.DONE)
    assert not member.served and not member.failed


def test_a_joined_receiver_waits_for_a_next_sender_only_once_it_lost_its_own():
    from cudarecv.weights.membership.elastic_receiver import MOVES

    joined = Lifecycle("receiver of 'policy'", Membership.JOINING, MOVES)
    joined.move(Membership.JOINED)
    with pytest.raises(IllegalMove, match="no move from JOINED to WAITING"):
        joined.move(Membership.WAITING)
    for step in (Membership.LOST, Membership.WAITING, Membership.ORPHANED, Membership.LOST):
        joined.move(step)
    joined.move(Membership.CLOSED)
    assert not joined.move_if(Membership.JOINED)  # (a join that ends after the close: let go of)


def test_a_push_through_a_hop_ends_once_and_the_first_end_says_the_trailer():
    relay = Relay(SimpleNamespace(stream=None), [], tag=1, trailer_tag=2, version=7)
    relay.end(broken=3)  # (the pull failed: rank 3 before it in the chain)
    relay.end()  # (a close racing it: too late)
    assert relay.passage.state is Passage.BROKEN
    with pytest.raises(IllegalMove, match="relay of version 7: no move from BROKEN to LANDED"):
        relay.passage.move(Passage.LANDED)


def test_a_receiver_says_bye_once_and_hears_no_release_it_did_not_ask_for():
    from cudarecv.weights.inbox import MOVES

    link = Lifecycle("the link to weight sender rank 0", Farewell.OPEN, MOVES)
    with pytest.raises(IllegalMove, match="no move from OPEN to RELEASED"):
        link.move(Farewell.RELEASED)
    assert link.move_if(Farewell.BYE_SAID, frm={Farewell.OPEN})
    assert not link.move_if(Farewell.BYE_SAID, frm={Farewell.OPEN})  # (once)
    link.move(Farewell.CLOSED)  # the sender's CLOSED crossed it
    with pytest.raises(IllegalMove, match="no move from CLOSED to RELEASED"):
        link.move(Farewell.RELEASED)


def last_words(rank, world, group, key):
    """Rank 1 leaves after version 1 (BYE, then the sender's RELEASED); rank 2 stays until the sender closes
    (CLOSED, then its BYE in answer). The sender reports each receiver's standing as it goes."""
    model = policy()
    signals = store()
    if rank == 0:
        sender = cudarecv.WeightSender(TensorDict.from_module(model), dst=[1, 2], timeout=30)
        set_version(model, 1)
        sender.push()
        first, second = sender._s.members
        seen = [first.standing.name, second.standing.name]
        signals.set(f"{key}_seen", "1")
        with sender._s.cond:
            assert sender._s.cond.wait_for(lambda: first.standing is Standing.DONE, timeout=30)
        seen += [first.standing.name, second.standing.name]
        sender.close()  # (its listeners joined: rank 2's BYE came)
        seen.append(second.standing.name)
        signals.set(key, "1")
        return seen, sender.dropped, sender.ranks
    receiver = cudarecv.WeightReceiver(src=0, expect=model, timeout=30)
    receiver.pull()
    if rank == 1:
        signals.wait([f"{key}_seen"])
        receiver.close()  # BYE
        return "left"
    signals.wait([key])  # (the sender's CLOSED was answered by this receiver's inbox)
    receiver.close()
    return "stayed"


def test_the_last_words_take_a_receiver_to_done_either_way():
    from cudarecv.testing.launch import Ranks

    ranks = Ranks(3, pg_timeout=30.0)
    try:
        (seen, dropped, served), left, stayed = ranks().run(
            last_words, args=(unique_key("last_words"),), timeout=120
        )
    finally:
        ranks.close()
    assert (left, stayed) == ("left", "stayed")
    # served both; rank 1 said BYE and was RELEASED; rank 2 was told CLOSED and answered BYE
    assert seen == ["SERVED", "SERVED", "DONE", "SERVED", "DONE"], seen
    assert dropped == {1: "closed by its receiver", 2: "closed by its receiver"} and served == []


@pytest.mark.timeout(300)
def test_a_joined_receiver_loses_its_sender_and_joins_the_next_one():
    """JOINING -> JOINED on the first sender of the name; it closes: LOST, then JOINED on the next; CLOSED."""
    import datetime

    from churn import WAIT, fork_process, master_store, store_client, trainer, weights

    name, seconds = unique_key("membership"), 8.0
    with master_store() as store:
        trainers = [fork_process(trainer, ("127.0.0.1", store.port, name, "latest", seconds))]
        receiver = None
        try:
            receiver = cudarecv.ElasticReceiver(
                store=store_client(store.port), name=name, expect=weights(), timeout=seconds
            )
            assert receiver.membership is Membership.JOINED and receiver.generation == 1
            held = receiver.pull()
            store.set(f"{name}/trainer/1/close", "1")
            trainers[0].join(WAIT)
            assert trainers[0].exitcode == 0, trainers[0].exitcode
            trainers.append(
                fork_process(trainer, ("127.0.0.1", store.port, name, "latest", seconds))
            )
            store.wait([f"{name}/trainer/2/version"], datetime.timedelta(seconds=WAIT))
            deadline = time.monotonic() + WAIT
            while receiver.generation != 2:  # (the first pulls may still find the first's versions)
                assert time.monotonic() < deadline, receiver.membership
                with contextlib.suppress(cudarecv.WaitTimeout):
                    held = max(held, receiver.pull())
            assert receiver.membership is Membership.JOINED and receiver.pull() > held
        finally:
            if receiver is not None:
                receiver.close()
            store.set(f"{name}/trainer/2/close", "1")
            for process in trainers:
                process.join(WAIT)
                process.kill()
    assert receiver.membership is Membership.CLOSED
    with pytest.raises(cudarecv.UsageError, match="is closed"):
        receiver.pull()


# -- the same-host channel (cudarecv.samehost.channels) --------------------------------------------------------


@pytest.mark.parametrize("table", ["SEND_MOVES", "RECV_MOVES"])
def test_design_md_draws_the_channel_tables(table):
    name = f"cudarecv.samehost.channels.{table}"
    assert _diagrams()[name] == mermaid(getattr(channels, table), channels.INITIAL), name


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
    package = Path(channels.__file__).parent
    for path in sorted(package.glob("*.py")):
        text = path.read_text()
        assert not re.search(r"\.state\s*(?:,[^=\n]*)?=(?!=)", text), path.name
        if path.name != "channels.py":  # (the enum's values)
            assert not re.search(r"[\"'](new|offered|shared)[\"']", text), path.name
