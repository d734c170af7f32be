"""What ``python -m sgl_kvevict.evaluate`` sends: the user's documents and questions, or probes made
from each document, or the bundled task set.

* a folder: every ``.txt`` / ``.md`` file in it (sorted by name), no questions: probes;
* a JSONL file: one ``{"document": ..., "questions": [...], "answers": [...]}`` per line (``questions``
  and ``answers`` optional; ``answers`` parallel to ``questions``, for accuracy);
* nothing: the bundled task set (``sgl_kvevict.measure.tasks``' ``facts``: filler with three numbered
  facts and their questions, at lengths spread over the context), with reference answers.

A probe is a question any model can be checked on without a reference answer, because stock's own
answer is the reference: ``continue`` quotes the first words of a sentence of the document and asks
for the rest of it; ``next`` quotes a sentence and asks for the one after it. Probes are drawn from
the sentences spread over the document (seeded), so both ends and the middle are asked about. Each
probe starts the reply for the model (``answer_prefix``: the quoted words, or an opening quote), so
its first generated tokens come from the document: left to themselves small models echo the
question first ("The sentence that starts ... is"), and a capped answer then compares mostly the
echo, which reads the uncompressed question, not the document's kept cache.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

DOCUMENT_SUFFIXES = (".txt", ".md")
PROBE_KINDS = ("continue", "next")
# How a ``next`` probe's reply starts: the sentence itself follows.
NEXT_SENTENCE_PREFIX = 'The sentence after it is: "'
# The bundled task set's document lengths, in model tokens, cycled (the default run: 6 documents of 2-5K).
BUNDLED_LENGTHS = (2000, 3500, 5000)


class InputError(ValueError):
    """Input the command cannot use; the message is the one line it prints."""


@dataclass(frozen=True)
class Question:
    """``text``: what the user asks; ``reference``: the expected answer, when the user gave one;
    ``answer_prefix``: the start of the assistant's reply (the bundled tasks' RULER-style prefix);
    ``kind``: ``user``, ``task`` or a probe kind."""

    text: str
    kind: str = "user"
    reference: Optional[str] = None
    answer_prefix: str = ""


@dataclass(frozen=True)
class Document:
    name: str
    text: str
    questions: tuple[Question, ...] = ()
    checks: tuple[Callable[[str], bool], ...] = field(default=(), compare=False, repr=False)  # bundled: exact checks


def read_documents(source: Optional[Path]) -> list[Document]:
    """The documents at ``source`` (a folder or a JSONL file); ``InputError`` in one line otherwise."""
    if source is None:
        return []
    if not source.exists():
        raise InputError(f"--documents {source}: no such file or folder")
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.is_file() and p.suffix.lower() in DOCUMENT_SUFFIXES)
        documents = [Document(p.name, p.read_text(errors="replace")) for p in files]
        documents = [d for d in documents if d.text.strip()]
        if not documents:
            raise InputError(f"--documents {source}: no non-empty {' or '.join(DOCUMENT_SUFFIXES)} file in this folder")
        return documents
    return _read_jsonl(source)


def _read_jsonl(path: Path) -> list[Document]:
    documents = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"--documents {path}, line {number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("document"), str) or not row["document"].strip():
            raise InputError(f'--documents {path}, line {number}: expected {{"document": "...", "questions": [...]}}')
        questions, answers = row.get("questions") or [], row.get("answers")
        if not isinstance(questions, list) or not all(isinstance(q, str) for q in questions):
            raise InputError(f"--documents {path}, line {number}: questions must be a list of strings")
        if answers is not None and (not isinstance(answers, list) or len(answers) != len(questions)):
            raise InputError(f"--documents {path}, line {number}: answers must be a list as long as questions")
        references = answers or [None] * len(questions)
        documents.append(Document(str(row.get("name") or f"line {number}"), row["document"],
                                  tuple(Question(q, "user", None if a is None else str(a)) for q, a in zip(questions, references))))  # fmt: skip
    if not documents:
        raise InputError(f"--documents {path}: no document in this file")
    return documents


def bundled_documents(count: int, count_tokens: Callable[[str], int], seed: int, lengths: Sequence[int] = BUNDLED_LENGTHS) -> list[Document]:
    """``count`` documents of the bundled ``facts`` task set, lengths cycled, with their questions and answers."""
    from sgl_kvevict.measure.tasks import make_task

    documents = []
    for index in range(count):
        length = lengths[index % len(lengths)]
        task = make_task("facts", seed * 100_003 + index, length, (index + 0.5) / count, count_tokens)
        questions = tuple(Question(q.question, "task", q.answer, q.answer_prefix) for q in task.questions)
        documents.append(Document(f"facts-{length}-{index}", task.context, questions, tuple(q.is_correct for q in task.questions)))
    return documents


# ---- probes ----------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'`(\[])|\n\s*\n")
_WORD = re.compile(r"\S+")


def sentences(text: str) -> list[str]:
    """The document's prose sentences that a probe can quote: 8-40 words, not code or table rows, said once."""
    found = []
    for raw in _SENTENCE_END.split(text):
        sentence = " ".join(raw.split())
        words = _WORD.findall(sentence)
        if not 8 <= len(words) <= 40 or sentence.startswith(("|", "```", "    ", ">>>", "$")):
            continue
        letters = sum(ch.isalpha() for ch in sentence)
        if letters < 0.6 * len(sentence):
            continue
        found.append(sentence)
    counts = {s: found.count(s) for s in found}
    return [s for s in found if counts[s] == 1]


def probes(text: str, count: int, seed: int, kinds: Sequence[str] = PROBE_KINDS) -> tuple[Question, ...]:
    """``count`` probes of the document, kinds alternating, over sentences spread through it (seeded)."""
    said = sentences(text)
    if len(said) < 2 or count < 1:
        return ()
    rng = random.Random(seed)
    slots = [min(len(said) - 2, int((i + rng.random()) * (len(said) - 1) / count)) for i in range(count)]
    made = []
    for i, at in enumerate(slots):
        kind = kinds[i % len(kinds)]
        if kind == "continue":
            words = said[at].split()
            head = " ".join(words[: max(4, len(words) // 2)])
            made.append(Question(f'In the document above, how does the sentence that starts "{head}" go on? '
                                 "Reply with that sentence, word for word.", "continue", answer_prefix=head))  # fmt: skip
        else:
            made.append(Question(f'In the document above, which sentence comes right after "{said[at]}"? '
                                 "Reply with that sentence only, word for word.", "next", answer_prefix=NEXT_SENTENCE_PREFIX))  # fmt: skip
    return tuple(made)


def with_questions(document: Document, count: int, seed: int) -> Document:
    """The document with its own questions, or ``count`` probes when it has none."""
    if document.questions:
        return document
    return Document(document.name, document.text, probes(document.text, count, seed), document.checks)
