"""Run a command many times beside busy processes; count how its runs ended (cudarecv issue 31).

Not a test (pytest collects ``test_*.py`` only): a measurement, run from the shell::

    python tests/exit_soak.py --runs 50 --busy 4 -- python examples/weight_sync.py sync
    python tests/exit_soak.py --runs 50 --busy 4 -- python -m cudarecv demo --quick --hosts 3

An abort is a run that died by a signal, or whose output says a process did (``terminate
called``, ``SIGABRT``, torchrun's ``exitcode : -6``). The output of every run that did not
exit 0 is kept in ``--keep``. One JSON line at the end: runs, aborts, exit codes, seconds, and
the machine's 1-minute load average after each run (others' processes count as busy too).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

ABORT = re.compile(r"terminate called|SIGABRT|Aborted|exitcode\s*:\s*-\d+|core dumped")
BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def soak(command: list[str], runs: int, busy: int, timeout: float, keep: str) -> dict:
    """``runs`` runs of ``command``, one after the other, with ``busy`` spinning processes beside them."""
    os.makedirs(keep, exist_ok=True)
    spinners = [
        subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=runs * timeout)])
        for _ in range(busy)
    ]
    codes: collections.Counter = collections.Counter()
    aborts, loads, started = [], [], time.monotonic()
    try:
        for run in range(runs):
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
                code, out = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as expired:
                code, out = "timeout", f"{expired.stdout or ''}{expired.stderr or ''}"
            codes[str(code)] += 1
            loads.append(os.getloadavg()[0])
            aborted = (isinstance(code, int) and code < 0) or bool(ABORT.search(out))
            if aborted:
                aborts.append(run)
            if code != 0 or aborted:
                with open(os.path.join(keep, f"run{run:03d}.log"), "w") as f:
                    f.write(f"exit {code}\n{out}")
            print(
                f"run {run}: exit {code}{' ABORT' if aborted else ''}", file=sys.stderr, flush=True
            )
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(10)
    return {
        "command": " ".join(command),
        "runs": runs,
        "busy": busy,
        "aborts": len(aborts),
        "aborted_runs": aborts,
        "exit_codes": dict(codes),
        "seconds": round(time.monotonic() - started, 1),
        "load_1min": {
            "min": min(loads),
            "mean": round(sum(loads) / len(loads), 1),
            "max": max(loads),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--busy", type=int, default=4, help="spinning processes beside the runs")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument(
        "--keep", default="exit_soak_logs", help="where the output of failed runs goes"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    print(json.dumps(soak(command, args.runs, args.busy, args.timeout, args.keep)), flush=True)


if __name__ == "__main__":
    main()
