"""The README is short and leads into docs/, and no link in README.md or docs/*.md is broken.

README.md stays at most 260 lines (a newcomer reads it to the end; the reference lives in docs/).
Its table links every docs/*.md page, and every docs/ link it has names a page that exists. Every
relative link in the README and the docs pages resolves to a file of this checkout and, with a
#fragment, to a heading of that file as GitHub anchors it. Links inside code (fenced blocks,
`inline code`) are text, not links, and are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

README_MAX_LINES = 260
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def prose(markdown: str) -> str:
    """The text with fenced blocks and inline code taken out (a link written there is an example)."""
    return INLINE_CODE.sub("", FENCE.sub("", markdown))


def links(markdown: str) -> list[str]:
    return LINK.findall(prose(markdown))


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings: lower case, punctuation dropped, spaces to hyphens, and a
    -1, -2 ... suffix for a repeated heading."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page: Path, root: Path) -> list[str]:
    """The relative links of one page that lead nowhere: a missing file, a path outside the checkout,
    or a #fragment no heading of the target has."""
    broken = []
    for link in links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):          # https:, mailto: ... (not checked offline)
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if root.resolve() not in (target, *target.parents) or not target.exists():
            broken.append(f"{page.relative_to(root)}: {link} (no such file in the checkout)")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target.read_text()):
            broken.append(f"{page.relative_to(root)}: {link} (no heading '#{fragment}' in {target.name})")
    return broken


def test_the_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference to docs/"


def test_the_readme_links_every_docs_page_and_only_pages_that_exist() -> None:
    linked = {link.partition("#")[0] for link in links((REPO / "README.md").read_text()) if link.startswith("docs/")}
    pages = {f"docs/{page.name}" for page in (REPO / "docs").glob("*.md")}
    assert len(pages) >= 20, sorted(pages)                                  # the pages are where the test looks
    assert not linked - pages, f"README.md links docs pages that do not exist: {sorted(linked - pages)}"
    assert not pages - linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_every_relative_link_resolves() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    checked = sum(len(links(page.read_text())) for page in pages)
    assert checked >= 40, checked                                           # the links were found at all
    broken = [line for page in pages for line in broken_links(page, REPO)]
    assert not broken, "\n".join(broken)


def test_the_link_check_finds_what_is_broken(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Page A\n\n## Terminals: `x -t` and more\n\nsee [back](../README.md#top)\n")
    readme = tmp_path / "README.md"
    readme.write_text("# Top\n\n[a](docs/a.md) [a's part](docs/a.md#terminals-x--t-and-more) [me](#top)\n"
                      "[web](https://example.org/x) `[code](docs/nothing.md)`\n```\n[fenced](docs/nothing.md)\n```\n")
    assert broken_links(readme, tmp_path) == [] and broken_links(tmp_path / "docs" / "a.md", tmp_path) == []
    readme.write_text("[gone](docs/b.md) [no part](docs/a.md#page-b) [out](../../etc/passwd) [self](#nowhere)\n")
    assert broken_links(readme, tmp_path) == [
        "README.md: docs/b.md (no such file in the checkout)",
        "README.md: docs/a.md#page-b (no heading '#page-b' in a.md)",
        "README.md: ../../etc/passwd (no such file in the checkout)",
        "README.md: #nowhere (no heading '#nowhere' in README.md)",
    ]


def test_repeated_headings_get_numbered_anchors() -> None:
    assert anchors("# A\n## Notes\n### Notes\n```\n# not a heading\n```\n") == {"a", "notes", "notes-1"}
