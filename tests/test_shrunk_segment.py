"""A lying same-user writer that shrinks its segment under a reader's mapping (issue 32): the segment is
sealed against it, and a reader refuses an unsealed one, so the reader gets a clear error, never SIGBUS."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os

import pytest

from cudarecv.samehost import shared_memory as shm

WAIT = 30.0  # per pipe message (a spawned process's start under load)
CAPACITY = 1 << 20


def _get(conn, what: str):
    assert conn.poll(WAIT), f"no {what} within {WAIT} s"
    return conn.recv()


def lying_writer(conn, sealed: bool) -> None:
    """Offer a segment, then try to cut it to one page once the reader has it mapped; report what happened."""
    if sealed:
        segment = shm.Segment(CAPACITY)
        segment.data.fill_(7)
        fd, nonce = segment.fd, segment.nonce
    else:  # a writer that skips the seal (an older or lying cudarecv)
        fd, nonce = os.memfd_create("cudarecv", os.MFD_CLOEXEC), os.urandom(shm.NONCE)
        os.ftruncate(fd, shm._round_up(shm.DATA_OFFSET + CAPACITY))
        os.pwrite(fd, nonce, 0)
    conn.send((os.getpid(), fd, nonce))
    if _get(conn, "word from the reader") != "mapped":
        return
    try:
        os.ftruncate(fd, shm.PAGE)
        conn.send("shrunk")
    except OSError as error:
        conn.send(f"refused: {error.strerror}")
    _get(conn, "the reader's end")


def reader(conn, writer) -> None:
    """Map the writer's segment, let it shrink it, read every byte; report what happened."""
    pid, fd, nonce = _get(writer, "offer")
    try:
        mapping = shm.Mapping(pid, fd, CAPACITY, nonce)
    except shm.MappingError as error:
        writer.send("refused")
        conn.send(("refused", str(error)))
        return
    writer.send("mapped")
    shrink = _get(writer, "the writer's shrink")
    total = int(mapping.data.sum())  # SIGBUS here if the file was cut
    writer.send("done")
    conn.send((shrink, total))


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "unsealed"])
def test_a_writer_cannot_shrink_a_segment_under_its_reader(sealed):
    ctx = mp.get_context("spawn")
    to_writer, writer_end = ctx.Pipe()
    to_reader, reader_end = ctx.Pipe()
    procs = [
        ctx.Process(target=lying_writer, args=(writer_end, sealed)),
        ctx.Process(target=reader, args=(reader_end, to_writer)),
    ]
    for p in procs:
        p.start()
    try:  # (the reader's end, not only its message: a reader killed by SIGBUS sends none)
        # (the whole exchange: two spawned processes' starts, each importing torch, on a loaded machine)
        mp.connection.wait([to_reader, procs[1].sentinel], 4 * WAIT)
        outcome = to_reader.recv() if to_reader.poll() else None
    finally:
        for p in procs:
            p.join(WAIT)
            if p.exitcode is None:
                p.kill()
                p.join(WAIT)
    assert [p.exitcode for p in procs] == [0, 0], [p.exitcode for p in procs]  # -7: SIGBUS
    assert outcome is not None, f"the reader said nothing within {4 * WAIT:g} s"
    if sealed:
        assert outcome == ("refused: Operation not permitted", 7 * CAPACITY), outcome
    else:
        assert outcome[0] == "refused" and "not sealed against shrinking" in outcome[1], outcome
