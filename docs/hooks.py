"""mkdocs hook: the docstrings' reST markup (:class:`X`, :func:`~a.b.c`, ``Layout::``) reads cleanly in the site.

The library's docstrings are Google style with reST roles in their prose; mkdocstrings renders them as
markdown, where a role stays as text before its code span (":class:" then ``X``) and a literal block's
"::" stays as it is. This drops the role and, as Sphinx does for ``~``, keeps only the last part of a
dotted name; a paragraph's closing "::" becomes ":" and a lone "::" goes.
"""

from __future__ import annotations

import re

_ROLE = re.compile(
    r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const):<code>(~?)([^<]*)</code>"
)
_LONE_LITERAL = re.compile(r"<p>::</p>")
_CLOSING_LITERAL = re.compile(r"::</p>")


def _code(match: re.Match) -> str:
    tilde, name = match.groups()
    return f"<code>{name.rsplit('.', 1)[-1] if tilde else name}</code>"


def on_page_content(html: str, **kwargs) -> str:
    html = _ROLE.sub(_code, html)
    html = _LONE_LITERAL.sub("", html)
    return _CLOSING_LITERAL.sub(":</p>", html)
