"""``python -m cudarecv demo`` (cudarecv/tools/demo.py): ``--quick`` smoke tests in a subprocess, and its
option errors."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cudarecv.testing import hosts
from cudarecv.tools import cli, demo
from procs import HANG

ROOT = Path(__file__).resolve().parents[1]
QUICK_VERSIONS = 41  # --quick: 40 steps, one push each, after the initial weights


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _demo(*args: str, timeout: float = HANG) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cudarecv", "demo", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _tables(stdout: str) -> list[list[dict[str, str]]]:
    """The printed tables (the trainer's, then the actors'), each as rows of cells keyed by column."""
    tables: list[list[dict[str, str]]] = []
    columns: list[str] = []
    for line in stdout.splitlines():
        if line.startswith("# impl"):
            columns = re.split(r"\s{2,}", line[2:].strip())
            tables.append([])
        elif line.strip() and not line.startswith("#"):
            assert columns, f"table row before its header: {line!r}"
            cells = re.split(r"\s{2,}", line.strip())
            assert len(cells) == len(columns), f"row {line!r} does not match columns {columns}"
            tables[-1].append(dict(zip(columns, cells)))
    return tables


def _check_run(
    proc: subprocess.CompletedProcess, actors: int, checksums: str, mode: str = "sync"
) -> list[list[dict[str, str]]]:
    out = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, out
    trainers, rows = _tables(proc.stdout)
    assert [t["impl"] for t in trainers] == [f"cudarecv {mode}", "stock"], out
    stock = float(
        trainers[1]["steps/s"]
    )  # side by side: cudarecv's steps/s over stock's, same run, same size
    assert trainers[1]["vs stock"] == "1.00x", out
    # the ratio is of unrounded rates, the table's steps/s rounded to 0.1: stock's 4.4 may be 4.35 or 4.45
    ratio, ours = float(trainers[0]["vs stock"].removesuffix("x")), float(trainers[0]["steps/s"])
    assert (
        (ours - 0.05) / (stock + 0.05) - 0.01 <= ratio <= (ours + 0.05) / (stock - 0.05) + 0.01
    ), out
    for trainer in (
        trainers
    ):  # the task is seeded, and the trainer's batches are its own: it learns every time
        assert float(trainer["reward last"]) > float(trainer["reward first"]), out
        assert float(trainer["steps/s"]) > 0 and float(trainer["push p99"]) >= float(
            trainer["push p50"]
        ), out
    for impl in (f"cudarecv {mode}", "stock"):
        mine = [row for row in rows if row["impl"] == impl]
        assert [row["actor"].rstrip("*") for row in mine] == [
            str(r) for r in range(1, actors + 1)
        ], out
        for row in mine:
            assert row["check"] == "ok", out
            assert row["checksum"] == (checksums if impl != "stock" else "-"), out
            # (each cell is over both passes of its implementation: demo.PASSES)
            if mode == "sync" or impl == "stock":
                assert int(row["pulls"]) == 2 * QUICK_VERSIONS, out  # every version, each pass
                # one episode per version held, the same work as stock's (whose version 0 came with init_remote)
                assert int(row["episodes"]) == 2 * (QUICK_VERSIONS - (impl != "stock")), out
            else:
                assert 2 <= int(row["pulls"]) <= 2 * QUICK_VERSIONS, out  # the newest, when ready
            assert float(row["p99 ms"]) >= float(row["p50 ms"]) >= 0, out
            assert row["lag max"] == "-" or int(row["lag max"]) >= 0, out
    assert (
        f"# checks: every actor holds the trainer's final weights, version {QUICK_VERSIONS}"
        in proc.stdout
    )
    assert all(len(line) <= 100 for line in proc.stdout.splitlines()), out
    assert "trainer (cudarecv" in proc.stderr and "trainer (stock)" in proc.stderr, (
        out
    )  # the progress bars
    return [trainers, rows]


def test_demo_quick_verified_three_actors() -> None:
    _check_run(
        _demo("--quick", "--verify", "--actors", "3"),
        actors=3,
        checksums=f"{2 * QUICK_VERSIONS}/{2 * QUICK_VERSIONS}",  # (both passes)
    )


def test_demo_latest_mode_with_a_slow_actor() -> None:
    """The slow actor takes few versions in latest mode, and every one of them in lockstep (stock)."""
    proc = _demo("--quick", "--mode", "latest", "--slow-actor", "2", "--slow-seconds", "0.1")
    _, rows = _check_run(proc, actors=2, checksums="off", mode="latest")
    slow = {row["impl"]: row for row in rows if row["actor"] == "2*"}
    assert set(slow) == {"cudarecv latest", "stock"}, rows
    assert int(slow["stock"]["pulls"]) == 2 * QUICK_VERSIONS  # (both passes)


def test_demo_dead_actor_ends_the_run() -> None:
    proc = _demo("--quick", "--actors", "1", "--kill-actor", "1", "--timeout", "20")
    out = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 1, out
    assert "cudarecv demo: error: " in proc.stderr, out
    assert "actor rank 1" in proc.stderr or "rank 1 died" in proc.stderr, out
    assert not any(
        raw in proc.stderr for raw in ("pair.cc", "GLHF", "Connection closed by peer")
    ), out
    assert not _tables(proc.stdout), out


@pytest.mark.long  # (simulated hosts: namespaces and torchrun, 20-30 s; the long runs build hosts too)
@pytest.mark.skipif(
    hosts.unavailable() is not None, reason=f"simulated hosts: {hosts.unavailable()}"
)
@pytest.mark.timeout(300)
def test_demo_across_simulated_hosts() -> None:
    """--hosts 3 --delta: the same run under torchrun on three simulated hosts; cudarecv relays (auto fan-out),
    sending the version once down the chain (half of what stock sends the two actors: Adam moves every float32
    weight, so no patch is smaller than the version)."""
    proc = _demo("--quick", "--hosts", "3", "--delta")
    trainers, _ = _check_run(proc, actors=2, checksums="off")
    assert "# ranks: 3 simulated hosts (1gbit links), launched with torchrun" in proc.stdout, (
        proc.stdout
    )
    assert "fan-out relay" in proc.stdout, proc.stdout
    assert [t["sent"] for t in trainers] == ["50%", "100%"], proc.stdout


def _reader(
    stream: Any,
    into: list[str],
    seen: threading.Event | None = None,
    pattern: re.Pattern | None = None,
) -> threading.Thread:
    """A thread that keeps what ``stream`` says until its EOF, and sets ``seen`` once ``pattern`` appears."""

    def read() -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            into.append(chunk.decode(errors="replace"))
            if seen is not None and pattern.search("".join(into)):
                seen.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _rank_pids(demo_pid: int) -> list[int]:
    """Every process on the simulated hosts of the demo ``demo_pid`` (torchrun and its workers)."""
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True
    ).stdout
    names = [
        line.split()[0]
        for line in listed.splitlines()
        if line.startswith(f"{hosts.PREFIX}{demo_pid}x")
    ]
    return [
        int(pid)
        for name in names
        for pid in subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True, check=True
        ).stdout.split()
    ]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _interruptible() -> None:
    """In the demo's child before exec: Ctrl-C's default action, as a terminal's foreground job has it. A
    suite started in the background of a non-interactive shell (``pytest &``, ``nohup``) runs with SIGINT
    ignored, which every child inherits and Python keeps: the demo would rightly ignore the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.long  # (simulated hosts: namespaces and torchrun, 20-30 s; the long runs build hosts too)
