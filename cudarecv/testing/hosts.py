"""Several hosts on one machine: network namespaces on a bridge, real link limits, torchrun.

:class:`SimulatedHosts` builds ``n`` hosts, each a network namespace with one
NIC (``eth0``, a veth whose other end is on a bridge in a switch namespace),
an address in the loopback range (``127.100.0.1`` for host 0, ``.2`` for host
1, ...; never a private range) and its own link: ``rate`` each way (``tc
tbf`` on both ends of the veth: the host's uplink and downlink) and ``delay``
one way (``tc netem``, where the kernel has it). Ranks start inside the hosts
with **torchrun** and c10d rendezvous at host 0, exactly the command a real cluster runs
(:meth:`SimulatedHosts.torchrun_command`), so a job script runs on real nodes
unchanged.

Namespaces are named per run (``cdr<pid>x<k>-...``) and always torn down:
on ``close()``/``__exit__`` (a test that fails too), at interpreter exit, and
at the next start for runs whose process is gone (a run killed with SIGKILL).
Creating them needs root or CAP_NET_ADMIN: :func:`unavailable` says why not.

Example:
    >>> with SimulatedHosts(3, rate="1gbit") as hosts:
    ...     jobs = hosts.torchrun("job.py", args=["--out", "/tmp/res"])
    ...     hosts.wait(jobs, timeout=120)       # raises HostsError naming a failed host
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence

from cudarecv import Error

PREFIX = "cdr"
NIC = "eth0"  # every host's one network interface, as on a real node
MASTER_PORT = 29500  # ports are per namespace: the same on every run
_SECONDS = 30  # the most any one ``ip``/``tc`` command may take
_COUNTER = itertools.count()
_LIVE: set[SimulatedHosts] = set()
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")


class HostsError(Error, RuntimeError):
    """Simulated hosts could not be built, or a job on them failed or ran out of time."""


def address(host: int) -> str:
    """Host ``host``'s address (``127.100.0.<host + 1>``)."""
    return f"127.100.0.{host + 1}"


def is_rate(text: str) -> bool:
    """Whether ``text`` is a link rate as ``tc`` writes it (``"1gbit"``, ``"100mbit"``)."""
    return bool(_RATE.match(text))


