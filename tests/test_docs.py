"""The README and the pages in docs/: every link to a file in the tree leads to one (and
to a heading there, when it names one), the README stays short enough to read, and it
links every page."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: What a newcomer reads on the first screens; the rest belongs in docs/.
README_MAX_BYTES = 12_000

_MD = MarkdownIt("commonmark").enable("table")


def _tokens(path: Path) -> Iterator[Token]:
    """Every token of `path`, inline children included, in document order."""
    for token in _MD.parse(path.read_text()):
        yield token
        yield from token.children or ()


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives `path`'s headings: the heading's text in lower case, with
    what is not a letter, digit, space, `-` or `_` dropped and spaces as `-`; a repeated
    one gets `-1`, `-2`..."""
    anchors: set[str] = set()
    repeats: dict[str, int] = {}
    tokens = _MD.parse(path.read_text())
    for opening, inline in itertools.pairwise(tokens):
        if opening.type != "heading_open":
            continue
        text = "".join(
            c.content for c in inline.children or () if c.type in ("text", "code_inline")
        )
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = repeats.get(slug, 0)
        repeats[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _local_links(path: Path) -> list[str]:
    """The targets of `path`'s links and images that name no scheme (files in the tree, or
    a heading of this page)."""
    out = []
    for token in _tokens(path):
        target = {"link_open": token.attrGet("href"), "image": token.attrGet("src")}.get(token.type)
        if target is not None and not urlsplit(str(target)).scheme:
            out.append(str(target))
    return out


def test_the_heading_anchors_are_the_ones_github_makes(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## The `aoe` command and `aoe.Client`\n\n## Resuming (`--reload`)\n\n## Title\n"
    )
    assert _anchors(page) == {
        "title",
        "the-aoe-command-and-aoeclient",
        "resuming---reload",
        "title-1",
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_local_link_leads_somewhere(page: Path) -> None:
    broken = []
    for link in _local_links(page):
        parts = urlsplit(link)
        target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif parts.fragment and target.suffix == ".md" and parts.fragment not in _anchors(target):
            broken.append(f"{link}: {target} has no heading #{parts.fragment}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_stays_short_and_links_every_page() -> None:
    readme = ROOT / "README.md"
    size = len(readme.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail to docs/"
    )
    linked = {(ROOT / urlsplit(link).path).resolve() for link in _local_links(readme)}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link {', '.join(unlinked)}"