@pytest.mark.skipif(
    hosts.unavailable() is not None, reason=f"simulated hosts: {hosts.unavailable()}"
)
@pytest.mark.timeout(600)
def test_ctrl_c_stops_every_rank_of_demo_hosts_quietly() -> None:
    """Ctrl-C (SIGINT to the demo's process group, as a terminal sends it) once the trainer has done a
    step: the demo returns 130, every process on every host is gone within seconds (the output pipes,
    which they all hold, reach EOF), and nothing traceback-like is printed."""
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cudarecv",
            "demo",
            "--hosts",
            "3",
            "--hidden",
            "64",
            "--steps",
            "100000",
        ],
        cwd=ROOT,
        env={**_env(), "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_interruptible,
    )
    out: list[str] = []
    err: list[str] = []
    stepped = threading.Event()
    readers = [
        _reader(demo.stdout, out),
        _reader(
            demo.stderr,
            err,
            stepped,
            re.compile(r"trainer \(cudarecv sync\):.*\| *[1-9]\d*/100000"),
        ),
    ]
    try:
        assert stepped.wait(240), f"no step within 240 s:\n{''.join(err)}"
        ranks = _rank_pids(demo.pid)
        assert len(ranks) >= 6, ranks  # torchrun and a worker on each of the 3 hosts
        os.killpg(demo.pid, signal.SIGINT)
        try:
            code = demo.wait(180)  # (1-2 s, also beside 4 busy processes)
        except (
            subprocess.TimeoutExpired
        ):  # say where it is stuck: faulthandler prints every thread on SIGABRT
            os.kill(demo.pid, signal.SIGABRT)
            demo.wait(30)
            for reader in readers:
                reader.join(10)
            raise AssertionError(
                "the demo did not end within 180 s of Ctrl-C; where its threads were:\n"
                + "".join(err)[-20000:]
            ) from None
        for reader in readers:
            reader.join(60)
        text = "".join(out) + "".join(err)
        assert not any(reader.is_alive() for reader in readers), (
            f"a process still holds the demo's output:\n{text}"
        )
        assert not [pid for pid in ranks if _alive(pid)], text
        assert code == 130, text
        assert "".join(err).endswith("\ncudarecv demo: error: interrupted\n"), (
            text
        )  # below the ranks' bar
        assert not re.search(r"Traceback|Error|terminate called|Aborted", text), text
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)


