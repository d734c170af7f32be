"""Real text, cut into documents of about a given token length (training corpus of the learned scorer,
``train_scorer``).

Sources: two present on every machine the project runs on, and the user's own documents.

* ``pydoc``: the Python documentation topics shipped with the interpreter (``pydoc_data.topics``,
  the text of ``help("topic")``): about 465K characters of technical prose and code for Python 3.11;
* ``readmes``: the long descriptions (README text) in the metadata of the installed distributions;
  larger, but it depends on what is installed, so runs on other machines see other text;
* a path: a UTF-8 text file, or a folder whose files (every level, in name order; hidden ones and
  files that are not UTF-8 text skipped) are the texts: the documents the served model will see.

Never the benchmarks' synthetic filler or questions: the scorer must not learn the test tasks.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Callable, Iterator

CORPUS_SOURCES = ("pydoc", "readmes")
# A README shorter than this is mostly badges and links.
_MIN_README_CHARACTERS = 2000


def check_source(source: str) -> None:
    """``ValueError`` (one line) unless ``source`` is a named source or an existing file or folder."""
    if source not in CORPUS_SOURCES and not Path(source).exists():
        raise ValueError(
            f"corpus source {source!r} is neither a named source ({', '.join(CORPUS_SOURCES)}) nor a file or folder"
        )


def describe_source(source: str) -> str:
    """Where a source's text comes from, for the manifest."""
    if source == "pydoc":
        import platform

        return f"pydoc_data.topics (Python {platform.python_version()})"
    if source == "readmes":
        return "long descriptions of the installed distributions' metadata"
    return f"the text files under {Path(source).resolve()}"


def source_texts(source: str) -> Iterator[tuple[str, str]]:
    """(name, text) pairs of one source, in a fixed order."""
    check_source(source)
    if source not in CORPUS_SOURCES:
        yield from _file_texts(Path(source))
    elif source == "pydoc":
        from pydoc_data.topics import topics

        for name in sorted(topics):
            yield f"pydoc:{name}", topics[name]
    elif source == "readmes":
        for distribution in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
            metadata = distribution.metadata
            text = metadata.get_payload() or metadata.get("Description") or ""
            if len(text) >= _MIN_README_CHARACTERS:
                yield f"readme:{metadata['Name']}", text


def _file_texts(root: Path) -> Iterator[tuple[str, str]]:
    """A file's text, or every text file under a folder, named by their path below it."""
    files = [root] if root.is_file() else sorted(path for path in root.rglob("*") if path.is_file())
    for path in files:
        relative = path.relative_to(root) if path != root else Path(path.name)
        if any(part.startswith(".") for part in relative.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not text
        yield f"file:{relative}", text


def documents(
    texts: Iterator[tuple[str, str]], count_tokens: Callable[[str], int], max_tokens: int, min_tokens: int
) -> Iterator[tuple[str, str]]:
    """Pack each text's paragraphs (blank-line separated) into documents of at most ``max_tokens``
    tokens; yield the (name, document) pairs with at least ``min_tokens``. A paragraph longer than
    ``max_tokens`` is cut at line breaks, and a line longer than that is dropped."""
    for name, text in texts:
        pieces: list[str] = []
        size, part = 0, 0
        for paragraph in _paragraphs(text, count_tokens, max_tokens):
            tokens = count_tokens(paragraph)
            if pieces and size + tokens > max_tokens:
                if size >= min_tokens:
                    yield f"{name}#{part}", "\n\n".join(pieces)
                    part += 1
                pieces, size = [], 0
            pieces.append(paragraph)
            size += tokens
        if size >= min_tokens:
            yield f"{name}#{part}", "\n\n".join(pieces)


def _paragraphs(text: str, count_tokens: Callable[[str], int], max_tokens: int) -> Iterator[str]:
    for paragraph in text.split("\n\n"):
        paragraph = paragraph.strip("\n")
        if not paragraph.strip():
            continue
        if count_tokens(paragraph) <= max_tokens:
            yield paragraph
            continue
        lines: list[str] = []
        size = 0
        for line in paragraph.split("\n"):
            tokens = count_tokens(line) + 1  # and its line break
            if lines and size + tokens > max_tokens:
                yield "\n".join(lines)
                lines, size = [], 0
            if tokens <= max_tokens:
                lines.append(line)
                size += tokens
        if lines:
            yield "\n".join(lines)