def unavailable() -> str | None:
    """Why simulated hosts cannot be built here (``None`` if they can): not root, no ``ip``/``tc``,
    or no CAP_NET_ADMIN (namespace creation is tried once)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2)"
    if os.geteuid() != 0:
        return f"network namespaces need root or CAP_NET_ADMIN (running as uid {os.geteuid()})"
    name = f"{PREFIX}{os.getpid()}probe"
    made = subprocess.run(
        ["ip", "netns", "add", name], capture_output=True, text=True, timeout=_SECONDS
    )
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_SECONDS)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    return None


def _sh(*argv: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_SECONDS)
    except subprocess.TimeoutExpired:
        raise HostsError(f"`{' '.join(argv)}` did not finish within {_SECONDS} s") from None
    if done.returncode != 0:
        raise HostsError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def _netns_pids(name: str) -> list[int]:
    """The processes in network namespace ``name``, wherever they were started from."""
    listed = subprocess.run(
        ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=_SECONDS
    )
    return [int(pid) for pid in listed.stdout.split()]


def _sweep_stale() -> None:
    """Delete namespaces left by runs whose process is gone (killed before teardown), and kill what
    still runs in them."""
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=_SECONDS
    ).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        found = re.match(rf"^{PREFIX}(\d+)x\d+-", name)
        if found and not os.path.exists(f"/proc/{found.group(1)}"):
            for pid in _netns_pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_SECONDS)


class SimulatedHosts:
    """``n`` hosts joined by a switch, each link limited to ``rate`` each way, ``delay`` one way.

    Args:
        n: the number of hosts (1..200).
        rate: each host's link speed as ``tc`` writes it (``"1gbit"``, ``"100mbit"``), or
            ``None`` for no limit.
        delay: one-way latency added on each host's uplink (``"1ms"``), or ``None``.
    """

    def __init__(self, n: int, *, rate: str | None = "1gbit", delay: str | None = None) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 200:
            raise HostsError(f"`n` must be an int in 1..200, got {n!r}")
        if rate is not None and not is_rate(rate):
            raise HostsError(f"`rate` must be a tc rate such as '1gbit' or '100mbit', got {rate!r}")
        if delay is not None and not re.match(r"^\d+(\.\d+)?(us|ms|s)$", delay):
            raise HostsError(f"`delay` must be a tc time such as '1ms', got {delay!r}")
        reason = unavailable()
        if reason:
            raise HostsError(f"cannot build simulated hosts: {reason}")
        self.n, self.rate, self.delay = n, rate, delay
        self.run_id = f"{PREFIX}{os.getpid()}x{next(_COUNTER)}"
        self.switch = f"{self.run_id}-sw"
        self.hosts = [f"{self.run_id}-h{i}" for i in range(n)]
        self._procs: dict[subprocess.Popen, int] = {}  # every job started here, and its host
        _sweep_stale()
        _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            port = f"p{i}"
            _sh("ip", "netns", "add", host)
            _sh(
                "ip",
                "link",
                "add",
                NIC,
                "netns",
                host,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.switch,
            )
            _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", port, "up")
            for conf in ("all", NIC):  # 127.x on a NIC needs route_localnet
                _sh(
                    "ip",
                    "netns",
                    "exec",
                    host,
                    "sysctl",
                    "-qw",
                    f"net.ipv4.conf.{conf}.route_localnet=1",
                )
            _sh("ip", "-n", host, "link", "set", "lo", "up")
            _sh("ip", "-n", host, "addr", "add", f"{address(i)}/24", "dev", NIC)
            _sh("ip", "-n", host, "link", "set", NIC, "up")
            self._shape(host, NIC, self.delay)  # the host's uplink (what it sends)
            self._shape(self.switch, port, None)  # its downlink (what it receives)

    def _shape(self, ns: str, dev: str, delay: str | None) -> None:
        parent = ["root"]
        if delay is not None:
            try:
                _sh(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "handle",
                    "1:",
                    "netem",
                    "delay",
                    delay,
                    "limit",
                    "100000",
                )
            except HostsError as error:
                if "unknown" in str(error).lower():
                    raise HostsError(
                        "`delay` needs tc's netem qdisc (kernel module sch_netem), which this kernel "
                        "does not have: pass delay=None"
                    ) from None
                raise
            parent = ["parent", "1:"]
        if self.rate is not None:
            _sh(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                *parent,
                "tbf",
                "rate",
                self.rate,
                "burst",
                "256kb",
                "latency",
                "50ms",
            )

    # -- running ------------------------------------------------------------------------
    def popen(
        self, host: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: object
    ) -> subprocess.Popen:
        """Start ``argv`` inside host ``host`` (its output as ``kwargs`` say; default: inherited)."""
        full_env = {**os.environ, "GLOO_SOCKET_IFNAME": NIC, **(env or {})}
        proc = subprocess.Popen(  # type: ignore[call-overload]  # (kwargs: Popen's, from the caller)
            ["ip", "netns", "exec", self.hosts[host], *argv],
            env=full_env,
            start_new_session=True,
            **kwargs,
        )
        self._procs[proc] = host
        return proc

    def torchrun_command(
        self,
        host: int,
        script: str,
        args: Sequence[str] = (),
        *,
        nproc_per_node: int = 1,
        nnodes: int | None = None,
        run_id: str | None = None,
    ) -> list[str]:
        """The torchrun command host ``host`` runs: c10d rendezvous at host 0. On real nodes it is the
        same with their addresses (``--local-addr`` is needed here only because a namespace's
        hostname does not resolve to its address)."""
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nnodes or self.n),
            "--nproc-per-node",
            str(nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{address(0)}:{MASTER_PORT}",
            "--rdzv-id",
            run_id or uuid.uuid4().hex[:12],
            "--local-addr",
            address(host),
            "--max-restarts",
            "0",
            script,
            *args,
        ]

    def torchrun(
        self,
        script: str,
        args: Sequence[str] = (),
        *,
        nproc_per_node: int = 1,
        hosts: int | None = None,
        env: dict[str, str] | None = None,
        log_dir: str | None = None,
    ) -> list[subprocess.Popen]:
        """Start ``script`` with torchrun on every host (or the first ``hosts``); each rank sees
        ``CUDARECV_HOST`` (its host's index).

        With ``log_dir``, host i's output goes to ``log_dir/host<i>.log``; else it is inherited.
        """
        count = self.n if hosts is None else hosts
        if not 1 <= count <= self.n:
            raise HostsError(f"`hosts` must be in 1..{self.n}, got {hosts!r}")
        run_id = uuid.uuid4().hex[:12]
        procs = []
        for i in range(count):
            command = self.torchrun_command(
                i, script, args, nproc_per_node=nproc_per_node, nnodes=count, run_id=run_id
            )
            out = open(os.path.join(log_dir, f"host{i}.log"), "wb") if log_dir else None  # noqa: SIM115
            try:
                procs.append(
                    self.popen(
                        i,
                        command,
                        {**(env or {}), "CUDARECV_HOST": str(i)},
                        stdout=out,
                        stderr=subprocess.STDOUT if out else None,
                    )
                )
            finally:
                if out is not None:
                    out.close()
        return procs

    def wait(
        self,
        procs: Sequence[subprocess.Popen],
        timeout: float,
        *,
        may_fail: Sequence[int] = (),
        log_dir: str | None = None,
    ) -> list[int]:
        """Wait up to ``timeout`` s for every host's job; return the exit codes.

        Raises:
            HostsError: a host in none of ``may_fail`` exited non-zero, or a job was still
                running at the deadline (every job is then killed); with ``log_dir`` the
                message ends with the failing host's last log lines.
        """
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * len(procs)
        try:
            while any(c is None for c in codes):
                for i, proc in enumerate(procs):
                    if codes[i] is None:
                        codes[i] = proc.poll()
                failed = [
                    i for i, c in enumerate(codes) if c not in (None, 0) and i not in may_fail
                ]
                if failed:
                    raise HostsError(
                        f"the job on host(s) {failed} exited with {[codes[i] for i in failed]}"
                        + _tail(log_dir, failed[0])
                    )
                if time.monotonic() > deadline:
                    late = [i for i, c in enumerate(codes) if c is None]
                    raise HostsError(
                        f"the job on host(s) {late} did not finish within {timeout:g} s"
                        + _tail(log_dir, late[0])
                    )
                time.sleep(0.05)
        except BaseException:
            self.kill(procs)
            raise
        return [c for c in codes if c is not None]  # (all of them by now)

    def kill(self, procs: Sequence[subprocess.Popen] | None = None) -> None:
        """Kill jobs and every process on their hosts (default: every host), quietly.

        torchrun starts each worker in a session of its own, so workers are found by their
        host's namespace, not their process group. All are stopped (SIGSTOP) before any is
        killed: a rank that saw a peer or its torchrun vanish would print a traceback.

        Raises:
            HostsError: a process of those hosts was still there 10 s after its SIGKILL.
        """
        chosen = list(procs if procs is not None else self._procs)
        hosts = (
            range(self.n)
            if procs is None
            else sorted({self._procs[p] for p in chosen if p in self._procs})
        )
        for pid in self._stop_all(hosts):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while left := [pid for host in hosts for pid in self._pids(host)]:
            if time.monotonic() > deadline:
                raise HostsError(f"processes {left} on hosts {hosts} outlived SIGKILL for 10 s")
            time.sleep(0.05)
        for proc in chosen:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def _stop_all(self, hosts: Sequence[int]) -> set[int]:
        """SIGSTOP every process on ``hosts`` until no running one is left (a stopped process
        starts none); returns them."""
        stopped: set[int] = set()
        while new := {pid for host in hosts for pid in self._pids(host)} - stopped:
            for pid in new:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            stopped |= new
        return stopped

    def _pids(self, host: int) -> list[int]:
        return _netns_pids(self.hosts[host])

    def close(self) -> None:
        """Kill every job started here and every process on the hosts, and delete the namespaces. Idempotent."""
        if self not in _LIVE:
            return
        _LIVE.discard(self)
        try:
            self.kill()
        finally:
            for ns in [*self.hosts, self.switch]:
                with contextlib.suppress(
                    subprocess.TimeoutExpired
                ):  # the next start sweeps what is left
                    subprocess.run(
                        ["ip", "netns", "del", ns], capture_output=True, timeout=_SECONDS
                    )

    def __enter__(self) -> SimulatedHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tail(log_dir: str | None, host: int, lines: int = 25) -> str:
    if not log_dir:
        return ""
    try:
        with open(os.path.join(log_dir, f"host{host}.log"), errors="replace") as f:
            text = f.read().splitlines()[-lines:]
    except OSError:
        return ""
    return f"; host {host}'s last lines:\n" + "\n".join(text)


@atexit.register
def _close_all() -> None:
    for hosts in list(_LIVE):
        hosts.close()