#: how soon after Ctrl-C the demo and every process of it are gone: 1-2 s at load 7 on 2 cores, 3.7 s at load 14
#: (the ranks are killed at once; the rest is the exit of the parent and of the ranks' zygote, both holding
#: torch); 10.4-10.6 s before, when each busy rank got 5 s to leave
CTRL_C_BOUND = 10.0


@pytest.mark.parametrize(
    "when, pattern",
    [
        (
            "starting",
            r"cudarecv demo: starting a trainer",
        ),  # the first line: the zygote, the ranks, their groups start
        (
            "connected",
            r"cudarecv demo: training with cudarecv sync",
        ),  # the ranks are up: the pass (handshake) begins
        (
            "training",
            r"trainer \(cudarecv sync\):.*[^\d][1-9]\d*/100000",
        ),  # the trainer has pushed a step (bar or line)
    ],
    ids=["starting", "connected", "training"],
)
def test_ctrl_c_stops_the_demo_at_once_in_one_line(when: str, pattern: str) -> None:
    """Ctrl-C (SIGINT to the demo's process group, as a terminal sends it) as soon as the demo says it got to
    ``when``: exit status 130 within :data:`CTRL_C_BOUND` s, every process of it gone by then (they all hold its
    output pipes, which reach EOF), and one line, ``cudarecv demo: error: interrupted``: no rank prints a
    traceback, whatever it was doing."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "cudarecv", "demo", "--steps", "100000", "--hidden", "16"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_interruptible,
    )
    out: list[str] = []
    err: list[str] = []
    reached = threading.Event()
    readers = [_reader(demo.stdout, out), _reader(demo.stderr, err, reached, re.compile(pattern))]
    try:
        assert reached.wait(HANG), (
            f"the demo did not get to {when!r} within {HANG:g} s:\n{''.join(err)}"
        )
        os.killpg(demo.pid, signal.SIGINT)
        interrupted = time.monotonic()
        code = demo.wait(HANG)
        for reader in readers:
            reader.join(max(CTRL_C_BOUND - (time.monotonic() - interrupted), 0.1))
        took = time.monotonic() - interrupted
        text = "".join(out) + "".join(err)
        assert not any(reader.is_alive() for reader in readers), (
            f"a process still holds the demo's output:\n{text}"
        )
        assert code == 130, text
        assert took < CTRL_C_BOUND, f"{took:.1f} s after Ctrl-C:\n{text}"
        assert "".join(out) == "", text  # no tables
        assert "".join(err).endswith("cudarecv demo: error: interrupted\n"), text
        assert not re.search(r"Traceback|Error|Exception|terminate called|Aborted", text), text
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)


def _table_config(steps: int) -> demo.Config:
    """A one-actor CPU config for the table tests (no rank runs it)."""
    return demo.Config(
        actors=1,
        steps=steps,
        hidden=8,
        device="cpu",
        backend="gloo",
        bucket_bytes=None,
        verify=False,
        timeout=10.0,
        seed=0,
        threads=1,
    )


def test_the_trainer_table_puts_sync_and_stock_side_by_side() -> None:
    """steps/s of each run and its ratio to stock's, both timed to every actor holding the last version."""
    cfg = _table_config(steps=100)
    trainers = [
        dict(
            impl=impl,
            seconds=seconds,
            pushes=[0.001, 0.002],
            rewards=[0.1, 0.9],
            versions=101,
            bytes=1024,
            digest="d",
        )
        for impl, seconds in (("cudarecv", 4.0), ("stock", 5.0))
    ]
    actors = [
        dict(
            impl=t["impl"],
            rank=1,
            pulls=101,
            latencies=[0.001],
            lags=[0],
            rewards=[0.5],
            verified=0,
            bad=0,
            version=101,
            digest="d",
        )
        for t in trainers
    ]
    rows = _tables(demo.report_text(cfg, trainers, actors))[0]
    assert [(r["impl"], r["steps/s"], r["vs stock"]) for r in rows] == [
        ("cudarecv sync", "25.0", "1.25x"),
        ("stock", "20.0", "1.00x"),
    ], rows


