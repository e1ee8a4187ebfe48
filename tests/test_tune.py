"""Host settings: nothing is measured in a transfer; ``python -m cudarecv tune`` measures and keeps a choice that
later processes read; environment variables override it; bad values are refused by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from tensordict import TensorDict

import cudarecv
from cudarecv.core import host_copy as _host_copy
from cudarecv.core import tuned as _tuned
from cudarecv.samehost import policy
from cudarecv.testing.launch import Cluster
from procs import HANG

ENVS = (_host_copy.ENV, _host_copy.DIRECT_ENV, "XDG_CACHE_HOME")
DEFAULT_STREAMS = _host_copy.DEFAULT_HOST_COPY == "stream"
with open("/proc/cpuinfo") as _f:
    AVX2 = " avx2 " in _f.read().replace("\n", " ")  # streaming is for AVX2 machines only


class _Spy:
    """``_host_copy._LIB`` that records each choice of streaming and each copy of 16 MiB or more (a probe's)."""

    def __init__(self, lib) -> None:
        self.lib, self.streaming, self.large = lib, [], []

    def cudarecv_copy_streaming(self, on):
        self.streaming.append(on)
        return self.lib.cudarecv_copy_streaming(on)

    def cudarecv_copy(self, dst, src, n):
        if n >= 16 << 20:
            self.large.append(n)
        return self.lib.cudarecv_copy(dst, src, n)

    def __getattr__(self, name):
        return getattr(self.lib, name)


def spied_transfers(rank, world, group):
    """Same-host transfers of large leaves (buckets, then a consolidated storage), with the native library and
    ``process_vm_readv`` spied on: what chose streaming, which processes were read, and what carried each."""
    lib, readv, read = _Spy(_host_copy._LIB), _host_copy._readv, []

    def spy_readv(pid, *args):
        read.append(pid)
        return readv(pid, *args)

    _host_copy._LIB, _host_copy._readv = lib, spy_readv
    try:
        seen, ok = [], True
        for consolidated in (False, True):
            td = TensorDict(
                a=torch.full((1 << 18,), float(rank)), b=torch.full((3 << 18,), float(rank))
            )
            if consolidated:
                td = td.consolidate(metadata=True)
            kw = dict(bucket_bytes=1 << 20, consolidated=consolidated, timeout=20.0)
            for _ in range(
                2
            ):  # the first negotiates the link (its payload on the wire), the second is in memory
                if rank == 0:
                    [t] = cudarecv.isend(td, dst=1, return_early=True, **kw)
                else:
                    [t] = cudarecv.irecv(td, src=0, return_premature=True, **kw)
                t.wait(timeout=20.0)
                seen.append(t.transport)
                ok = ok and bool((td["a"] == 0).all() and (td["b"] == 0).all())
        return {
            "streaming": lib.streaming,
            "large": lib.large,
            "read_self": os.getpid() in read,
            "transports": seen,
            "ok": ok,
            "chosen": (_host_copy.STREAMING, _host_copy.DIRECT_PAYS),
        }
    finally:
        _host_copy._LIB, _host_copy._readv = lib.lib, readv


@pytest.mark.skipif(not _host_copy.NATIVE, reason=_host_copy.WHY_NOT_NATIVE or "")
def test_no_probe_runs_in_a_transfer(tmp_path):
    """A process's first large host copy and first same-host offer measure nothing: streaming is set once, to
    the default, no copy of a probe's size runs, and no process reads its own memory."""
    with Cluster(2, pg_timeout=20.0, env={"XDG_CACHE_HOME": str(tmp_path)}) as ranks:
        results = ranks.run(spied_transfers)
    for rank, got in enumerate(results):
        assert got["transports"][1::2] == ["shared memory"] * 2, (rank, got["transports"])
        assert got["ok"], rank
        assert got["streaming"] == [DEFAULT_STREAMS], (
            rank,
            got["streaming"],
        )  # once, as the default says
        assert got["large"] == [] and not got["read_self"], (rank, got)
        assert got["chosen"][0] is (DEFAULT_STREAMS and AVX2)
    assert results[1]["chosen"][1] == _host_copy.DEFAULT_DIRECT_READ  # the receiver took an offer
    assert not (tmp_path / "cudarecv").exists()  # nothing tuned, nothing written


def _python(code: str, cache, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter with ``XDG_CACHE_HOME=cache`` and ``env``, the host settings' other
    variables unset; bounded."""
    environ = {k: v for k, v in os.environ.items() if k not in ENVS}
    environ.update(XDG_CACHE_HOME=str(cache), **env)
    return subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=HANG
    )


CHOICES = """
import logging, sys
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(name)s: %(message)s")
import torch
from cudarecv.core import host_copy as _host_copy
a, b = torch.ones(1 << 20, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
_host_copy.copy_bytes(b, a)  # the first large copy chooses
print("CHOSEN", _host_copy.STREAMING, _host_copy.direct_read_pays().describe())
"""


def _chosen(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stderr
    return next(line for line in out.stdout.splitlines() if line.startswith("CHOSEN")).removeprefix(
        "CHOSEN "
    )


@pytest.mark.skipif(not _host_copy.NATIVE, reason=_host_copy.WHY_NOT_NATIVE or "")
def test_tune_keeps_a_choice_that_a_later_process_reads(tmp_path):
    tune = _python(
        "import sys; from cudarecv.tools.cli import main; sys.exit(main(['tune', '--rounds', '1']))",
        tmp_path,
    )
    assert tune.returncode == 0, tune.stderr
    where = tmp_path / "cudarecv" / "tune.json"
    assert f"kept in {where}" in tune.stdout
    kept = json.loads(where.read_text())["machines"][_tuned.machine()]
    settings = kept["settings"]
    assert settings["host_copy"] in ("stream", "memcpy") and set(kept["measured"]) == {
        "host_copy",
        "direct_read",
    }
    pays = _host_copy.DirectRead(**settings["direct_read"])
    later = _python(CHOICES, tmp_path)
    assert _chosen(later) == f"{settings['host_copy'] == 'stream' and AVX2} {pays.describe()}"
    assert (
        f"cudarecv: host copies: {'streaming' if settings['host_copy'] == 'stream' and AVX2 else 'memcpy'} (tuned"
        in later.stdout
    )  # the choice is logged, with where it came from

    # whatever this machine measured: the other choices, kept by hand, are read too, and the variables override
    settings.update(
        host_copy="memcpy" if settings["host_copy"] == "stream" else "stream",
        direct_read={"leaves": not pays.leaves, "storages": True},
    )
    where.write_text(json.dumps({"format": _tuned.FORMAT, "machines": {_tuned.machine(): kept}}))
    other = _host_copy.DirectRead(**settings["direct_read"])
    assert (
        _chosen(_python(CHOICES, tmp_path))
        == f"{settings['host_copy'] == 'stream' and AVX2} {other.describe()}"
    )
    told = _python(CHOICES, tmp_path, CUDARECV_HOST_COPY="memcpy", CUDARECV_DIRECT_READ="off")
    assert _chosen(told) == "False leaves off, storages off"
    assert "host copies: memcpy (CUDARECV_HOST_COPY=memcpy)" in told.stdout
    shown = _python("from cudarecv.tools.cli import main; main(['tune', '--show'])", tmp_path)
    assert f"host copies: {settings['host_copy']} (tuned" in shown.stdout, shown.stdout
    assert f"direct reads: {other.describe()} (tuned" in shown.stdout, shown.stdout


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (
            {_host_copy.ENV: "fastest"},
            "CUDARECV_HOST_COPY='fastest' must be one of auto, stream, memcpy",
        ),
        (
            {_host_copy.DIRECT_ENV: "always"},
            "CUDARECV_DIRECT_READ='always' must be one of auto, on, off",
        ),
        (
            "{not json",
            r"tune\.json: not JSON .*run `python -m cudarecv tune` again, or delete the file",
        ),
        ({"format": 99, "machines": {}}, "not a cudarecv tune file of format 1"),
        (
            {"host_copy": "fast"},
            r"host_copy='fast' must be one of stream, memcpy; run `python -m cudarecv tune`",
        ),
        (
            {"direct_read": "on"},
            r"direct_read='on' must be \{\"leaves\": bool, \"storages\": bool\}",
        ),
    ],
    ids=[
        "host copy variable",
        "direct read variable",
        "not json",
        "format",
        "host copy kept",
        "direct read kept",
    ],
)
def test_bad_settings_are_refused_before_a_transfer_sends(tmp_path, monkeypatch, bad, pattern):
    """A bad variable or tune file raises ArgumentError naming it and the fix, from the check a transfer makes
    before it sends anything (``policy.allowed``), and ``tune --show`` says the same."""
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(_tuned, "_entry", None)  # read again, from tmp_path
    monkeypatch.setattr(_host_copy, "DIRECT_PAYS", None)
    where = _tuned.path()
    where.parent.mkdir(parents=True)
    if isinstance(bad, dict) and all(k.startswith("CUDARECV_") for k in bad):
        for name, value in bad.items():
            monkeypatch.setenv(name, value)
    elif isinstance(bad, dict) and "format" in bad:
        where.write_text(json.dumps(bad))
    elif isinstance(bad, dict):
        where.write_text(
            json.dumps({"format": _tuned.FORMAT, "machines": {_tuned.machine(): {"settings": bad}}})
        )
    else:
        where.write_text(bad)
    with pytest.raises(cudarecv.ArgumentError, match=pattern):
        policy.allowed("auto")
    from cudarecv.tools.cli import main

    monkeypatch.setattr(_tuned, "_entry", None)
    assert main(["tune", "--show"]) == 2


def test_tune_replaces_a_bad_file(tmp_path, monkeypatch):
    """The fix the errors name works: ``tune`` over a bad file writes a good one (other machines' entries
    of a good file stay)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(_tuned, "_entry", None)
    _tuned.path().parent.mkdir(parents=True)
    _tuned.path().write_text("{not json")
    _tuned.save({"host_copy": "memcpy"}, {}, "then")
    _tuned.save({"host_copy": "stream"}, {}, "now")
    data = json.loads(_tuned.path().read_text())
    assert data["machines"] == {
        _tuned.machine(): {"settings": {"host_copy": "stream"}, "measured": {}, "at": "now"}
    }
    data["machines"]["elsewhere"] = {"settings": {"host_copy": "memcpy"}}
    _tuned.path().write_text(json.dumps(data))
    _tuned.save({"host_copy": "memcpy"}, {}, "later")
    machines = json.loads(_tuned.path().read_text())["machines"]
    assert machines["elsewhere"] == {"settings": {"host_copy": "memcpy"}} and len(machines) == 2
    assert _tuned.tuned("host_copy") == ("memcpy", f"tuned later in {_tuned.path()}")


NOBODY = 65534
SETPRIV = shutil.which("setpriv")

UNPRIVILEGED_RANK = """
import logging, os, sys
from datetime import timedelta
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
import torch
import torch.distributed as dist
from tensordict import TensorDict
import cudarecv
from cudarecv.core import host_copy, tuned

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
td = TensorDict(x=torch.full((1 << 16,), float(rank)))
for step in range(3):  # each fast-wire transfer checks the settings first
    if rank == 0:
        td["x"].fill_(step + 1.0)
        cudarecv.send(td, 1, bucket_bytes=1 << 14, timeout=60)
    else:
        cudarecv.recv(td, 0, bucket_bytes=1 << 14, timeout=60)
        assert bool((td["x"] == step + 1.0).all())
print("DONE uid", os.getuid(), "tuned", tuned.tuned("host_copy"), "streaming", host_copy.STREAMING, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv to drop privileges"
)
def test_a_tune_file_an_unprivileged_process_cannot_reach_means_defaults(tmp_path):
    """Two ranks that dropped privileges (setpriv to nobody), whose HOME and XDG_CACHE_HOME are a directory they
    may not search (root's, mode 0700, holding a good tune file), run fast-wire transfers: no error (before: every
    transfer raised ArgumentError "the tune file cannot be read (Permission denied)" with a fix that cannot work),
    the defaults are used, and the warning is said once per process."""
    import torch.distributed as dist

    home = tmp_path / "home"
    (home / "cudarecv").mkdir(parents=True)
    (home / "cudarecv" / "tune.json").write_text(
        json.dumps(
            {
                "format": _tuned.FORMAT,
                "machines": {_tuned.machine(): {"settings": {"host_copy": "stream"}}},
            }
        )
    )
    home.chmod(
        0o700
    )  # root's: nobody may not search it (nor pytest's root-owned 0700 directories above it)
    environ = {k: v for k, v in os.environ.items() if k not in ENVS}
    environ.update(XDG_CACHE_HOME=str(home), HOME=str(home), GLOO_SOCKET_IFNAME="lo")
    store = dist.TCPStore(
        "127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    drop = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    reach = subprocess.run(
        [*drop, sys.executable, "-c", "import torch, cudarecv"],
        env=environ,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    if reach.returncode != 0:  # (a checkout under a 0700 directory, e.g. one made by mktemp -d)
        pytest.skip(
            f"nobody cannot import torch and cudarecv from {sys.executable}: a directory above the "
            f"checkout or its venv is not searchable ({reach.stderr.strip().splitlines()[-1:]})"
        )
    ranks = [
        subprocess.Popen(
            [*drop, sys.executable, "-c", UNPRIVILEGED_RANK, str(rank), str(store.port)],
            env=environ,
            cwd="/",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    try:
        for rank in ranks:
            out, err = rank.communicate(timeout=HANG)
            outs.append((rank.returncode, out, err))
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait(10)
    for code, out, err in outs:
        assert code == 0, err[-3000:]
        assert f"DONE uid {NOBODY} tuned None streaming {DEFAULT_STREAMS and AVX2}" in out, out
        warned = [line for line in out.splitlines() if "cannot be read by this process" in line]
        assert len(warned) == 1 and warned[0].startswith("cudarecv: WARNING:"), out
        assert "Permission denied" in warned[0] and "the defaults are used" in warned[0], warned


def test_a_tune_file_path_through_a_regular_file_means_defaults(tmp_path, monkeypatch, caplog):
    """XDG_CACHE_HOME names a regular file (a component of the tune file's path is no directory): nothing is tuned,
    the checks a transfer makes pass, the defaults are used, and the warning is said once."""
    import logging

    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    monkeypatch.setattr(_tuned, "_entry", None)  # read again, from there
    monkeypatch.setattr(_host_copy, "DIRECT_PAYS", None)
    with caplog.at_level(logging.WARNING, logger="cudarecv"):
        for _ in range(3):
            assert policy.allowed(
                "auto"
            )  # before: ArgumentError "the tune file cannot be read (Not a directory)"
            assert _tuned.tuned("host_copy") is None and _tuned.tuned("direct_read") is None
    warned = [r for r in caplog.records if "cannot be read by this process" in r.getMessage()]
    assert len(warned) == 1 and "Not a directory" in warned[0].getMessage(), caplog.text
    assert _host_copy.direct_read_pays() == _host_copy.DEFAULT_DIRECT_READ


def test_tune_that_cannot_write_its_file_says_so_in_one_line(tmp_path):
    """XDG_CACHE_HOME names a regular file: ``tune`` measures, then says in one line that it cannot keep the
    file and how to fix it (status 1, no traceback)."""
    (tmp_path / "file").write_text("not a directory")
    tune = _python(
        "import sys; from cudarecv.tools.cli import main; sys.exit(main(['tune', '--rounds', '1']))",
        tmp_path / "file",
    )
    assert tune.returncode == 1, (tune.stdout, tune.stderr)
    assert "Traceback" not in tune.stderr, tune.stderr
    assert (
        "cudarecv tune: error: the tune file" in tune.stderr and "cannot be written" in tune.stderr
    ), tune.stderr
    assert "XDG_CACHE_HOME" in tune.stderr, tune.stderr
