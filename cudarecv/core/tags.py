"""The tag space: every range of tags cudarecv uses, in one place (int32: gloo takes 0 .. 2**31 - 1).

| range | what |
|:---|:---|
| ``init_tag .. init_tag + leaves - 1``, or pseudo-random tags below 10000 | the stock wire, what tensordict sends |
| ``HEADER_TAGS + init_tag`` (``init_tag < MAX_INIT_TAG``) | a fast-wire header (and a same-host offer after it) |
| ``PIECE_TAGS + init_tag`` | every fast-wire payload message of that transfer, matched in order |
| ``WEIGHTS + k``, k = 0..2 | weight-sync handshake: preamble, schema, status |
| ``WEIGHTS + 3`` | sharded weight sync: each pair's layouts, before its handshake |
| ``SESSIONS_BASE + 4 s + k``, k = 0..2, session s < ``SESSIONS`` | one weight-sync session: headers, payload, the receiver's words (k = 3: unused) |
| ``BACK_TAGS + k`` | same-host fast wire: the receiver's ANSWER to an offer and its DONEs (see :mod:`cudarecv.samehost.sides`) |
| ``RELAY_TAGS + 2 p + k``, k = 0..1, p < ``RELAY_PUSHES`` | a relay chain's hops, one push: payload, trailer (p from the session and version) |
| ``MAX_TAG`` | the exit hook's wait that closes a group's links (never sent) |

A header never shares a tag with a payload; fast-wire transfers with different ``init_tag`` share none
(on gloo, which matches by tag; NCCL ignores tags and matches in posting order). A stock transfer whose own
``init_tag`` reaches past ``HEADER_TAGS`` could collide with these; nothing else can.
"""

from __future__ import annotations

from .errors import ArgumentError

MAX_TAG = 2**31 - 1  # torch.distributed takes C ints as tags; gloo refuses negative ones

HEADER_TAGS = 1 << 30  # the header of a fast-wire transfer with init_tag t has tag HEADER_TAGS + t
PIECE_TAGS = HEADER_TAGS + (1 << 28)  # all its payload messages have tag PIECE_TAGS + t
MAX_INIT_TAG = 1 << 28  # so both ranges stay apart and below WEIGHTS

WEIGHTS = (1 << 30) + (1 << 29)  # weight-sync tags: past the fast wire's
TAG_PREAMBLE, TAG_SCHEMA, TAG_STATUS = (WEIGHTS + k for k in range(3))  # the handshake
TAG_LAYOUT = (
    WEIGHTS + 3
)  # sharded weight sync: what each end of a pair sends or wants, ahead of the handshake
SESSIONS = 1 << 26  # a sender's session: random, in the preamble; 4 tags each
SESSIONS_BASE = WEIGHTS + 64
BACK_TAGS = (
    SESSIONS_BASE + 4 * SESSIONS
)  # past every weight-sync tag: the same-host transports' words back
RELAY_TAGS = BACK_TAGS + (
    1 << 20
)  # past the words back: a relay chain's hops, each push its own two
RELAY_PUSHES = 1 << 26  # (so RELAY_TAGS + 2 * RELAY_PUSHES stays below MAX_TAG)


def check_init_tag(init_tag: int) -> None:
    """Fast-wire tags are ``HEADER_TAGS + init_tag`` and ``PIECE_TAGS + init_tag``."""
    if not 0 <= init_tag < MAX_INIT_TAG:
        raise ArgumentError(
            f"`init_tag={init_tag}` is out of range for the fast wire (bucket_bytes): "
            f"pass 0 <= init_tag < {MAX_INIT_TAG}"
        )


def header_tag(init_tag: int) -> int:
    """The tag of the fast-wire header of a transfer with ``init_tag``."""
    return HEADER_TAGS + init_tag


def piece_tag(init_tag: int) -> int:
    """The tag of every payload message of a fast-wire transfer with ``init_tag``."""
    return PIECE_TAGS + init_tag


def relay_tags(session: int, version: int) -> tuple[int, int]:
    """The payload and trailer tags of ``version``'s push on the hops of session ``session``'s relay chain: each
    push its own (on gloo, which matches by tag), so a receive a timed-out hop left posted never takes a later
    push's messages."""
    p = (session * 40503 + version) % RELAY_PUSHES
    return RELAY_TAGS + 2 * p, RELAY_TAGS + 2 * p + 1


def session_tags(session: int) -> tuple[int, int, int]:
    """The tags of weight-sync session ``session``: header, payload, ask."""
    base = SESSIONS_BASE + 4 * session
    return base, base + 1, base + 2