def test_simulated_hosts_need_root() -> None:
    """As an unprivileged user (a real one, via setpriv), namespaces are refused with the reason."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as another user")

    def as_nobody(code: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                "setpriv",
                "--reuid",
                "65534",
                "--regid",
                "65534",
                "--clear-groups",
                sys.executable,
                "-c",
                code,
            ],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    if (
        as_nobody("import cudarecv").returncode != 0
    ):  # e.g. a checkout under a mktemp -d (mode 0700)
        pytest.skip(f"an unprivileged user cannot read this checkout ({ROOT})")
    done = as_nobody("from cudarecv.testing.hosts import unavailable; print(unavailable())")
    assert done.returncode == 0, done.stderr
    assert "need root or CAP_NET_ADMIN" in done.stdout, done.stdout


def test_demo_bad_option() -> None:
    """The real command line: exit status 2 and the one error line, naming the flag."""
    proc = _demo("--actors", "0")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "cudarecv demo: error: argument --actors: must be >= 1, got 0"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--bucket-bytes", "abc"],
            "argument --bucket-bytes: not a size: 'abc'; write it like 1MiB, 256KiB or 4096",
        ),
        (
            ["--bucket-bytes", "1.5MiB"],
            "argument --bucket-bytes: not a size: '1.5MiB'; write it like 1MiB, 256KiB or 4096",
        ),
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--hidden", "-3"], "argument --hidden: must be >= 1, got -3"),
        (["--model-mib", "0"], "argument --model-mib: must be a number > 0, got '0'"),
        (["--model-mib", "nan"], "argument --model-mib: must be a number > 0, got 'nan'"),
        (["--timeout", "soon"], "argument --timeout: not a number: 'soon'"),
        (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
        (
            ["--device", "tpu"],
            "argument --device: invalid choice: 'tpu' (choose from ",
        ),  # quoting: Python's
        (
            ["--hidden", "8", "--model-mib", "1"],
            "argument --model-mib: not allowed with argument --hidden",
        ),
        (
            ["--actors", "2", "--kill-actor", "3"],
            "argument --kill-actor: must be an actor's rank, 1..2 (--actors 2), got 3",
        ),
        (
            ["--slow-actor", "0"],
            "argument --slow-actor: must be an actor's rank, 1..2 (--actors 2), got 0",
        ),
        (["--mode", "async"], "argument --mode: invalid choice: 'async' (choose from "),
        (["--slow-seconds", "-1"], "argument --slow-seconds: must be a number > 0, got '-1'"),
        (["--quick", "extra"], "unrecognized arguments: extra"),
        (["--hosts", "1"], "argument --hosts: must be >= 2, got 1"),
        (
            ["--hosts", "3", "--actors", "3"],
            "argument --hosts: 3 actors and a trainer are 4 ranks, which 3 hosts cannot share evenly",
        ),
        (
            ["--hosts", "2", "--link", "fast"],
            "argument --link: not a link rate: 'fast'; write it as tc does, like 1gbit or 100mbit",
        ),
    ],
)
def test_demo_bad_option_names_its_flag(capsys, argv, message) -> None:
    """In this process: every bad option is refused before any rank starts."""
    try:
        code = cli.main(["demo", *argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    last = captured.err.strip().splitlines()[-1]
    assert (
        last == f"cudarecv demo: error: {message}"
        or message.endswith("(choose from ")
        and last.startswith(f"cudarecv demo: error: {message}")
    ), captured.err


@pytest.mark.skipif(
    torch.cuda.device_count() > 0, reason="a GPU is visible: --device cuda would run"
)
def test_demo_cuda_without_gpu(capsys) -> None:
    assert cli.main(["demo", "--device", "cuda"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "cudarecv demo: error: argument --device: cuda, but no CUDA device is visible: use --device cpu"
    )


def test_each_implementation_trains_twice_in_the_order_a_b_b_a_and_its_row_is_over_both() -> None:
    """A pass's place in the run changes its speed: both get the same places, and a row sums its passes; an actor
    that missed the trainer's weights in either pass fails its check."""
    assert demo.PASSES == ("cudarecv", "stock", "stock", "cudarecv")
    cfg = _table_config(steps=2)

    def ranks(impl: str, seconds: float, actor_digest: str) -> list[dict]:
        trainer = dict(
            impl=impl,
            seconds=seconds,
            pushes=[seconds / 10] * 3,
            rewards=[0.1, 0.9],
            versions=3,
            bytes=1024,
            digest="d",
        )
        actor = dict(
            impl=impl,
            rank=1,
            pulls=3,
            latencies=[0.001],
            lags=[0],
            rewards=[0.5],
            verified=0,
            bad=0,
            version=3,
            digest=actor_digest,
        )
        return [trainer, actor]

    # cudarecv 1 s then 3 s (4 s for 4 steps), stock 1 s and 1 s; stock's actor missed the weights in its 2nd pass
    trainers, actors = demo.combined(
        [
            ranks("cudarecv", 1.0, "d"),
            ranks("stock", 1.0, "d"),
            ranks("stock", 1.0, "x"),
            ranks("cudarecv", 3.0, "d"),
        ]
    )
    assert [(t["impl"], t["seconds"], t["steps"], len(t["pushes"])) for t in trainers] == [
        ("cudarecv", 4.0, 4, 6),
        ("stock", 2.0, 4, 6),
    ]
    trainer_rows, actor_rows = _tables(demo.report_text(cfg, trainers, actors))
    assert [(r["impl"], r["steps/s"], r["vs stock"]) for r in trainer_rows] == [
        ("cudarecv sync", "1.0", "0.50x"),
        ("stock", "2.0", "1.00x"),
    ], trainer_rows
    assert [(r["impl"], r["pulls"], r["check"]) for r in actor_rows] == [
        ("cudarecv sync", "6", "ok"),
        ("stock", "6", "FAIL: weights differ"),
    ], actor_rows
