"""The documentation: a README a newcomer reads in five minutes, links that lead somewhere, and a site
that builds (``mkdocs build --strict``, API pages from the docstrings)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

#: the README's set-up: torch's CPU build from PyTorch's own index (PyPI's torch is the CUDA 13 build), then the
#: checkout and the main job
SETUP = [
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
    'pip install -e ".[test]" && python -m cudarecv demo',
]
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
    assert len(lines) <= 220, (
        f"README.md has {len(lines)} lines: keep it a five-minute read, move the rest to docs/"
    )
    head = lines[:25]
    for command in SETUP:
        assert any(line.startswith(command) for line in head), (
            f"the set-up command is not in the first 25 lines: {command}"
        )
    tests = [line.split("#")[0].strip() for line in head if line.startswith("pytest")]
    assert tests, "the test command (pytest ...) is not near the top"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests[0] in ci, (
        f"CI runs the README's test command, but .ci/run has no line {tests[0]!r}"
    )


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
        elif (
            anchor
            and file.suffix == ".md"
            and file.name != "reference.md"
            and anchor not in _anchors(file)
        ):
            missing.append(
                target
            )  # (reference.md's ids are made by mkdocstrings: the strict build checks them)
    assert not missing, (
        f"{page.relative_to(ROOT)} links to files or headings that do not exist: {missing}"
    )


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
            pytest.skip(
                f"{module} is not installed (pip install -e '.[docs]', part of cudarecv[test])"
            )
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "reference" / "index.html").exists()


def test_the_install_pages_say_the_same():
    """README and docs/index.md: the CPU build from PyTorch's CPU index; docs/gpu.md: PyPI's (CUDA 13) build."""
    index = (DOCS / "index.md").read_text()
    assert SETUP[0] in index and SETUP[1] in index, (
        "docs/index.md's install block is not the README's"
    )
    for page in (README.read_text(), index):
        words = " ".join(page.split())  # (across the text's line breaks)
        assert "CUDA 13 build" in words and "about 20 NVIDIA packages" in words
    gpu = (DOCS / "gpu.md").read_text()
    install = gpu[gpu.index("## Install on a GPU machine") :].split("\n## ", 1)[0]
    assert (
        "pip install torch==2.13.0" in install and "CUDA 13" in install and SETUP[0] not in install
    ), install


# -- the README's Use section: every pair it shows works together ---------------------------------------------


def _use_block() -> str:
    """The first python block of the README's ``## Use`` section."""
    text = README.read_text()
    section = text[text.index("\n## Use\n") :]
    return section[
        section.index("```python\n") + len("```python\n") : section.index(
            "\n```", section.index("```python")
        )
    ]


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _use_pairs() -> tuple[str, list[tuple[str, str]]]:
    """The Use block as its preamble (the statements that do not name ``rank``: the imports) and its pairs (each
    statement that does: ``if rank == 0: ... else: ...``), each with its title (the comment line above it, or
    its first line)."""
    code = _use_block()
    lines = code.splitlines()
    preamble, pairs = [], []
    for node in ast.parse(code).body:
        source = ast.get_source_segment(code, node)
        if "rank" not in _names(node):
            preamble.append(source)
            continue
        above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
        title = (
            above.lstrip("# ")
            if above.startswith("#")
            else lines[node.lineno - 1].split("#")[0].strip()
        )
        pairs.append((title, source))
    return "\n".join(preamble) + "\n", pairs


PREAMBLE, PAIRS = _use_pairs()


def readme_pair(rank: int, world: int, group: object, code: str, key: str) -> dict[str, object]:
    """Run one README pair on this rank, with what the README takes as given: ``rank``; ``td``, the same
    structure on both ranks (1.0 on rank 0, 0.0 on rank 1); ``policy``, a module with other weights on each
    rank; ``store``, one both can reach. Then both ranks meet (through the store, outside the link under
    test: a trainer outlives its first push), the weight-sync ends close, and this rank's ``td`` and ``policy``
    come back."""
    import torch
    import torch.distributed as dist
    from tensordict import TensorDict

    import cudarecv

    value = float(rank == 0)
    td = TensorDict(
        {"obs": torch.full((4, 3), value), "net": {"w": torch.full((8,), value)}}, batch_size=[]
    )
    torch.manual_seed(rank)
    shared = dist.distributed_c10d._get_default_store()
    space = dict(
        rank=rank, td=td, policy=torch.nn.Linear(3, 2), store=dist.PrefixStore(key, shared)
    )
    exec(compile(code, "README.md (Use)", "exec"), space)
    shared.set(f"{key}/ran/{rank}", "1")
    shared.wait([f"{key}/ran/{r}" for r in range(world)], timedelta(seconds=120))
    for end in [
        v for v in space.values() if isinstance(v, (cudarecv.WeightSender, cudarecv.WeightReceiver))
    ]:
        end.close()
    return dict(
        td={k: v.tolist() for k, v in space["td"].flatten_keys(".").items()},
        policy={k: v.tolist() for k, v in space["policy"].state_dict().items()},
    )


def test_the_use_section_is_pairs():
    """Every snippet of the Use section is a pair (``if rank == 0: ... else: ...``), and the pairs show each
    way in: the drop-in calls on both wires, asynchronous, installed, weight sync by ranks and through a store."""
    for title, code in PAIRS:
        branches = [
            n
            for n in ast.walk(ast.parse(code))
            if isinstance(n, ast.If) and "rank" in _names(n.test)
        ]
        assert len(branches) == 1 and branches[0].orelse, (
            f"{title}: not one `if rank == 0: ... else: ...`"
        )
    for shown in (
        "cudarecv.send(",
        "bucket_bytes=",
        "cudarecv.isend(",
        "cudarecv.installed()",
        "dst=[1]",
        "store=store",
    ):
        assert any(shown in code for _, code in PAIRS), f"no pair of the Use section shows {shown}"


@pytest.mark.parametrize("title, code", PAIRS, ids=[title.split(":")[0] for title, _ in PAIRS])
def test_each_readme_pair_works_together(cluster, title: str, code: str):
    """Rank 0 and rank 1 run the pair's two ends for real (gloo, two processes): what the pair moves (``td``, or
    ``policy``'s weights) is then the same on rank 1 as on rank 0."""
    key = f"readme_pair/{title}/{time.monotonic_ns()}"
    sent, received = cluster().run(readme_pair, args=(PREAMBLE + code, key), timeout=120)
    moved = {"td", "policy"} & _names(ast.parse(code))
    assert moved, f"the pair moves neither td nor policy:\n{code}"
    for name in moved:
        assert received[name] == sent[name], f"{name} on rank 1 is not rank 0's after:\n{code}"
    assert sent["td"]["obs"][0][0] == 1.0 and (received["td"] != sent["td"]) == ("td" not in moved)
