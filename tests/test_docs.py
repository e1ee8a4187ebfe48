"""The documentation: a README a newcomer reads in five minutes, links that lead somewhere, and a site
that builds (``mkdocs build --strict``, API pages from the docstrings)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

SETUP = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m cudarecv demo'
# [text](target) and [text]: target, outside code spans and code blocks
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _links(page: Path) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text()))
    return [a or b for a, b in _LINK.findall(text)]


def _anchors(page: Path) -> set[str]:
    """The ids of a page's headings, as GitHub and mkdocs' toc both make them."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", _FENCE.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in headings}


def test_readme_is_short_with_the_two_commands_first():
    lines = README.read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines: keep it a five-minute read, move the rest to docs/"
    head = lines[:25]
    assert any(line.startswith(SETUP) for line in head), f"the set-up command is not in the first 25 lines: {SETUP}"
    tests = [line.split("#")[0].strip() for line in head if line.startswith("pytest")]
    assert tests, "the test command (pytest ...) is not near the top"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests[0] in ci, f"CI runs the README's test command, but .ci/run has no line {tests[0]!r}"


def test_the_error_table_is_the_same_in_the_readme_and_the_api_page():
    def table(path: Path) -> list[str]:
        text = path.read_text()
        start = text.index("| class | builtin base | `link_usable` | when |")
        return text[start:].split("\n\n", 1)[0].splitlines()

    assert table(README) == table(DOCS / "api.md")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_point_to_files(page):
    missing = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on the page itself
        path, _, anchor = target.partition("#")
        file = page.parent / path
        if not file.exists():
            missing.append(target)
        elif anchor and file.suffix == ".md" and file.name != "reference.md" and anchor not in _anchors(file):
            missing.append(target)  # (reference.md's ids are made by mkdocstrings: the strict build checks them)
    assert not missing, f"{page.relative_to(ROOT)} links to files or headings that do not exist: {missing}"


def test_every_docs_page_is_in_the_site_nav():
    config = (ROOT / "mkdocs.yml").read_text()
    unlisted = [p.name for p in DOCS.glob("*.md") if f": {p.name}" not in config]
    assert not unlisted, f"docs pages missing from mkdocs.yml's nav: {unlisted}"


def test_the_site_builds_strict(tmp_path):
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]', part of cudarecv[test])")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "reference" / "index.html").exists()
