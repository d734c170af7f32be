"""The README stays a five-minute page, its front pages keep lines (and table cells) short, every docs
page opens with the question it answers, and every relative link of the documentation resolves: each
``[text](target)`` (and image) in README.md and docs/**/*.md that is not a web or mail address names a
file or folder of the repository, and a ``#anchor`` into a Markdown file names one of its headings
under GitHub's slug rule. Links inside code (fenced blocks, inline segments) are not links."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
README_LIMIT_BYTES = 9_000  # about 8 KB: the front door; details go to docs/
LINE_LIMIT = 300  # README, status and design: a prose line, or a table cell, read at a glance
SHORT_LINED = ("README.md", "docs/status.md", "docs/design.md")

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or ![alt](target), the target up to whitespace or ')', an optional "title" after it.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


class Link(NamedTuple):
    source: Path
    line: int
    target: str


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line with inline code removed) of every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.split("\n"), 1):
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1) == fence:
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        yield number, INLINE_CODE.sub("", line)


def links(path: Path) -> list[Link]:
    return [Link(path, number, match.group(1)) for number, line in prose_lines(path.read_text()) for match in LINK.finditer(line)]


def heading_text(markdown: str) -> str:
    """A heading as GitHub renders it to plain text: code segments, links and emphasis reduced to their text."""
    text = re.sub(r"(`+)(.+?)\1", lambda match: match.group(2), markdown)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"(\*\*|__|\*|(?<!\w)_(?!\w))", "", text)


def slug(text: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation other than '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading_text(text).strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file; a repeated slug gets -1, -2, ... in order."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken(link: Link, root: Path = ROOT) -> str | None:
    """Why a link does not resolve, or None when it does (or is not ours to check)."""
    target = link.target
    if not target or target.startswith(EXTERNAL):
        return None
    file_part, _, anchor = target.partition("#")
    resolved = (link.source.parent / file_part).resolve() if file_part else link.source
    if not resolved.exists():
        return f"{file_part} does not exist"
    if root.resolve() not in (resolved, *resolved.parents):
        return f"{file_part} is outside the repository"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{resolved.relative_to(root.resolve())} has no heading with anchor #{anchor}"
    return None


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_slug_follows_githubs_rule():
    assert slug("The two commands") == "the-two-commands"
    assert slug("Does it fit my deployment?") == "does-it-fit-my-deployment"
    assert slug("Learned scores (KVzap / Fast KVzip style)") == "learned-scores-kvzap--fast-kvzip-style"
    assert slug("2b. Decode graphs: a decode step's attention") == "2b-decode-graphs-a-decode-steps-attention"
    assert slug("`make serve`'s variables") == "make-serves-variables"
    assert slug("What `activate_cpu_mode` does") == "what-activate_cpu_mode-does"
    assert slug("**Bold** and [a link](x.md)") == "bold-and-a-link"


def test_the_checker_finds_broken_links_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Same\n\n## Same\n\n```\n## Not a heading\n```\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n## Here\n\n"
        "[ok](other.md) [ok](other.md#same) [ok](other.md#same-1) [ok](#here) [ok](https://x.org/none.md)\n"
        "![ok](other.md \"a title\") `[skipped](missing.md)`\n"
        "[bad](missing.md) [bad](other.md#same-2) [bad](#nowhere) [bad](other.md#not-a-heading)\n"
        "[bad](../../outside.md)\n"
        "```\n[skipped](missing.md)\n```\n"
    )  # fmt: skip
    (tmp_path.parent / "outside.md").touch()
    found = links(page)
    assert [link.target for link in found][:6] == ["other.md", "other.md#same", "other.md#same-1", "#here", "https://x.org/none.md", "other.md"]
    problems = [(link.line, link.target) for link in found if broken(link, tmp_path)]
    assert problems == [(7, "missing.md"), (7, "other.md#same-2"), (7, "#nowhere"), (7, "other.md#not-a-heading"), (8, "../../outside.md")]


def test_every_relative_link_resolves():
    problems = [
        f"{link.source.relative_to(ROOT)}:{link.line}: ({link.target}) {why}"
        for document in documents()
        for link in links(document)
        if (why := broken(link)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_the_checker_reads_the_real_documents():
    """Guards against a regex that matches nothing: the README links into docs/ with anchors."""
    readme_links = [link.target for link in links(ROOT / "README.md")]
    assert "docs/design.md" in readme_links and any("#" in target for target in readme_links)
    assert sum(len(links(document)) for document in documents()) > 100


def test_the_readme_is_short_and_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) < README_LIMIT_BYTES, f"README.md is {len(readme)} bytes; move sections to docs/"
    sections = re.split(r"^## ", readme.decode(), flags=re.MULTILINE)
    assert len(sections) > 1, "README.md has no '## ' section"
    first = sections[1]
    assert "make serve" in first and "make test" in first



def long_lines(text: str, limit: int = LINE_LIMIT) -> list[tuple[int, int]]:
    """(line number, length) of each prose line over ``limit`` characters, and of each table row with a
    cell over it (a Markdown row cannot wrap, so its cells are held to the limit instead); code blocks
    are not prose."""
    found = []
    for number, line in prose_lines(text):
        if line.lstrip().startswith("|"):
            longest = max(len(cell.strip()) for cell in line.strip().strip("|").split("|"))
            if longest > limit:
                found.append((number, longest))
        elif len(line) > limit:
            found.append((number, len(line)))
    return found


def test_the_front_pages_keep_lines_and_cells_short():
    assert long_lines("short\n| a | " + "b" * 301 + " |\n" + "c" * 301 + "\n```\n" + "d" * 400 + "\n```\n") == [(2, 301), (3, 301)]
    problems = {name: found for name in SHORT_LINED if (found := long_lines((ROOT / name).read_text()))}
    assert not problems, f"lines (or table cells) over {LINE_LIMIT} characters: {problems}"


def test_every_docs_page_opens_with_the_question_it_answers():
    """A page's title is its question, or the line after it is (``> ...?``). The method pages and the
    results pages under docs/ are references, not answers to one question."""
    missing = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        title, blank, question = (page.read_text().split("\n") + ["", ""])[:3]
        asked = question.startswith("> ") and question.endswith("?") and blank == ""
        if not title.startswith("# ") or not (title.endswith("?") or asked):
            missing.append(page.name)
    assert not missing, f"pages without an opening question (> ...?) under their title: {missing}"
